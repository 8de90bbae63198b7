"""wsync.megatron with real megatron-core on CPU (tests/python/megatron_train.py): a GPTModel
trained for a few steps under mpirun, TP 2 dense and EP 2 MoE (INT4 experts), a sync after every
step, every engine bit-exact with the checkpoint of that step; and PP 2, whose steps change the
weights in place (no pipeline schedule). Runs in the megatron-core
environment `tools/setup.sh --torch` makes ($WSYNC_MEGATRON_PYTHON, set by ctest)."""

import os
import pathlib
import re
import socket
import subprocess

import pytest
import torch

from conftest import BIN, ROOT
from wsync import WsyncError
from wsync.megatron import _te_norm_names, local_tensors, wsync_name

MEGATRON_PYTHON = os.environ.get("WSYNC_MEGATRON_PYTHON")


def test_names_follow_megatron_to_hf():
    assert wsync_name("module.module.decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight") == \
        "decoder.layers.3.mlp.experts.linear_fc1.weight5"
    assert wsync_name("module.embedding.word_embeddings.weight") == "embedding.word_embeddings.weight"
    assert wsync_name("decoder.layers.0.mlp.experts.linear_fc2.weight7") == "decoder.layers.0.mlp.experts.linear_fc2.weight7"
    assert wsync_name("decoder.layers.1.mlp.router.expert_bias") == "decoder.layers.1.mlp.router.expert_bias"
    # Local-spec norms: fused names for a GQA layer with a dense MLP; an MoE layer keeps
    # pre_mlp_layernorm, an MLA layer its input_layernorm.
    names = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.1.input_layernorm.weight", "decoder.layers.1.self_attention.linear_q_proj.weight",
             "decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.router.weight"]
    assert _te_norm_names(names) == {
        "decoder.layers.0.input_layernorm.weight": "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"}


def test_model_chunks_are_refused_naming_them():
    # Virtual pipeline stages hand over a list of model chunks: refused before anything is declared.
    with pytest.raises(WsyncError) as e:
        local_tensors([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    assert e.value.code_name == "UNIMPLEMENTED" and "2 model chunks" in str(e.value)


@pytest.mark.skipif(not MEGATRON_PYTHON, reason="no megatron-core environment ($WSYNC_MEGATRON_PYTHON)")
@pytest.mark.parametrize("case, gen, shard, train", [
    ("dense_tp2", ["--arch", "qwen3", "--preset", "tiny"], ["--tp", "2"], ["--tp", "2"]),
    ("moe_ep2_int4", ["--from-config", "default"], ["--tp", "1", "--ep", "2", "--dp", "2"], ["--ep", "2"]),
    ("dense_pp2", ["--arch", "qwen3", "--preset", "tiny"], ["--pp", "2"], ["--pp", "2"]),
])
def test_megatron_steps_sync_bit_exact(tmp_path, case, gen, shard, train):
    subprocess.run([BIN / "wsync-model-gen", *gen, "--seed", "77", "--out", tmp_path / "hf"], check=True,
                   capture_output=True)
    subprocess.run([BIN / "wsync-shard", "--hf", tmp_path / "hf", "--out", tmp_path / "init", *shard], check=True,
                   capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = pathlib.Path(__file__).with_name("megatron_train.py")
    cmd = (f"{MEGATRON_PYTHON} {script} --hf-config {tmp_path}/hf/config.json --init {tmp_path}/init "
           f"--out {tmp_path}/steps {' '.join(train)} --steps 2 --first-version 30 --port {port}")
    out = subprocess.run([ROOT / "tools" / "wsync-local", "--source", tmp_path / "init", "--rollout-engines", "1",
                          "--engine-tp", "2", "--workdir", tmp_path / "run", "--trainer", cmd],
                         env=dict(os.environ, WSYNC_BIN=str(BIN)), capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    for step, v in enumerate((30, 31, 32)):
        assert f"version {v} verified bit-exact against the step {step} checkpoint" in text, text[-5000:]
    if "--pp" in train:  # pipeline stages: the weights are changed in place (megatron_train.py)
        assert text.count("weights scaled") == 2, text[-5000:]
        return
    changed = [int(c) for c in re.findall(r"step \d: loss [0-9.]+, (\d+) of \d+ tensors changed", text)]
    assert len(changed) == 2 and min(changed) > 0, text[-5000:]  # the steps trained: new weights each time
