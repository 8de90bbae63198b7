#!/usr/bin/env bash
# wsync's end-to-end sync benchmark: a generated ~2 GB Qwen3-MoE-style model (bench2g preset),
# 4 trainer ranks (TP2 x EP2) -> ENGINES rollout engines (TP 1, INT4 experts), SYNCS warm-up syncs
# and one measured sync (the first sync pays page faults for every buffer), then, measured in the
# same run on the same backend, a raw broadcast of the same number of bytes to
# the same number of receivers. Prints the per-phase table of the last sync, the ratio
# total sync / raw broadcast, the CPU time the last sync and the raw broadcast cost (summed over
# every process), and the peak memory (VmHWM) of every rollout agent and trainer agent.
#
# --keep K: expert pruning (docs/expert-pruning.md): every MoE layer keeps K of its 32 experts (a
# scrambled choice, different per layer); the engines serve the pruned model.
# --engine-tp T: engines of T ranks (ENGINES * T rollout agents).
# --mode broadcast|sharded|both: the delivery measured (docs/sync.md "Sharded delivery"); with both,
# one run measures broadcast then sharded (each after a warm-up sync of its own) and prints, per
# mode, the total time, the bytes each engine rank received (and its share: 1/T of the broadcast
# bytes plus what every rank keeps whole), the bytes each trainer rank sent, and the ratio of the
# sync to this host's limit: the most bytes one process must send or receive, at the rate of a raw
# one-to-one gloo broadcast of that many bytes measured in the same run.
#
#   tools/bench-sync.sh [--engines 2] [--engine-tp 1] [--mode broadcast] [--syncs 1] [--bucket-mib 256]
#                       [--keep K] [--pause-for-whole-sync] [--bucket-mac auto|on|off] [--workdir DIR]
#                       [--format compressed-tensors|awq|fp8]
# --format: the engines' format (docs/engine-formats.md): compressed-tensors Marlin (the default),
# AWQ-Marlin or block FP8 (128 x 128), with the same targets (the experts, the dense MLPs).
# --bucket-mac: authenticated buckets (docs/bucket_format.md); auto (the default) is on here (the
# deployment has a token); off measures the sync without the tags.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${WSYNC_BIN:-$here/build/bin}"
engines=2 syncs=1 bucket=256 work="" keep="" whole="" tp=1 mode=broadcast mac=auto format=compressed-tensors
while [ $# -gt 0 ]; do
  case "$1" in
    --engines) engines="$2"; shift 2 ;;
    --engine-tp) tp="$2"; shift 2 ;;
    --mode) mode="$2"; shift 2 ;;
    --syncs) syncs="$2"; shift 2 ;;
    --bucket-mib) bucket="$2"; shift 2 ;;
    --workdir) work="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    --pause-for-whole-sync) whole="--pause-for-whole-sync"; shift ;;
    --bucket-mac) mac="$2"; shift 2 ;;
    --format) format="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "bench-sync: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
case "$mode" in broadcast|sharded|both) ;; *) echo "bench-sync: --mode broadcast|sharded|both" >&2; exit 2 ;; esac
case "$format" in compressed-tensors|awq|fp8) ;; *) echo "bench-sync: --format compressed-tensors|awq|fp8" >&2; exit 2 ;; esac
modes="$mode"
[ "$mode" = both ] && modes="broadcast sharded"
# A --workdir is kept (its model is reused by the next run); a directory of our own (~4 GB) is
# removed when the run succeeds.
if [ -z "$work" ]; then
  work="$(mktemp -d /tmp/wsync-bench-sync.XXXXXX)"
  trap 'rc=$?; if [ "$rc" = 0 ]; then rm -rf "$work"; else echo "bench-sync: failed; its files are in $work" >&2; fi' EXIT
fi
mkdir -p "$work"
if [ "$format" = fp8 ]; then  # the same targets in block FP8 (docs/spec/FP8.md)
  cat > "$work/quant.json" <<'Q'
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
 "modules_to_not_convert": ["re:.*self_attn.*"]}
Q
elif [ "$format" = awq ]; then  # the same INT4 targets as AWQ (docs/engine-formats.md)
  cat > "$work/quant.json" <<'Q'
{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm",
 "modules_to_not_convert": ["self_attn"]}
Q
else
  cat > "$work/quant.json" <<'Q'
{"quant_method": "compressed-tensors", "format": "pack-quantized",
 "config_groups": {"group_0": {"targets": ["Linear"],
   "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": true}}},
 "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*norm.*"]}
Q
fi
[ -d "$work/hf" ] || "$bin/wsync-model-gen" --arch qwen3-moe --preset bench2g --seed 7 --out "$work/hf"
[ -d "$work/megatron" ] || "$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2

