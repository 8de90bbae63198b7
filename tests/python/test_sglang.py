"""wsync.sglang against a server that answers as SGLang 0.5.15.post1's routes do
(sglang_server.py: SGLang itself cannot run here, its kernels being CUDA-only).

In one process (sglang_check.py, in the torch 2 environment wsync.engine needs): an engine host
loaded from a checkpoint, the adapter pushing it into the server ("direct", in buckets, the version
named), the server's parameters bit-exact with the host's; the ABORT pause and the resume;
refusals (a server whose model has another shape, a server that is not there). As a deployment: wsync-local with `--engine-cmd "python -m wsync.engine --adapter sglang"`,
two syncs; after each the engine is verified bit-exact, the server holds exactly the engine form
of that step's checkpoint, and Generate through wsync names the version the server reports."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from conftest import BIN, ROOT
from sglang_server import FakeSglang
from wsync.engine import EngineHost

HERE = pathlib.Path(__file__).resolve().parent
PY2 = os.environ.get("WSYNC_MEGATRON_PYTHON")  # torch 2: what wsync.engine (and SGLang) need
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32}


def _model(tmp_path, seed):
    d = tmp_path / f"hf{seed}"
    subprocess.run([BIN / "wsync-model-gen", "--arch", "qwen3", "--preset", "tiny", "--seed", str(seed), "--out", d],
                   check=True, capture_output=True)
    return d


def _engine_form(hf_dir, name="oracle"):
    """The engine form of a checkpoint, as the reference loader lays it out: {name: tensor}."""
    host = EngineHost(name, (hf_dir / "config.json").read_text(), agent="127.0.0.1:1", checkpoint=str(hf_dir))
    try:
        return {n: torch.frombuffer(bytearray(host.buffer(n)), dtype=DTYPES[p.dtype]).view(p.shape)
                for n, p in host.params.items()}
    finally:
        host.close()


@pytest.mark.skipif(not PY2, reason="wsync.engine needs torch 2 ($WSYNC_MEGATRON_PYTHON)")
def test_the_adapter_loads_sglang_direct_follows_pauses_and_refuses_what_does_not_fit(tmp_path):
    hf = _model(tmp_path, 31)
    out = subprocess.run([PY2, HERE / "sglang_check.py", "--hf", hf], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(HERE)))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "sglang check passed" in out.stdout


@pytest.mark.skipif(not PY2, reason="the engine process needs torch 2 ($WSYNC_MEGATRON_PYTHON)")
def test_sglang_follows_the_syncs(tmp_path):
    steps = [_model(tmp_path, 70 + s) for s in (1, 2)]
    for hf in steps:
        subprocess.run([BIN / "wsync-shard", "--hf", hf, "--out", hf.with_name(hf.name + "-meg"), "--tp", "2"],
                       check=True, capture_output=True)
    oracle = [_engine_form(hf, f"oracle-{i}") for i, hf in enumerate(steps)]
    fake = FakeSglang({n: torch.zeros_like(t) for n, t in oracle[0].items()}, vocab_size=1000)
    src, cur = tmp_path / "src", tmp_path / "cur"
    shutil.copytree(steps[0].with_name(steps[0].name + "-meg"), src)
    shutil.copytree(steps[0], cur)
    second = steps[1].with_name(steps[1].name + "-meg")
    between = f"rm -rf {src} {cur} && cp -r {second} {src} && cp -r {steps[1]} {cur}"
    try:
        out = subprocess.run(
            [ROOT / "tools" / "wsync-local", "--source", src, "--rollout-engines", "1", "--syncs", "2",
             "--between-syncs", between, "--hf", cur, "--verify", "--prompt", "1,2,3", "--max-new-tokens", "4",
             "--engine-cmd", f"{PY2} -m wsync.engine --adapter sglang --sglang-url {fake.url}",
             "--workdir", tmp_path / "run"],
            env=dict(os.environ, WSYNC_BIN=str(BIN)), capture_output=True, text=True, timeout=300)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-5000:]
        # The server now holds step 2 exactly; generation through wsync named each sync's version.
        for n, t in oracle[1].items():
            assert torch.equal(fake.params[n].view(torch.uint8), t.view(torch.uint8)), n
        assert fake.weight_version == "2"
        for sync in (1, 2):
            got = re.search(rf"after sync {sync}\s+engine-0: version (\d+): ([0-9,]+)", text)
            assert got and int(got.group(1)) == sync, text[-3000:]
            assert text.count(f"version {sync}: bit-exact") == 1
        want = ",".join(map(str, fake.tokens_for(oracle[1], [1, 2, 3], 4)))
        assert re.search(rf"after sync 2\s+engine-0: version 2: {want}", text), (want, text[-3000:])
        versions = [b["weight_version"] for m, p, b in fake.log if p == "/update_weights_from_tensor"]
        assert versions == ["1", "2"], versions
    finally:
        fake.close()
