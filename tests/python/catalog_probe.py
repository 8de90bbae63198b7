"""Greedy requests to every engine of a running wsync-local deployment, one per prompt, run by
test_fresh_load.py between the syncs (wsync-local --between-syncs, --then). Appends one JSON line
per reply to OUT: {"sync", "engine", "prompt", "version", "tokens"}.

    python3 catalog_probe.py --workdir W --engines N --sync S --prompt 1,2,3 [--prompt ...]
                             --max-new-tokens K --out FILE
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--engines", type=int, required=True)
    ap.add_argument("--sync", type=int, required=True)
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = pathlib.Path(args.workdir)
    ctl = [str(pathlib.Path(os.environ["WSYNC_BIN"]) / "wsyncctl"), "--token-file", str(work / "token"), "--json"]
    with open(args.out, "a") as out:
        for e in range(args.engines):
            address = (work / f"engine-{e}-0").read_text().strip()
            for prompt in args.prompt:
                r = subprocess.run([*ctl, "generate", "--engine", address, "--prompt", prompt, "--max-new-tokens",
                                    str(args.max_new_tokens)], capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    print(f"catalog_probe: engine-{e} ({address}): {r.stdout}{r.stderr}", file=sys.stderr)
                    return 1
                reply = json.loads(r.stdout.strip().splitlines()[-1])
                out.write(json.dumps({"sync": args.sync, "engine": e, "prompt": prompt, **reply}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