cat > "$work/measure.sh" <<'M'
#!/usr/bin/env bash
set -euo pipefail
bin="$1" work="$2" engines="$3" mode="$4"
ctl=("$bin/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE")
# A warm-up sync of this delivery mode (its buffers differ), then the measured one, with the CPU
# time (utime + stime, all threads) of every wsync process around it.
"${ctl[@]}" sync --wait --delivery "$mode" > /dev/null
procs=$(pgrep -f "wsync-(rollout-agent|trainer-agent|ref-engine).*$work" | tr '\n' ' ')
cpu() { for pid in $procs; do awk '{print $14 + $15}' "/proc/$pid/stat"; done | awk '{s += $1} END {print s}'; }
c0=$(cpu)
"${ctl[@]}" sync --wait --delivery "$mode" > /dev/null
c1=$(cpu)
echo "$(( c1 - c0 )) $(getconf CLK_TCK) $(nproc)" > "$work/cpu-$mode.txt"
"${ctl[@]}" --json timings > "$work/timings-$mode.json"
# Bytes each rollout agent received in it (its log's last "prepared" line).
for f in "$WSYNC_WORKDIR"/logs/agent-*.log; do
  echo "$(basename "$f" .log) $(grep "prepared:" "$f" | tail -n1 | sed -n 's/.* tensors, \([0-9]*\) bytes in.*/\1/p')"
done > "$work/received-$mode.txt"
bytes=$(python3 -c 'import json,sys; t=json.load(open(sys.argv[1])); print(max(p.get("bytes",0) for p in t["phases"]))' "$work/timings-$mode.json")
# Bytes each trainer rank sent in it (its "done on this rank" line of that sync).
sid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["sync_id"])' "$work/timings-$mode.json")
grep "sync $sid done on this rank" "$WSYNC_WORKDIR/logs/trainer.log" |
  sed -n 's/.*trainer\[\([0-9]*\)\].* (\([0-9]*\) bytes) sent.*/rank-\1 \2/p' | sort > "$work/sent-$mode.txt"
# This host's limit: the most bytes one process sends or receives, through a raw one-to-one broadcast.
most=$(python3 -c '
import sys
sent = max(int(l.split()[1]) for l in open(sys.argv[1]) if len(l.split()) == 2)
got = max(int(l.split()[1]) for l in open(sys.argv[2]) if len(l.split()) == 2)
print(max(sent, got))' "$work/sent-$mode.txt" "$work/received-$mode.txt")
"$bin/wsync-bench-comm" --backend gloo --ranks 2 -b "$most" -e "$most" -n 2 -w 1 > "$work/limit-$mode.txt"
# Peak memory of the processes while they are still up.
for pid in $(pgrep -f "wsync-(rollout-agent|trainer-agent|ref-engine).*$work"); do
  printf "%s %s %s %s\n" "$(tr '\0' ' ' < /proc/$pid/cmdline | awk '{print $1}' | xargs basename)" \
    "$(awk '/VmHWM/ {print $2}' /proc/$pid/status)" "$(awk '/RssShmem/ {print $2}' /proc/$pid/status)" "$pid"
done > "$work/memory-$mode.txt"
# The raw broadcast of the same bytes to every rollout agent, same backend.
agents=$(ls "$WSYNC_WORKDIR"/logs/agent-*.log | wc -l)
"$bin/wsync-bench-comm" --backend gloo --ranks $((agents + 1)) -b "$bytes" -e "$bytes" -n 2 -w 1 > "$work/raw-$mode.txt"
M
chmod +x "$work/measure.sh"
prune_args=()
label="bench2g Qwen3-MoE"
if [ -n "$keep" ]; then
  python3 - "$work/hf/config.json" "$keep" > "$work/map.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); k = int(sys.argv[2]); e = c["num_experts"]
dense = set(c.get("mlp_only_layers", []))
layers = {str(l): [(7 * i + 3 * l) % e for i in range(k)] for l in range(c["num_hidden_layers"]) if l not in dense}
print(json.dumps({"num_experts": e, "layers": layers}))
PY
  prune_args=(--expert-map "$work/map.json")
  label="bench2g Qwen3-MoE pruned to $keep experts per layer"
fi
label="$label, $format, bucket MAC $mac"

"$here/tools/wsync-local" --source "$work/megatron" --quant-config "$work/quant.json" --rollout-engines "$engines" \
  --engine-tp "$tp" --syncs "$syncs" --bucket-mib "$bucket" --bucket-mac "$mac" --workdir "$work/run" \
  --agent-flags "--engine-timeout-ms 600000 $whole" "${prune_args[@]}" \
  --then "for m in $modes; do $work/measure.sh $bin $work $engines \$m || exit 1; done" > "$work/local.log" 2>&1 ||
  { tail -30 "$work/local.log"; exit 1; }

for m in $modes; do
python3 - "$work" "$engines" "$bucket" "$label" "$whole" "$tp" "$m" <<'PY'
import json, sys, re
work, engines, bucket, label, whole, tp, mode = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                                sys.argv[5], int(sys.argv[6]), sys.argv[7])
t = json.load(open(f"{work}/timings-{mode}.json"))
total = next(p["seconds"] for p in t["phases"] if p["phase"] == "total")
nbytes = max(p.get("bytes", 0) for p in t["phases"])
raw_us = raw_cpu = None
for line in open(f"{work}/raw-{mode}.txt"):
    f = line.split()
    if len(f) >= 9 and f[0].isdigit() and f[3] == "0":   # the broadcast row (root 0): time, ..., cpu
        raw_us, raw_cpu = float(f[4]), float(f[8]) / 1e6; break
