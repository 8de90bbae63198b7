"""wsync.engine: a HuggingFace transformers model as a wsync rollout engine (TransformersEngine on
the engine host), against transformers itself as the oracle (hf_oracle.py).

They run in the torch 2 environment `tools/setup.sh --torch` makes ($WSYNC_MEGATRON_PYTHON, set by ctest),
which has transformers, in one process (engine_check.py: every model parameter bit-exact with the
oracle's, views of the segment, a tied lm_head bound to the embedding, the refusals). Whole
deployments (two syncs each, every engine generating the oracle's tokens for every version) run
over the model catalog: test_fresh_load.py (catalog.py)."""

import json
import os
import pathlib
import subprocess

import pytest

from conftest import BIN

PY = os.environ.get("WSYNC_MEGATRON_PYTHON")
HERE = pathlib.Path(__file__).resolve().parent
PROMPT, MAX_NEW = "1,2,3,5,8", 6
# The default model's quantization_config.ignore, as wsync-int4's regexes.
DEFAULT_IGNORE = ["lm_head", ".*self_attn.*", r".*mlp\.gate$", ".*embed_tokens.*", ".*norm.*"]


def _has_transformers():
    if not PY:
        return False
    return subprocess.run([PY, "-c", "import transformers, wsync.engine"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _has_transformers(),
                                reason="no torch 2 environment with transformers ($WSYNC_MEGATRON_PYTHON)")

CASES = {
    # case: (wsync-model-gen args, INT4: None, "compressed-tensors" (the default model's own config) or "awq")
    "qwen3_bf16": (["--arch", "qwen3", "--preset", "tiny", "--tie"], None),  # tied word embeddings
    "qwen3moe_int4": (["--from-config", "default"], "compressed-tensors"),
    "qwen3moe_awq": (["--arch", "qwen3-moe", "--preset", "tiny"], "awq"),
    "deepseekv3_bf16": (["--arch", "deepseek-v3", "--preset", "tiny"], None),  # MLA; the router's bias a buffer
}
# An AWQ engine (docs/engine-formats.md): every linear but lm_head, the embeddings and the routers.
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
AWQ_IGNORE = ["lm_head", ".*embed_tokens.*", r".*mlp\.gate$"]


def _gen(case, seed, out):
    args, int4 = CASES[case]
    subprocess.run([BIN / "wsync-model-gen", *args, "--seed", str(seed), "--out", out / "hf"], check=True,
                   capture_output=True)
    if int4 == "awq":  # the engines serve AWQ: the model's config says so
        config_path = out / "hf" / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = AWQ_CONFIG
        config_path.write_text(json.dumps(config, indent=1))
    if int4:  # what the trainer agents send: the checkpoint's compressed-tensors (or AWQ) INT4 form
        fmt = ["--format", "awq", "--group-size", "64", "--ignore", *AWQ_IGNORE] if int4 == "awq" else [
            "--group-size", "128", "--ignore", *DEFAULT_IGNORE]
        subprocess.run([BIN / "wsync-int4", "quantize", "--in", out / "hf" / "model.safetensors", "--out",
                        out / "int4.safetensors", *fmt], check=True, capture_output=True)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_transformers_model_reads_the_engine_memory_bit_exact(tmp_path, case):
    step = _gen(case, 11, tmp_path)
    cmd = [PY, HERE / "engine_check.py", "--hf", step / "hf", "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW)]
    if CASES[case][1]:
        cmd += ["--int4", step / "int4.safetensors"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(HERE)))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "engine check passed" in out.stdout, out.stdout


def test_the_engine_process_refuses_what_it_cannot_serve(tmp_path):
    config = tmp_path / "config.json"
    _gen("qwen3_bf16", 3, tmp_path)
    out = subprocess.run([PY, "-m", "wsync.engine", "--model", tmp_path / "hf", "--tp-size", "2", "--agent", "x:1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--tp-size 2" in out.stderr, out.stderr
    out = subprocess.run([PY, "-m", "wsync.engine", "--model", tmp_path / "hf", "--agent", "x:1", "--adapter", "vllm",
                          "--param-memory", "cuda:0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "only the transformers adapter runs on CUDA" in out.stderr, out.stderr
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["num_key_value_heads"] = 3  # does not divide the 4 attention heads
    config.write_text(json.dumps(cfg))
    out = subprocess.run([PY, "-m", "wsync.engine", "--model", config, "--agent", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "wsync.engine: " in out.stderr and "num_key_value_heads" in out.stderr, out.stderr
