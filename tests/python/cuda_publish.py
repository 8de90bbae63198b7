"""Training processes in Python whose weights live on a device (tests/integration/e2e_python_cuda.sh
runs them under tools/wsync-local --trainer; the device bundle's python_cuda check on a GPU host).

Every rank reads its rank file of --src (a Megatron source directory) into torch tensors on
--device (cpu or cuda:N), hands them to wsync.trainer.Publisher.share (CUDA tensors are declared by
IPC handle and read by the trainer agent in place on the device; host tensors move into the shared
segment), and publishes two versions: the weights as loaded, then every tensor doubled in place on
the device. After each sync, rank 0 checks the engines bit-exact (wsyncctl verify) against the HF
checkpoint of what the ranks hold (their rank files, wsync-shard --to-hf).
"""

import argparse
import os
import pathlib
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from safetensors_files import read_safetensors, write_safetensors  # noqa: E402
from wsync.trainer import Publisher  # noqa: E402


def wait_for(paths, timeout=120):
    end = time.time() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.time() > end:
            raise TimeoutError(f"waiting for {paths}")
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--first-version", type=int, default=1)
    a = ap.parse_args()
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    src, out = pathlib.Path(a.src), pathlib.Path(a.out)
    bin_dir = os.environ["WSYNC_BIN"]
    tensors = []
    for name, (dtype, shape, data) in read_safetensors(src / f"rank-{rank:05d}.safetensors").items():
        assert dtype == "BF16", (name, dtype)
        t = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(shape).to(a.device)
        tensors.append((name, t))
    pub = Publisher(os.environ["WSYNC_SHM_NAME"], rank, timeout=120)
    pub.share(tensors, (src / "config.json").read_text(), (src / "parallel.json").read_text(), timeout=120)
    where = {str(t.device) for _, t in tensors}
    print(f"rank {rank}: shared {len(tensors)} tensors on {', '.join(sorted(where))}", flush=True)
    wait_for([os.environ["WSYNC_START_FILE"]])
    ctl = [os.path.join(bin_dir, "wsyncctl"), "--coordinator",
           pathlib.Path(os.environ["WSYNC_COORDINATOR_FILE"]).read_text().strip(),
           "--token-file", os.environ["WSYNC_TOKEN_FILE"]]
    for step in range(2):
        if step > 0:
            with pub.update():
                for _, t in tensors:
                    t.mul_(2)  # in place: on the device the agent reads by IPC handle
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
        version = a.first_version + step
        r = pub.publish(version, timeout=300)
        print(f"rank {rank}: version {r.version} synced (sync {r.sync_id})", flush=True)
        step_dir = out / f"step{step}"
        (step_dir / "megatron").mkdir(parents=True, exist_ok=True)
        write_safetensors(step_dir / "megatron" / f"rank-{rank:05d}.safetensors",
                          {n: ("BF16", tuple(t.shape), t.detach().cpu().contiguous().view(torch.uint8).numpy()
                               .tobytes()) for n, t in tensors})
        (step_dir / f"done-{rank}").touch()
        if rank == 0:
            wait_for([step_dir / f"done-{r}" for r in range(world)])
            for f in ("config.json", "parallel.json"):
                (step_dir / "megatron" / f).write_text((src / f).read_text())
            subprocess.run([os.path.join(bin_dir, "wsync-shard"), "--src", str(step_dir / "megatron"), "--to-hf",
                            str(step_dir / "hf")], check=True, stdout=subprocess.DEVNULL)
            subprocess.run(ctl + ["verify", "--against", str(step_dir / "hf")], check=True)
            subprocess.run(ctl + ["verify", "--independent", "--against", str(step_dir / "hf")], check=True)
            print(f"   version {version}: every engine bit-exact with the HF conversion of the step {step} rank files "
                  "(checksums, and the independent reference)", flush=True)
            (step_dir / "verified").touch()
        wait_for([step_dir / "verified"], timeout=300)
    pub.close()


if __name__ == "__main__":
    main()