print(f"# wsync-bench-sync: {label}, 4 trainer ranks (TP2 x EP2) -> {engines} engines (TP {tp}), INT4 experts, "
      f"{bucket} MiB buckets, gloo, {mode} delivery")
print(f"#{'phase':>18} {'seconds':>10} {'bytes':>14} {'GB/s':>8}")
for p in t["phases"]:
    b = p.get("bytes", 0)
    rate = f"{b / p['seconds'] / 1e9:8.2f}" if b and p["seconds"] > 0 else f"{'-':>8}"
    print(f" {p['phase']:>18} {p['seconds']:10.4f} {b:14d} {rate}")
raw = raw_us / 1e6
print(f"# raw gloo broadcast of the same {nbytes} bytes to {engines * tp} receivers: {raw:.3f} s ({nbytes / raw / 1e9:.2f} GB/s)")
cont = next((p["seconds"] for p in t["phases"] if p["phase"] == "continue"), 0.0)
print(f"# total sync / raw broadcast = {total / raw:.2f} (target <= 1.25)")
down = next((p["seconds"] for p in t["phases"] if p["phase"] == "downtime"), 0.0)
print(f"# engine downtime (Pause sent -> Continue answered, longest engine): {down:.3f} s of the {total:.3f} s sync "
      f"({100 * down / total:.0f} %), {'paused for the whole sync (--pause-for-whole-sync)' if whole else 'paused only to commit'}")
commit = next((p["seconds"] for p in t["phases"] if p["phase"] == "commit"), 0.0)
if commit > 0:
    print(f"# the commit phase (every CommitSync, as the coordinator timed it): {commit:.3f} s; "
          f"downtime / commit = {down / commit:.2f} (target <= 1.10)")
print(f"# of which the engine's Continue (the reference engine validates the committed memory, "
      f"then serves it in place): {cont:.3f} s")
ticks, hz, cores = (int(x) for x in open(f"{work}/cpu-{mode}.txt").read().split())
sync_cpu = ticks / hz
print(f"# CPU time (all threads of every process): sync {sync_cpu:.2f} core-s ({sync_cpu / total:.2f} of {cores} cores busy), "
      f"raw broadcast {raw_cpu:.2f} core-s ({raw_cpu / raw:.2f} cores busy); "
      f"a sync within 1.25x of it has at most {1.25 * raw * cores:.2f} core-s of this host in all")
print("# peak memory: VmHWM (includes pages of the engine's shared memory the agent wrote, RssShmem)")
for line in open(f"{work}/memory-{mode}.txt"):
    name, kb, shm, pid = line.split()
    print(f"#   {name:22s} pid {pid:>7}: peak {int(kb) / 1024:9.1f} MiB, of which engine shm {int(shm) / 1024:8.1f} MiB")
# Delivery: bytes per engine rank and per sender, against this host's limit.
got = {l.split()[0]: int(l.split()[1]) for l in open(f"{work}/received-{mode}.txt") if len(l.split()) == 2}
bcast = {}
try:
    bcast = {l.split()[0]: int(l.split()[1]) for l in open(f"{work}/received-broadcast.txt") if len(l.split()) == 2}
except FileNotFoundError:
    pass
print(f"# bytes received per engine rank ({mode}):" + "".join(
    f" {a} {b}" + (f" ({b / bcast[a]:.3f} of broadcast)" if a in bcast else "") for a, b in sorted(got.items())))
sent_by = {l.split()[0]: int(l.split()[1]) for l in open(f"{work}/sent-{mode}.txt") if len(l.split()) == 2}
print(f"# bytes sent per trainer rank ({mode}):" + "".join(f" {r} {b}" for r, b in sorted(sent_by.items())))
for line in open(f"{work}/limit-{mode}.txt"):
    f = line.split()
    if len(f) >= 9 and f[0].isdigit() and f[3] == "0":
        most, lim = int(f[0]), float(f[4]) / 1e6
        print(f"# limit on this host: the busiest process moves {most} bytes; a raw one-to-one gloo broadcast of them "
              f"takes {lim:.3f} s; this sync = {total / lim:.2f}x that limit")
        break
PY
done
