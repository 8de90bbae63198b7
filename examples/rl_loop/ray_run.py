"""The example RL loop as Ray actors (README.md beside this file): two megatron-core trainer actors
(TP 2, CPU, train.py's Learner) and two engine actors (each a `python -m wsync` engine process,
transformers or vLLM), with wsync's agents placed beside them by wsync.ray; a sync after every
optimizer step, and every reply checked against the version published last.

    build/venv-torch/bin/python examples/rl_loop/ray_run.py [--steps N] [--engine transformers|vllm]
        [--workdir DIR] [--address RAY_ADDRESS]

Without --address (or RAY_ADDRESS) it starts a Ray instance on this machine for the run. Needs a
built checkout ($WSYNC_BIN, default build/bin) and Ray, megatron-core and the engine's library in
this Python (tools/setup.sh --torch puts them in build/venv-torch).
"""

import argparse
import ctypes
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here))
import train  # noqa: E402

from wsync.ray import RolloutAgents, TrainerAgents, rollout_agent_address  # noqa: E402


@ray.remote(num_cpus=0)
class TrainerActor(train.Learner):
    """A Megatron rank in a Ray actor: train.py's Learner, and where it runs."""

    def node(self):
        return ray.util.get_node_ip_address()


def _members(ctl):
    """The rollout agents that joined the coordinator (0 while it does not answer)."""
    r = subprocess.run(ctl + ["--json", "status"], capture_output=True, text=True)
    return json.loads(r.stdout)["members"] if r.returncode == 0 else 0


@ray.remote(num_cpus=0)
def free_port():
    with socket.socket() as s:
        s.bind((ray.util.get_node_ip_address(), 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class EngineActor:
    """One engine rank (TP 1): a `python -m wsync` engine process with this actor's rollout agent."""

    def __init__(self, index, adapter, config, token, group):
        self.index, self.adapter, self.config, self.token, self.group = index, adapter, config, token, group
        self.address = None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.serve()

    def serve(self):
        agent = rollout_agent_address(self.group, self.index)
        ip = ray.util.get_node_ip_address()
        out = pathlib.Path(tempfile.mkdtemp(prefix=f"wsync-engine-{self.index}-"))
        log = open(out / "log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wsync", "--adapter", self.adapter, "--model", self.config, "--engine-id",
             f"engine-{self.index}", "--listen", f"{ip}:0", "--address-file", str(out / "address"), "--agent", agent,
             "--token-file", self.token], stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL))  # dies with this actor
        for _ in range(3000):
            if (out / "address").exists() and (out / "address").read_text().strip():
                self.address = (out / "address").read_text().strip()
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.index} exited: {(out / 'log').read_text()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"engine {self.index} did not listen within 300 s")

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--workdir")
    ap.add_argument("--address", default=os.environ.get("RAY_ADDRESS"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    bindir = os.environ.setdefault("WSYNC_BIN", str(here.parent.parent / "build" / "bin"))
    work = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="wsync-rl-ray."))
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(work / "hf"), str(work / "init")], check=True)
    subprocess.run([f"{bindir}/wsync-model-gen", "--arch", "qwen3", "--preset", "tiny", "--seed", "7", "--out",
                    str(work / "hf")], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([f"{bindir}/wsync-shard", "--hf", str(work / "hf"), "--out", str(work / "init"), "--tp", "2"],
                   check=True, stdout=subprocess.DEVNULL)
    token = work / "token"
    token.write_text(os.urandom(24).hex())
    token.chmod(0o600)

    env = {"PYTHONPATH": str(here), "WSYNC_BIN": bindir}
    if a.address:
        ray.init(address=a.address, runtime_env={"env_vars": env}, log_to_driver=False)
    else:
        ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100_000_000,
                 runtime_env={"env_vars": env}, log_to_driver=False)

    # The trainer: two Megatron ranks (TP 2), their torch.distributed group at rank 0's node, and
    # their MegatronPublishers connecting to the agents wsync.ray starts beside them.
    shm = f"wsync-rl-ray-{os.getpid()}"
    # The trainers on the driver's node (their gloo group's address is there; a real job places
    # them with its placement group and finds rank 0's node the same way).
    here_node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    port = ray.get(free_port.options(scheduling_strategy=here_node).remote())
    master = ray.util.get_node_ip_address()
    learners = [TrainerActor.options(scheduling_strategy=here_node).remote(
        str(work / "init"), 2, rank, 2, f"tcp://{master}:{port}") for rank in range(2)]
    trainer = TrainerAgents(learners, source=f"shm:{shm}", token_file=str(token), log_dir=str(work / "agents"))
    coordinator = trainer.start(wait=False)  # the agents wait for their training process to register
    ray.get([l.connect.remote(shm) for l in learners], timeout=300)
    trainer.ready(timeout=120)
    nodes = ray.get([l.node.remote() for l in learners])

    engines = [EngineActor.remote(i, a.engine, str(work / "hf" / "config.json"), str(token), "rl") for i in range(2)]
    rollout = RolloutAgents(engines, coordinator, group="rl", token_file=str(token), log_dir=str(work / "agents"))
    rollout.start()
    addresses = ray.get([e.serve.remote() for e in engines], timeout=600)
    print(f"trainer actors on {nodes}, coordinator {coordinator}; engines {addresses}", flush=True)
    ctl = [f"{bindir}/wsyncctl", "--coordinator", coordinator, "--token-file", str(token)]

    def publish(version):
        (v, took), _ = ray.get([l.publish.remote(version) for l in learners])
        return v, took

    # Every rollout agent a member of the coordinator before the first sync (as wsync-local waits):
    # an engine whose agent joins after it misses that version, and its first rollouts find no weights.
    deadline = time.time() + 120
    while (members := _members(ctl)) < len(engines):
        if time.time() > deadline:
            sys.exit(f"only {members} of {len(engines)} rollout agents joined the coordinator at {coordinator}")
        time.sleep(0.1)
    version, took = publish(1)
    print(f"version {version}: the initial weights on {len(engines)} engines ({took:.2f} s)", flush=True)
    rng = random.Random(a.seed)
    vocab = ray.get(learners[0].__ray_call__.remote(lambda self: self.cfg["vocab_size"]))
    history = []
    for step in range(1, a.steps + 1):
        prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
        batch = train.rollouts(addresses, ctl, prompts, a.max_new_tokens)
        stale = [(e, v) for e, _, _, v in batch if v != version]
        if stale:
            sys.exit(f"replies from another version than {version}: {stale}")
        (reward, loss), _ = ray.get([l.train.remote(batch, a.prompt_len, a.max_new_tokens) for l in learners])
        version, took = publish(step + 1)
        history.append(reward)
        print(train.step_line(step, batch, reward, loss, version, took), flush=True)
    print("mean reward by step: " + " ".join(f"{r:.3f}" for r in history), flush=True)
    ray.get([e.stop.remote() for e in engines])
    ray.get([l.close.remote() for l in learners])
    rollout.stop()
    trainer.stop()
    print(f"ray_run: {a.steps} steps, a sync after each, every reply on the version published last", flush=True)


if __name__ == "__main__":
    main()
