"""examples/rl_loop: the example RL loop runs (megatron-core trainers, two vLLM engines, a sync
every step), every reply of every step comes from the version published last, every sync succeeds.
Needs both environments `tools/setup.sh --torch` makes ($WSYNC_MEGATRON_PYTHON, $WSYNC_VLLM_PYTHON)."""

import os
import re
import subprocess

import pytest

from conftest import BIN, ROOT

NEED = [os.environ.get("WSYNC_MEGATRON_PYTHON"), os.environ.get("WSYNC_VLLM_PYTHON")]


def _check_steps(text, steps):
    """Every step's line: both engines' 4 replies on the version published last, then the next synced."""
    for step in range(1, steps + 1):
        line = re.search(rf"step {step}: (.*)", text)
        assert line, text[-5000:]
        assert f"engine-0: 4 on version {step}, engine-1: 4 on version {step};" in line.group(1), line.group(0)
        assert f"synced version {step + 1} in" in line.group(1), line.group(0)


@pytest.mark.skipif(not all(NEED) or not all(os.path.exists(p) for p in NEED if p),
                    reason="needs $WSYNC_MEGATRON_PYTHON and $WSYNC_VLLM_PYTHON")
def test_the_example_rl_loop_trains_and_syncs_every_step(tmp_path):
    out = subprocess.run([ROOT / "examples" / "rl_loop" / "run.sh", "--steps", "3", "--workdir", tmp_path],
                         env=dict(os.environ, WSYNC_BIN=str(BIN)), capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    _check_steps(text, 3)
    assert "mean reward by step:" in text and "the training processes' syncs succeeded" in text, text[-3000:]


def _has_ray():
    py = os.environ.get("WSYNC_MEGATRON_PYTHON")
    return bool(py) and os.path.exists(py) and subprocess.run([py, "-c", "import ray, wsync.ray"]).returncode == 0


@pytest.mark.skipif(not _has_ray(), reason="needs Ray and megatron-core in $WSYNC_MEGATRON_PYTHON (setup.sh --torch)")
def test_the_example_rl_loop_runs_as_ray_actors(tmp_path):
    """ray_run.py: the same loop with the trainers and engines as Ray actors (a local Ray instance),
    the agents placed beside them by wsync.ray; every step's replies on the version published last
    (the script exits non-zero otherwise, and this checks each line too)."""
    out = subprocess.run([os.environ["WSYNC_MEGATRON_PYTHON"], ROOT / "examples" / "rl_loop" / "ray_run.py",
                          "--steps", "3", "--workdir", tmp_path], env=dict(os.environ, WSYNC_BIN=str(BIN)),
                         capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    _check_steps(text, 3)
    assert "ray_run: 3 steps, a sync after each" in text, text[-3000:]
