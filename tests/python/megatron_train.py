"""Training processes of a real megatron-core job on CPU, one per rank (under mpirun beside
`wsync-trainer-agent --source shm:$WSYNC_SHM_NAME`, as tools/wsync-local --trainer runs them).

Every rank builds the GPTModel of --hf-config with megatron's local spec (TP / EP from the flags,
gloo, bf16 as Float16Module casts it), takes its weights either from --init (the rank files of a
Megatron source directory made by wsync-shard from an HF checkpoint: the names checked against the
model's on the way) or, with --megatron-init SEED, from megatron-core's own seeded initialisation
(megatron_forward.seeded_weights: no weight from wsync; --init then only gives the config), and
creates a wsync.megatron.MegatronPublisher. Then, for steps 0..--steps: step 0 publishes the initial
weights, every later step first takes a real optimizer step (forward and backward on random tokens,
SGD, or Adam at an RL learning rate with --adam LR; with --pp > 1, a deterministic in-place scaling of every weight, megatron's pipeline schedule
being out of this script's scope). After each sync every rank dumps its weights as a source
directory (--out/step{k}/megatron), rank 0 converts it to HF with `wsync-shard --to-hf` (the trainer
agents' own gather and conversion) and checks two things:

- the engines hold exactly that conversion (`wsyncctl verify`, bit for bit: the sync's transport,
  quantization and repack; and `verify --independent`, the reference decoder; the sync's delta figures
  are printed, `wsyncctl timings`), which alone would prove nothing about the conversion itself;
- that conversion is the Megatron model: transformers' logits on it (AutoModelForCausalLM, float32)
  equal megatron-core's own float32 forward of the step's weights (a float32 copy of the model,
  every rank taking part) within megatron_logits.TOLERANCE of the logits' scale.

The CPU harness (megatron-core 0.16 assumes CUDA in places) is examples/rl_loop/megatron_cpu.py."""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl_loop"))
import megatron_cpu  # noqa: E402 (the CPU harness the example RL loop uses too)
import megatron_logits  # noqa: E402
from safetensors_files import write_safetensors  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-config", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--first-version", type=int, default=1)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--megatron-init", type=int, default=None, metavar="SEED",
                    help="megatron-core's own seeded initialisation instead of --init's rank files")
    ap.add_argument("--adam", type=float, default=None, metavar="LR",
                    help="Adam at this learning rate instead of SGD at 0.05 (e.g. 3e-6, an RL rate)")
    a = ap.parse_args()
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world)

    megatron_cpu.setup(a.tp, a.ep, a.pp)
    from wsync.megatron import MegatronPublisher, local_tensors

    cfg = json.loads(pathlib.Path(a.hf_config).read_text())
    init = pathlib.Path(a.init)
    if a.megatron_init is not None:
        torch.manual_seed(a.megatron_init)
    model = megatron_cpu.gpt_model(cfg, megatron_cpu.padded_vocab(init), a.tp, a.ep, a.pp)
    if a.megatron_init is not None:
        import megatron_forward
        megatron_forward.seeded_weights(model, a.megatron_init)
    else:
        megatron_cpu.load_source(model, init, rank)  # the initial weights: this rank's file
    # The float32 copy the logits check runs (its weights copied from the model at every step).
    twin = megatron_cpu.gpt_model(cfg, megatron_cpu.padded_vocab(init), a.tp, a.ep, a.pp, dtype=torch.float32,
                                  parallel_output=False)
    check_tokens = megatron_logits.tokens_for(cfg["vocab_size"])

    pub = MegatronPublisher(model, (init / "config.json").read_text(), os.environ["WSYNC_SHM_NAME"], timeout=120)
    print(f"rank {rank}: registered {len(pub.tensors)} megatron tensors, parallel {json.dumps(pub.parallel)}",
          flush=True)
    start = os.environ.get("WSYNC_START_FILE")
    while start and not os.path.exists(start):
        time.sleep(0.1)

    opt = (torch.optim.Adam(model.parameters(), lr=a.adam) if a.adam is not None
           else torch.optim.SGD(model.parameters(), lr=0.05))
    gen = torch.Generator().manual_seed(1234)  # the same tokens on every rank
    seq = 32
    ctl = [os.path.join(os.environ["WSYNC_BIN"], "wsyncctl"), "--coordinator",
           pathlib.Path(os.environ["WSYNC_COORDINATOR_FILE"]).read_text().strip(),
           "--token-file", os.environ["WSYNC_TOKEN_FILE"]]
    for step in range(a.steps + 1):
        if step > 0 and a.pp > 1:
            # Pipeline stages would need megatron's pipeline schedule; the step is a deterministic
            # in-place change of every weight instead (what the sync must carry is the same).
            with torch.no_grad():
                for _, t in local_tensors(model):
                    t.mul_(1.0 + 0.125 * step)
            if rank == 0:
                print(f"step {step}: weights scaled, {len(local_tensors(model))} tensors changed", flush=True)
        elif step > 0:
            before = [t.detach().clone() for _, t in local_tensors(model)]
            tokens = torch.randint(0, cfg["vocab_size"], (2, seq), generator=gen)
            pos = torch.arange(seq).unsqueeze(0).expand(2, seq)
            mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
            loss = model(tokens, pos, mask, labels=tokens).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            changed = sum(not torch.equal(b, t) for b, (_, t) in zip(before, local_tensors(model)))
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, {changed} of {len(before)} tensors changed", flush=True)
        version = a.first_version + step
        r = pub.publish(version, timeout=300)
        print(f"rank {rank}: version {r.version} synced (sync {r.sync_id})", flush=True)
        # The step's checkpoint, as the training job holds it.
        src = pathlib.Path(a.out) / f"step{step}" / "megatron"
        src.mkdir(parents=True, exist_ok=True)
        write_safetensors(src / f"rank-{rank:05d}.safetensors",
                          {n: ("BF16", tuple(t.shape), t.detach().contiguous().view(-1).view(torch.uint8).numpy()
                               .tobytes()) for n, t in local_tensors(model)})
        if rank == 0:
            (src / "config.json").write_text((init / "config.json").read_text())
            (src / "parallel.json").write_text(json.dumps(pub.parallel))
        dist.barrier()
        if rank == 0:
            hf = src.parent / "hf"
            subprocess.run([os.path.join(os.environ["WSYNC_BIN"], "wsync-shard"), "--src", str(src), "--to-hf",
                            str(hf)], check=True, stdout=subprocess.DEVNULL)
            subprocess.run(ctl + ["verify", "--against", str(hf)], check=True)
            subprocess.run(ctl + ["verify", "--against", str(hf), "--independent"], check=True)
            print(f"   version {version}: every engine bit-exact with the HF conversion of the step {step} rank files",
                  flush=True)
            timings = subprocess.run(ctl + ["timings", str(version)], check=True, capture_output=True, text=True)
            for line in timings.stdout.splitlines():
                if line.startswith(("deltas from", "in full")):
                    print(f"   version {version}: {line}", flush=True)
        weights = dict(local_tensors(model))
        with torch.no_grad():
            for n, t32 in local_tensors(twin):
                t32.copy_(weights[n])  # bf16 -> float32: exact
        logits = megatron_logits.megatron_logits(twin, check_tokens)  # every rank
        if rank == 0:
            r = megatron_logits.check(logits, hf, check_tokens)
            print(f"   version {version}: the conversion computes the Megatron model's logits: max|diff| "
                  f"{r['max_diff']:.3g} of logits up to {r['scale']:.3g} (rel {r['rel']:.3g}, fp32 noise "
                  f"{r['fp32_noise']:.3g}, tolerance {r['tolerance']:g}): {'ok' if r['ok'] else 'FAILED'}", flush=True)
            if not r["ok"]:
                sys.exit(1)
        dist.barrier()
    pub.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
