"""The training processes of the example RL loop: one per Megatron rank, under mpirun beside the
wsync trainer agents (tools/wsync-local --trainer runs them; run.sh sets everything up). Its
Learner is also what ray_run.py runs in each trainer actor.

A real megatron-core GPTModel (Qwen3 layout, TP from --tp, on CPU with gloo: megatron_cpu.py)
learns by REINFORCE from the rollout engines' generations:

    publish version 1 (the initial weights) -> every engine serves it
    for each step:
        rank 0 asks every engine for completions of a few prompts; every reply names the weight
            version that produced it, which must be the version published last
        every rank: reward = the share of completion tokens in a target set (ids < vocab / 8),
            advantage = the reward's deviation from the batch mean, loss = -advantage * log p
            (megatron's own vocab-parallel cross entropy), backward, Adam step
        every rank: MegatronPublisher.publish(step + 1): one wsync sync to every engine

Prints one line per step: the replies per engine and version, the mean reward, the loss, the time
the sync took, the share of rank 0's bf16 elements the step changed, and with a delta base what
the sync sent and how many quantization groups (INT4 groups, FP8 blocks or rows, AWQ units) it did
not quantize again.
"""

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import megatron_cpu  # noqa: E402


def rollouts(engines, ctl, prompts, max_new):
    """Every engine's completion of every prompt: [(engine index, prompt, completion, version)]."""
    out = []
    for e, address in enumerate(engines):
        for prompt in prompts:
            r = subprocess.run(ctl + ["--json", "generate", "--engine", address, "--prompt",
                                      ",".join(map(str, prompt)), "--max-new-tokens", str(max_new)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"engine {e} at {address}: {r.stderr.strip() or r.stdout.strip()}")
            reply = json.loads(r.stdout)
            out.append((e, prompt, reply["tokens"], reply["version"]))
    return out


class Learner:
    """One training rank: a megatron-core GPTModel (TP from `tp`, CPU, gloo) learning by REINFORCE,
    and its MegatronPublisher. main() below runs one per mpirun rank; ray_run.py one per Ray actor."""

    def __init__(self, init, tp, rank, world, init_method, lr=3e-3):
        warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # Apex, CUDA hints
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        megatron_cpu.setup(tp)
        self.rank, self.init = rank, pathlib.Path(init)
        self.cfg = json.loads((self.init / "config.json").read_text())
        self.model = megatron_cpu.gpt_model(self.cfg, megatron_cpu.padded_vocab(self.init), tp=tp)
        megatron_cpu.load_source(self.model, self.init, rank)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.pub = None

    def connect(self, shm_name):
        """The MegatronPublisher (collective: every rank), once this rank's trainer agent runs with
        --source shm:<shm_name>."""
        from wsync.megatron import MegatronPublisher

        self.pub = MegatronPublisher(self.model, (self.init / "config.json").read_text(), shm_name, timeout=120)

    def publish(self, version, timeout=300):
        """One wsync sync (collective: every rank); the version published and the seconds it took."""
        t0 = time.time()
        return self.pub.publish(version, timeout=timeout).version, time.time() - t0

    def train(self, batch, prompt_len, max_new):
        """One REINFORCE step on [(engine, prompt, completion, version)] (the same batch on every
        rank); the mean reward and the loss."""
        target = self.cfg["vocab_size"] // 8
        P, K = prompt_len, max_new
        rewards = torch.tensor([sum(t < target for t in c) / K for _, _, c, _ in batch], dtype=torch.float32)
        adv = rewards - rewards.mean()
        seq = torch.tensor([p + c for _, p, c, _ in batch], dtype=torch.long)
        inp, labels = seq[:, :-1], seq[:, 1:]
        n = inp.shape[1]
        pos = torch.arange(n).unsqueeze(0).expand_as(inp)
        mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)
        nll = self.model(inp, pos, mask, labels=labels).float()  # [b, n]: -log p(labels), vocab-parallel
        logp = -nll[:, P - 1:].sum(dim=1)  # the completion's tokens
        loss = -(adv * logp).mean() / K
        loss.backward()
        before = [p.detach().to(torch.bfloat16, copy=True) for p in self.model.parameters()]
        self.opt.step()
        self.opt.zero_grad()
        # What a sync sees of the step: the bf16 elements of this rank's parameters that changed.
        after = [p.detach().to(torch.bfloat16) for p in self.model.parameters()]
        self.changed = sum(int((b != a).sum()) for b, a in zip(before, after))
        self.elements = sum(b.numel() for b in before)
        return rewards.mean().item(), loss.item()

    def close(self):
        self.pub.close()
        dist.destroy_process_group()


