"""wsync.adapters.sglang against a server that answers as SGLang 0.5.15.post1's routes do
(sglang_server.py: SGLang itself cannot run here, its kernels being CUDA-only), seeded with SGLang's
own parameters for the model (sglang_form.py: the names, shapes and dtypes of SGLang's model classes,
read from SGLang's code, not from wsync's engine form), and checked against what SGLang's own weight
loaders make of each checkpoint (sglang_form.expected: q/k/v and gate/up stacked, the vocabulary
padded to 64, a tied lm_head dropped, INT4 repacked to Marlin; computed in Python from the HF files,
sharing no code with wsync). docs/sglang.md, "The model SGLang holds", cites SGLang's code for each rule.

The oracle's Marlin repack (SGLang's kernel, step by step) agrees with a second formulation. In one
process (sglang_check.py, in the torch 2 environment wsync.engine needs): an engine host loaded from
a checkpoint, the adapter pushing it into the server ("direct", in buckets, the version named), the
server then holding SGLang's form of the checkpoint, bf16 and INT4; an engine form with k/v swapped
or non-zero padding fails the comparison, and so do expectations stacked, transposed, padded or
permuted otherwise; the ABORT pause and the resume; refusals (a server whose model has another
shape or lacks a name, a server that is not there). As a deployment, for Qwen3 (untied, tied, INT4)
and Qwen2 (q/k/v bias): wsync-local with `--engine-cmd "python -m wsync --adapter sglang"`,
two syncs; after each the server holds exactly SGLang's form of that step's checkpoint (every synced
parameter written once, INT4 metadata left alone), the engine verifies bit-exact, and Generate
through wsync names the version the server reports."""

import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import sglang_form
from conftest import BIN, ROOT
from sglang_server import FakeSglang

HERE = pathlib.Path(__file__).resolve().parent
PY2 = os.environ.get("WSYNC_MEGATRON_PYTHON")  # torch 2: what wsync.engine (and SGLang) need
MODELS = {  # name: (wsync-model-gen flags, the quantization_config the engine serves)
    "qwen3": (["--arch", "qwen3"], None),
    "qwen3-tied": (["--arch", "qwen3", "--tie"], None),
    "qwen2": (["--arch", "qwen2"], None),
    "qwen3-int4": (["--arch", "qwen3"], sglang_form.W4A16),
}


def _model(tmp_path, seed, model="qwen3"):
    d = tmp_path / f"hf{seed}"
    subprocess.run([BIN / "wsync-model-gen", *MODELS[model][0], "--preset", "tiny", "--seed", str(seed), "--out", d],
                   check=True, capture_output=True)
    return d


def test_the_oracles_marlin_repack_agrees_with_a_second_formulation():
    """sglang_form.marlin_repack follows SGLang's gptq_marlin_repack kernel step by step; vLLM's
    Python reference (marlin_weights with get_weight_perm, FORMATS.md §4.4) is another way to the
    same words; and FORMATS.md §4.2's worked example (word 0 of tile (0, 0))."""
    gen = torch.Generator().manual_seed(5)
    for k, n in ((256, 512), (512, 256), (128, 64), (256, 1024)):
        u = torch.randint(0, 16, (k, n), generator=gen)
        words = torch.zeros(k // 8, n, dtype=torch.int64)
        for i in range(8):
            words |= u[i::8] << (4 * i)
        gptq = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        marlin = sglang_form.marlin_repack(gptq, k, n)
        assert marlin.shape == (k // 16, 2 * n)
        assert torch.equal(marlin, sglang_form.marlin_repack_reference(u, k, n)), (k, n)
        word = int(marlin[0, 0]) & 0xFFFFFFFF
        assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(u[r, c]) for r, c in (
            (0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8))]


@pytest.mark.skipif(not PY2, reason="wsync.engine needs torch 2 ($WSYNC_MEGATRON_PYTHON)")
def test_the_adapter_loads_sglang_direct_follows_pauses_and_refuses_what_does_not_fit(tmp_path):
    hf = _model(tmp_path, 31)
    out = subprocess.run([PY2, HERE / "sglang_check.py", "--hf", hf], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(HERE)))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "sglang check passed" in out.stdout


