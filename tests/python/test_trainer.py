"""wsync.trainer.Publisher against a real trainer agent (conftest.py): declaring, registering,
the refusals that name what is wrong and change nothing, the shared tensors, the update lock."""

import os
import pathlib
import subprocess
import sys

import numpy as np  # noqa: F401 (Debian python3-numpy, tools/setup.sh)
import pytest
import torch  # Debian python3-torch

from conftest import BIN, ROOT
from wsync import WsyncError
from wsync.trainer import Publisher


def declare_all(pub, tensors, skip=(), reshape=None):
    for name, (dtype, shape, _) in tensors.items():
        if name in skip:
            continue
        pub.declare(name, dtype, reshape[1] if reshape and name == reshape[0] else shape)


def test_nothing_listening_is_unavailable_naming_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("WSYNC_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(WsyncError) as e:
        Publisher("nobody-here", 0, timeout=0.3)
    assert e.value.code_name == "UNAVAILABLE", e.value
    assert "shm:nobody-here rank 0" in str(e.value)


def test_bad_arguments_are_refused_before_the_agent_is_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("WSYNC_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(WsyncError) as e:
        Publisher("bad/name", 0, timeout=0.3)
    assert e.value.code_name == "INVALID_ARGUMENT", e.value
    with pytest.raises(WsyncError) as e:
        Publisher("job", "0")
    assert e.value.code_name == "INVALID_ARGUMENT"


def test_register_names_what_does_not_fit_and_a_fixed_set_registers(trainer_agent, rank_tensors, config_texts):
    config, parallel = config_texts
    names = sorted(rank_tensors)
    with Publisher(trainer_agent.name, 0, timeout=60) as pub:
        with pytest.raises(WsyncError) as e:
            pub.declare(names[0], "FP8", (2, 2))
        assert e.value.code_name == "INVALID_ARGUMENT" and names[0] in str(e.value)
        with pytest.raises(WsyncError) as e:
            pub.declare(names[0], "BF16", ("two", 2))
        assert e.value.code_name == "INVALID_ARGUMENT"
        # One tensor missing, one mis-shaped, one the model does not have.
        dtype, shape, _ = rank_tensors[names[1]]
        declare_all(pub, rank_tensors, skip={names[0]}, reshape=(names[1], (shape[0] + 1,) + shape[1:]))
        pub.declare("decoder.layers.0.not_a_parameter.weight", "BF16", (4, 4))
        with pytest.raises(WsyncError) as e:
            pub.declare(names[2], "BF16", (1,))
        assert e.value.code_name == "ALREADY_EXISTS", e.value
        with pytest.raises(WsyncError) as e:
            pub.register(config, parallel, timeout=60)
        msg = str(e.value)
        assert names[0] in msg and names[1] in msg and "decoder.layers.0.not_a_parameter.weight" in msg, msg
        with pytest.raises(WsyncError):
            pub.buffer(names[2])  # nothing was registered
    # A new client with the right set.
    with Publisher(trainer_agent.name, 0, timeout=60) as pub:
        declare_all(pub, rank_tensors)
        pub.register(config, parallel, timeout=60)
        assert sorted(pub.names) == names


def test_the_shared_tensors_are_the_declared_bytes_and_numpy_views_write_them(trainer_agent, rank_tensors,
                                                                              config_texts):
    with Publisher(trainer_agent.name, 0, timeout=60) as pub:
        declare_all(pub, rank_tensors)
        pub.register(*config_texts, timeout=60)
        with pub.update():
            for name, (dtype, shape, data) in rank_tensors.items():
                buf = pub.buffer(name)
                assert len(buf) == len(data), name
                assert bytes(buf) == bytes(len(data)), f"{name}: a new segment starts zeroed"
                buf[:] = data
        for name, (dtype, shape, data) in rank_tensors.items():
            arr = pub.numpy(name)
            assert arr.shape == shape
            assert arr.tobytes() == data, name
        name = next(iter(rank_tensors))
        with pub.update():
            pub.numpy(name)[...] = 0
        assert bytes(pub.buffer(name)) == bytes(len(rank_tensors[name][2]))
        with pytest.raises(WsyncError) as e:
            pub.buffer("no.such.tensor")
        assert e.value.code_name == "NOT_FOUND" and "no.such.tensor" in str(e.value)
        with pub.update():
            with pytest.raises(WsyncError) as e:
                pub.publish(3)
            assert e.value.code_name == "FAILED_PRECONDITION"
    with pytest.raises(WsyncError) as e:
        pub.publish(3)
    assert "closed" in str(e.value)


def test_torch_parameters_move_into_the_shared_segment(trainer_agent, rank_tensors, config_texts):
    params = []
    for name, (dtype, shape, data) in rank_tensors.items():
        assert dtype == "BF16"
        t = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(shape).clone()
        params.append((name, torch.nn.Parameter(t)))
    with Publisher(trainer_agent.name, 0, timeout=60) as pub:
        pub.share(params, *config_texts, timeout=60)
        for name, p in params:
            assert p.data.data_ptr() == pub.torch(name).data_ptr(), name
            assert bytes(pub.buffer(name)) == rank_tensors[name][2]
        with pub.update(), torch.no_grad():
            params[0][1].mul_(2)
        assert torch.equal(pub.torch(params[0][0]), params[0][1].data)


def test_a_python_training_job_syncs_every_step_bit_exact(tmp_path):
    """4 Python training processes (TP 2 x EP 2 x DP 2) publish two steps through wsync-local; after
    each sync rank 0 checks the engine bit-exact against that step's checkpoint (wsyncctl verify)."""
    for step in (1, 2):
        subprocess.run([BIN / "wsync-model-gen", "--from-config", "default", "--seed", str(90 + step), "--out",
                        tmp_path / f"s{step}" / "hf"], check=True, capture_output=True)
        subprocess.run([BIN / "wsync-shard", "--hf", tmp_path / f"s{step}" / "hf", "--out",
                        tmp_path / f"s{step}" / "megatron", "--tp", "2", "--ep", "2", "--dp", "2"], check=True,
                       capture_output=True)
    ranks = pathlib.Path(__file__).with_name("train_ranks.py")
    cmd = (f"{sys.executable} {ranks} --from {tmp_path}/s1/megatron --from {tmp_path}/s2/megatron "
           f"--first-version 20")
    env = dict(os.environ, WSYNC_BIN=str(BIN))
    out = subprocess.run([ROOT / "tools" / "wsync-local", "--source", tmp_path / "s1" / "megatron",
                          "--rollout-engines", "1", "--engine-tp", "2", "--workdir", tmp_path / "run",
                          "--trainer", cmd], env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for v in (20, 21):
        assert f"version {v} verified bit-exact" in text, text[-4000:]
        assert text.count(f"version {v} synced") == 4, text[-4000:]


def test_fp8_codes_are_a_dtype_wsync_speaks():
    """FP8 E4M3 weights (docs/spec/FP8.md) travel as F8_E4M3: one byte per code, torch's
    float8_e4m3fn, and their raw codes as numpy uint8 (numpy has no FP8). Debian's torch 1.13 has
    no FP8: there the dtype is refused by name."""
    from wsync.dtypes import ITEMSIZE, numpy_dtype, torch_dtype, torch_dtype_name

    if not hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(TypeError, match="F8_E4M3 needs a torch with float8_e4m3fn"):
            torch_dtype("F8_E4M3")
        assert torch_dtype_name(torch.zeros(1, dtype=torch.bfloat16)) == "BF16"
        return
    w = torch.tensor([1.0, -448.0, 0.0, 2.0 ** -9], dtype=torch.float32).to(torch.float8_e4m3fn)
    assert torch_dtype_name(w) == "F8_E4M3" and ITEMSIZE["F8_E4M3"] == 1
    assert torch_dtype("F8_E4M3") == torch.float8_e4m3fn
    codes = w.view(torch.uint8).numpy()
    assert codes.dtype == numpy_dtype("F8_E4M3")
    assert codes.tolist() == [0x38, 0xFE, 0x00, 0x01]