def sent(ctl, version):
    """What the sync of `version` sent, from `wsyncctl timings` ("" unless the trainer agents keep a
    delta base: wsync-local --delta auto|on)."""
    r = subprocess.run(ctl + ["--json", "timings", str(version)], capture_output=True, text=True)
    d = json.loads(r.stdout).get("delta") if r.returncode == 0 else None
    if not d:
        return ""
    how = f"deltas from version {d['base']}" if d["base"] else "in full"
    groups = d.get("quant_groups", 0)
    reused = ""
    if groups:
        quantize = sum(p["seconds"] for p in json.loads(r.stdout)["phases"] if p["phase"] == "quantize")
        reused = (f"; quantization groups reused {d.get('reused_groups', 0)} of {groups}, "
                  f"{d.get('undigested_groups', 0)} without digests; quantize {1000 * quantize:.1f} ms")
    return (f" ({how}: {d['sent_bytes'] / 2**20:.2f} of {d['tensor_bytes'] / 2**20:.2f} MiB, "
            f"{100 * d['sent_bytes'] / d['tensor_bytes']:.2f} %{reused})")


def step_line(step, batch, reward, loss, version, took):
    per = {}
    for e, _, _, v in batch:
        per[(e, v)] = per.get((e, v), 0) + 1
    replies = ", ".join(f"engine-{e}: {c} on version {v}" for (e, v), c in sorted(per.items()))
    return (f"step {step}: {replies}; mean reward {reward:.3f}; loss {loss:+.4f}; "
            f"synced version {version} in {took:.2f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True, help="Megatron source directory (wsync-shard) of the initial weights")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per engine per step")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    learner = Learner(a.init, a.tp, rank, world, f"tcp://127.0.0.1:{a.port}", a.lr)
    learner.connect(os.environ["WSYNC_SHM_NAME"])
    start = os.environ["WSYNC_START_FILE"]
    while not os.path.exists(start):
        time.sleep(0.1)
    engines = pathlib.Path(os.environ["WSYNC_ENGINES_FILE"]).read_text().split()
    ctl = [os.path.join(os.environ["WSYNC_BIN"], "wsyncctl"), "--coordinator",
           pathlib.Path(os.environ["WSYNC_COORDINATOR_FILE"]).read_text().strip(),
           "--token-file", os.environ["WSYNC_TOKEN_FILE"]]

    version, took = learner.publish(1)
    if rank == 0:
        print(f"version {version}: the initial weights on {len(engines)} engines ({took:.2f} s)", flush=True)
    rng = random.Random(a.seed)
    vocab = learner.cfg["vocab_size"]
    history = []
    for step in range(1, a.steps + 1):
        batch = [None]
        if rank == 0:
            prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
            batch[0] = rollouts(engines, ctl, prompts, a.max_new_tokens)
            stale = [(e, v) for e, _, _, v in batch[0] if v != version]
            assert not stale, f"replies from another version than {version}: {stale}"
        dist.broadcast_object_list(batch, src=0)
        reward, loss = learner.train(batch[0], a.prompt_len, a.max_new_tokens)
        version, took = learner.publish(step + 1)
        if rank == 0:
            history.append(reward)
            changed = f"; bf16 elements changed {100 * learner.changed / learner.elements:.3f} % (rank 0)"
            print(step_line(step, batch[0], reward, loss, version, took) + changed + sent(ctl, version), flush=True)
    if rank == 0:
        print("mean reward by step: " + " ".join(f"{r:.3f}" for r in history), flush=True)
    learner.close()


if __name__ == "__main__":
    main()
