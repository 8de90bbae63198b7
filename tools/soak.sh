#!/usr/bin/env bash
# The soak: SYNCS syncs in a row on the demo deployment (the embedded default model, 4 trainer ranks
# TP2 x EP2 under mpirun, two reference engines of TP 2) while every engine answers a stream of
# generation requests. The weights change at every sync (three checkpoints of other seeds, in turn,
# renamed into the source directory before each sync), and after every sync every engine must
# answer a request with the version just published. Prints, at the end:
#   - failed syncs (target 0), engines that did not serve the version just published (target 0),
#     failed generation requests (target 0), the replies per version;
#   - per process (trainer agents, rollout agents, engines): RSS (private anonymous memory, RssAnon)
#     after sync WARM, half-way and after the last sync, and open file descriptors (target: RSS
#     growth < 1 %, reported with a WARN; fds +0, a failure beyond +2: a connection in flight at a
#     sample may count). The RSS of these small processes
#     creeps by glibc's per-thread arenas although their heap in use stays flat (docs/sync.md,
#     "Soak"), so RSS alone does not fail the soak;
#   - engine downtime per sync (Pause sent -> Continue answered, the longest engine: median, p99, max)
#     and the sync's own time;
#   - with --verify-every K, a bit-exact `wsyncctl verify` every K syncs against the checkpoint that
#     sync carried.
# Exit status 0 only when no sync, generation request or verify failed, every engine served every
# version just published, no process exited and no process's open fds grew.
# --self-test same-weights breaks the premise: the weights are left as they were before sync K (the
# first verified one) while the checks expect that sync's checkpoint: the soak must then fail.
#
#   tools/soak.sh [--syncs 200] [--warm 10] [--verify-every 50] [--backend gloo|shm] [--workdir DIR]
#                 [--self-test same-weights]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${WSYNC_BIN:-$here/build/bin}"
syncs=200 warm=10 verify_every=50 backend=gloo work="" self_test=""
while [ $# -gt 0 ]; do
  case "$1" in
    --syncs) syncs="$2"; shift 2 ;;
    --warm) warm="$2"; shift 2 ;;
    --verify-every) verify_every="$2"; shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    --workdir) work="$2"; shift 2 ;;
    --self-test) self_test="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "soak: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ "$warm" -lt "$syncs" ] || { echo "soak: --warm ($warm) must be less than --syncs ($syncs)" >&2; exit 2; }
case "$self_test" in ""|same-weights) ;; *) echo "soak: --self-test same-weights (not '$self_test')" >&2; exit 2 ;; esac
[ -z "$self_test" ] || [ "$verify_every" -gt 0 ] || { echo "soak: --self-test needs --verify-every K > 0" >&2; exit 2; }
own_work=0
if [ -z "$work" ]; then work="$(mktemp -d /tmp/wsync-soak.XXXXXX)"; own_work=1; fi
trap '[ "$own_work" = 1 ] && rm -rf "$work"' EXIT
mkdir -p "$work"
# Three checkpoints, in turn: sync i carries checkpoint i % 3 (sync 1: ckpt1, ...). The source
# directory starts as checkpoint 0's shards.
for c in 0 1 2; do
  "$bin/wsync-model-gen" --from-config default --seed $((5 + c)) --out "$work/hf$c" > /dev/null
  "$bin/wsync-shard" --hf "$work/hf$c" --out "$work/megatron$c" --tp 2 --ep 2 --dp 2 > /dev/null
done
cp -r "$work/megatron0" "$work/megatron"

cat > "$work/drive.py" <<'PY'
import json, os, statistics, subprocess, sys, time
bin_dir, syncs, warm, verify_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
work, self_test = sys.argv[5], sys.argv[6] if len(sys.argv) > 6 else ""
workdir = os.environ["WSYNC_WORKDIR"]
engines = os.environ["WSYNC_ENGINES"].split()
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

