"""Training processes of a Python trainer, one per Megatron rank (run under mpirun beside
`wsync-trainer-agent --source shm:$WSYNC_SHM_NAME`, as tools/wsync-local --trainer does). The
weights of step i come from the rank's file of the i-th --from directory (a stand-in for an
optimizer step); each step is written in place under the update lock and published as version
first_version + i. After each sync rank 0 checks the engines with `wsyncctl verify` against that
step's HF checkpoint (the --from directory's sibling hf/)."""

import argparse
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from safetensors_files import read_safetensors  # noqa: E402
from wsync.trainer import Publisher  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="steps", action="append", required=True)
    ap.add_argument("--first-version", type=int, default=1)
    a = ap.parse_args()
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    name = os.environ["WSYNC_SHM_NAME"]
    first = pathlib.Path(a.steps[0])
    with Publisher(name, rank, timeout=120) as pub:
        for dtype_shape in read_safetensors(first / f"rank-{rank:05d}.safetensors").items():
            tname, (dtype, shape, _) = dtype_shape
            pub.declare(tname, dtype, shape)
        pub.register((first / "config.json").read_text(), (first / "parallel.json").read_text(), timeout=120)
        print(f"rank {rank}: registered {len(pub.names)} tensors with shm:{name}", flush=True)
        start = os.environ.get("WSYNC_START_FILE")
        while start and not os.path.exists(start):
            time.sleep(0.1)
        for i, step in enumerate(a.steps):
            tensors = read_safetensors(pathlib.Path(step) / f"rank-{rank:05d}.safetensors")
            with pub.update():
                for tname, (_, _, data) in tensors.items():
                    pub.buffer(tname)[:] = data
            r = pub.publish(a.first_version + i, timeout=300)
            print(f"rank {rank}: version {r.version} synced (sync {r.sync_id}"
                  f"{', requested by another rank first' if r.coalesced else ''})", flush=True)
            if rank == 0:
                ctl = [os.path.join(os.environ["WSYNC_BIN"], "wsyncctl"), "--coordinator",
                       pathlib.Path(os.environ["WSYNC_COORDINATOR_FILE"]).read_text().strip(),
                       "--token-file", os.environ["WSYNC_TOKEN_FILE"]]
                subprocess.run(ctl + ["verify", "--against", str(pathlib.Path(step).parent / "hf")], check=True)
                print(f"   version {r.version} verified bit-exact against {pathlib.Path(step).parent / 'hf'}",
                      flush=True)


if __name__ == "__main__":
    main()
