#!/usr/bin/env bash
# The soak: SYNCS syncs in a row on the demo deployment (the embedded default model, 4 trainer ranks
# TP2 x EP2 under mpirun, two reference engines of TP 2) while every engine answers a stream of
# generation requests. Prints, at the end:
#   - failed syncs (target 0) and failed generation requests (target 0), the replies per version;
#   - per process (trainer agents, rollout agents, engines): RSS (private anonymous memory, RssAnon)
#     after sync WARM, half-way and after the last sync, and open file descriptors (target: RSS
#     growth < 1 %, reported with a WARN; fds +0, a failure beyond +2: a connection in flight at a
#     sample may count). The RSS of these small processes
#     creeps by glibc's per-thread arenas although their heap in use stays flat (docs/sync.md,
#     "Soak"), so RSS alone does not fail the soak;
#   - engine downtime per sync (Pause sent -> Continue answered, the longest engine: median, p99, max)
#     and the sync's own time;
#   - with --verify-every K, a bit-exact `wsyncctl verify` every K syncs.
# Exit status 0 only when no sync, generation request or verify failed, no process exited and no
# process's open fds grew.
#
#   tools/soak.sh [--syncs 200] [--warm 10] [--verify-every 50] [--backend gloo|shm] [--workdir DIR]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${WSYNC_BIN:-$here/build/bin}"
syncs=200 warm=10 verify_every=50 backend=gloo work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --syncs) syncs="$2"; shift 2 ;;
    --warm) warm="$2"; shift 2 ;;
    --verify-every) verify_every="$2"; shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    --workdir) work="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "soak: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ "$warm" -lt "$syncs" ] || { echo "soak: --warm ($warm) must be less than --syncs ($syncs)" >&2; exit 2; }
own_work=0
if [ -z "$work" ]; then work="$(mktemp -d /tmp/wsync-soak.XXXXXX)"; own_work=1; fi
trap '[ "$own_work" = 1 ] && rm -rf "$work"' EXIT
mkdir -p "$work"
"$bin/wsync-model-gen" --from-config default --seed 5 --out "$work/hf" > /dev/null
"$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2 > /dev/null

cat > "$work/drive.py" <<'PY'
import json, os, statistics, subprocess, sys, time
bin_dir, syncs, warm, verify_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
workdir, hf = os.environ["WSYNC_WORKDIR"], os.environ["WSYNC_HF"]
ctl = [f"{bin_dir}/wsyncctl", "--coordinator", os.environ["WSYNC_COORDINATOR"], "--token-file",
       os.environ["WSYNC_TOKEN_FILE"]]
kinds = ("wsync-trainer-agent", "wsync-rollout-agent", "wsync-ref-engine")

def processes():  # pid -> name, for this deployment's processes (their command lines name the workdir)
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try: argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError: continue
        name = os.path.basename(argv[0].decode(errors="replace"))
        if name in kinds and workdir.encode() in b" ".join(argv): out[int(pid)] = name
    return out

def sample(pids):
    s = {}
    for pid in pids:
        try:
            status = dict(l.split(":", 1) for l in open(f"/proc/{pid}/status") if ":" in l)
            s[pid] = (int(status["RssAnon"].split()[0]), len(os.listdir(f"/proc/{pid}/fd")))
        except OSError:
            s[pid] = None
    return s

procs = processes()
failures, downtime, total, at_warm, at_mid = [], [], [], None, None
mid = (warm + syncs) // 2
t_start = time.time()
for i in range(1, syncs + 1):
    r = subprocess.run(ctl + ["sync", "--wait"], capture_output=True, text=True)
    if r.returncode != 0:
        failures.append((i, (r.stderr or r.stdout).strip().splitlines()[-1:]))
    else:
        t = json.loads(subprocess.run(ctl + ["--json", "timings"], capture_output=True, text=True, check=True).stdout)
        phases = {p["phase"]: p["seconds"] for p in t["phases"]}
        downtime.append(phases.get("downtime", 0.0)); total.append(phases.get("total", 0.0))
    if verify_every > 0 and i % verify_every == 0:
        v = subprocess.run(ctl + ["verify", "--against", hf], capture_output=True, text=True)
        if v.returncode != 0: failures.append((i, ["verify: " + (v.stderr or v.stdout).strip().splitlines()[-1]]))
    if i == warm: at_warm = sample(procs)
    if i == mid: at_mid = sample(procs)
    if i % 50 == 0: print(f"   soak: {i} of {syncs} syncs, {len(failures)} failed, {time.time() - t_start:.0f} s", flush=True)
at_end = sample(procs)
wall = time.time() - t_start

ok = True
print(f"# wsync soak: {syncs} syncs in {wall:.1f} s ({wall / syncs:.3f} s per sync with wsyncctl), demo model, "
      f"2 engines x TP 2, generation load on every engine")
print(f"# failed syncs: {len(failures)} (target 0)")
for i, msg in failures[:10]: print(f"#   sync {i}: {' '.join(msg)}")
ok &= not failures
print(f"# per process, sync {warm} -> sync {syncs}: RssAnon (KiB) and open fds (targets: RSS growth < 1 %, fds +0)")
print(f"#  {'process':22s} {'pid':>7} {'rss@'+str(warm):>10} {'rss@'+str(mid):>10} {'rss@'+str(syncs):>10} {'growth':>8} {'fds@'+str(warm):>8} {'fds@'+str(syncs):>8}")
worst = 0.0
for pid, name in sorted(procs.items(), key=lambda kv: (kv[1], kv[0])):
    a, b = at_warm.get(pid), at_end.get(pid)
    if a is None or b is None:
        print(f"   {name:22s} {pid:>7} exited during the soak"); ok = False; continue
    growth = 100.0 * (b[0] - a[0]) / max(a[0], 1)
    worst = max(worst, growth)
    m = at_mid.get(pid) or (0, 0)
    flag = "" if growth < 1.0 else f"  WARN +{b[0] - a[0]} KiB"
    if b[1] > a[1] + 2: flag += "  FAIL fds grew"  # a connection in flight at a sample may count one or two
    print(f"   {name:22s} {pid:>7} {a[0]:>10} {m[0]:>10} {b[0]:>10} {growth:>7.2f}% {a[1]:>8} {b[1]:>8}{flag}")
    ok &= b[1] <= a[1] + 2
q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")
if downtime:
    print(f"# engine downtime per sync (s): median {statistics.median(downtime):.4f}, p99 {q(downtime, 0.99):.4f}, "
          f"max {max(downtime):.4f}; sync total: median {statistics.median(total):.4f}, max {max(total):.4f}")
errors = 0
for f in sorted(os.listdir(f"{workdir}/logs")):
    if f.startswith("load-") and f.endswith(".err"):
        errors += sum(1 for l in open(f"{workdir}/logs/{f}") if l.strip())
print(f"# failed generation requests during the soak: {errors} (target 0)")
ok &= errors == 0
print("# soak: " + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY

"$here/tools/wsync-local" --source "$work/megatron" --rollout-engines 2 --engine-tp 2 --syncs 0 --hf "$work/hf" \
  --backend "$backend" --prompt 11,22,33,44,55 --max-new-tokens 8 --load --workdir "$work/run" \
  --then "python3 $work/drive.py $bin $syncs $warm $verify_every"