def step(i):
    """The trainer's step before sync i: checkpoint i % 3's shards renamed into the source directory
    (the trainer agents read it at every sync). --self-test same-weights skips it for the first
    verified sync, which still expects checkpoint i % 3."""
    if self_test == "same-weights" and i == verify_every:
        print(f"   soak: self-test: the weights are NOT changed before sync {i}", flush=True)
        return
    src = f"{work}/megatron{i % 3}"
    for f in sorted(os.listdir(src)):
        if f.startswith("rank-"):
            subprocess.run(["cp", f"{src}/{f}", f"{work}/megatron/{f}.tmp"], check=True)
            os.replace(f"{work}/megatron/{f}.tmp", f"{work}/megatron/{f}")

procs = processes()
failures, stale, downtime, total, at_warm, at_mid = [], [], [], [], None, None
mid = (warm + syncs) // 2
t_start = time.time()
for i in range(1, syncs + 1):
    step(i)
    r = subprocess.run(ctl + ["--json", "sync", "--wait"], capture_output=True, text=True)
    published = 0
    try:
        res = json.loads(r.stdout)
        published = res["version"] if res.get("outcome") == "done" else 0
    except (ValueError, KeyError):
        pass
    if r.returncode != 0 or not published:
        failures.append((i, (r.stderr or r.stdout).strip().splitlines()[-1:]))
    else:
        t = json.loads(subprocess.run(ctl + ["--json", "timings"], capture_output=True, text=True, check=True).stdout)
        phases = {p["phase"]: p["seconds"] for p in t["phases"]}
        downtime.append(phases.get("downtime", 0.0)); total.append(phases.get("total", 0.0))
        for e, addr in enumerate(engines):  # every engine serves the version just published
            g = subprocess.run(ctl + ["--json", "generate", "--engine", addr, "--prompt", "1,2,3", "--max-new-tokens",
                                      "2"], capture_output=True, text=True)
            try:
                got = json.loads(g.stdout)["version"] if g.returncode == 0 else None
            except (ValueError, KeyError):
                got = None
            if got != published:
                stale.append((i, e, published, got if got is not None else (g.stderr or g.stdout).strip()[-200:]))
    if verify_every > 0 and i % verify_every == 0:
        v = subprocess.run(ctl + ["verify", "--against", f"{work}/hf{i % 3}"], capture_output=True, text=True)
        if v.returncode != 0:
            lines = (v.stdout + v.stderr).strip().splitlines()
            failures.append((i, ["verify against checkpoint " + str(i % 3) + ": " + (lines[-1] if lines else "?")]))
    if i == warm: at_warm = sample(procs)
    if i == mid: at_mid = sample(procs)
    if i % 50 == 0: print(f"   soak: {i} of {syncs} syncs, {len(failures)} failed, {time.time() - t_start:.0f} s", flush=True)
at_end = sample(procs)
wall = time.time() - t_start

ok = True
print(f"# wsync soak: {syncs} syncs in {wall:.1f} s ({wall / syncs:.3f} s per sync with wsyncctl), demo model, "
      f"2 engines x TP 2, generation load on every engine")
print(f"# failed syncs or verifies: {len(failures)} (target 0)")
for i, msg in failures[:10]: print(f"#   sync {i}: {' '.join(msg)}")
ok &= not failures
print(f"# engines not serving the version just published: {len(stale)} (target 0)")
for i, e, want, got in stale[:10]: print(f"#   after sync {i}: engine-{e} answered {got}, want version {want}")
ok &= not stale
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

"$here/tools/wsync-local" --source "$work/megatron" --rollout-engines 2 --engine-tp 2 --syncs 0 --hf "$work/hf0" \
  --backend "$backend" --prompt 11,22,33,44,55 --max-new-tokens 8 --load --workdir "$work/run" \
  --then "python3 $work/drive.py $bin $syncs $warm $verify_every $work $self_test"