@pytest.mark.skipif(not PY2, reason="the engine process needs torch 2 ($WSYNC_MEGATRON_PYTHON)")
@pytest.mark.parametrize("model", sorted(MODELS))
def test_sglang_holds_its_own_form_of_each_sync(tmp_path, model):
    quant = MODELS[model][1]
    steps = [_model(tmp_path, 70 + s, model) for s in (1, 2)]
    for hf in steps:
        subprocess.run([BIN / "wsync-shard", "--hf", hf, "--out", hf.with_name(hf.name + "-meg"), "--tp", "2"],
                       check=True, capture_output=True)
    config = json.loads((steps[0] / "config.json").read_text())
    if quant:
        config["quantization_config"] = quant
        (tmp_path / "quant.json").write_text(json.dumps(quant))
    # SGLang's loaders (and for INT4 its Marlin repack) on each step, without wsync.
    want = [sglang_form.expected(hf, quant) for hf in steps]
    metadata = sglang_form.metadata(config)  # INT4 weight_shape and empty placeholders: never synced
    synced = sorted(set(want[0]) - set(metadata))
    assert sglang_form.differences(want[0], want[1]) == synced, "every synced parameter changes"
    fake = FakeSglang(sglang_form.zero_params(config), vocab_size=config["vocab_size"])
    src, cur = tmp_path / "src", tmp_path / "cur"
    shutil.copytree(steps[0].with_name(steps[0].name + "-meg"), src)
    shutil.copytree(steps[0], cur)
    second = steps[1].with_name(steps[1].name + "-meg")
    between = f"rm -rf {src} {cur} && cp -r {second} {src} && cp -r {steps[1]} {cur}"
    try:
        out = subprocess.run(
            [ROOT / "tools" / "wsync-local", "--source", src, "--rollout-engines", "1", "--syncs", "2",
             "--between-syncs", between, "--hf", cur, "--verify", "--prompt", "1,2,3", "--max-new-tokens", "4",
             "--engine-cmd", f"{PY2} -m wsync --adapter sglang --sglang-url {fake.url}",
             "--workdir", tmp_path / "run", *(["--quant-config", tmp_path / "quant.json"] if quant else [])],
            env=dict(os.environ, WSYNC_BIN=str(BIN)), capture_output=True, text=True, timeout=300)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-5000:]
        # After each sync the server held exactly SGLang's form of that step, every parameter written once.
        assert sorted(fake.held) == ["1", "2"], sorted(fake.held)
        seed = sglang_form.zero_params(config)
        for version, w in zip(("1", "2"), want):
            held = fake.held[version]
            assert sorted(held) == sorted(w), version  # SGLang's names, no more, no fewer
            assert sglang_form.differences({n: held[n] for n in synced}, {n: w[n] for n in synced}) == [], version
            assert sglang_form.differences({n: held[n] for n in metadata}, {n: seed[n] for n in metadata}) == []
            assert sorted(fake.written[version]) == synced, version
        assert fake.weight_version == "2"
        for sync in (1, 2):
            got = re.search(rf"after sync {sync}\s+engine-0: version (\d+): ([0-9,]+)", text)
            assert got and int(got.group(1)) == sync, text[-3000:]
            assert text.count(f"version {sync}: bit-exact") == 1
        tokens = ",".join(map(str, fake.tokens_for({**want[1], **{n: seed[n] for n in metadata}}, [1, 2, 3], 4)))
        assert re.search(rf"after sync 2\s+engine-0: version 2: {tokens}", text), (tokens, text[-3000:])
        versions = [b["weight_version"] for m, p, b in fake.log if p == "/update_weights_from_tensor"]
        assert versions == ["1", "2"], versions
    finally:
        fake.close()
