#!/usr/bin/env bash
# Sharded delivery on a live deployment, run through `tools/demo.sh --delivery sharded --then`
# (which exports WSYNC_COORDINATOR, WSYNC_TOKEN_FILE, WSYNC_ENGINES, WSYNC_HF, WSYNC_WORKDIR) with
# a fleet of mixed layouts (engines of TP 2 with EP 2, TP 2, TP 1). The demo's syncs were sharded
# and verified bit-exact on every engine rank. Here:
#   1. the last sync's timings say "sharded delivery"; three trainer ranks sent the stage;
#   2. one broadcast sync of the same weights, then one sharded sync, each verified bit-exact;
#   3. bytes each rollout agent received (its log's "prepared" line): a TP 2 rank receives at most
#      0.6 of what broadcast sends it (its half plus the replicated tensors), a TP 1 rank all of it.
set -euo pipefail
bin="${WSYNC_BIN:-$(cd "$(dirname "$0")/../.." && pwd)/build/bin}"
ctl=("$bin/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE")
fail() { echo "FAIL: $*"; exit 1; }
"${ctl[@]}" timings | head -n1 | grep -q "sharded delivery" || fail "the demo's syncs were not sharded: $("${ctl[@]}" timings | head -n1)"
echo "ok: the demo's syncs used sharded delivery"
# Spread senders: the stage source's TP peer and EP peer send their share (4 ranks, TP 2 x EP 2).
grep "sync 1 (version 1): sender" "$WSYNC_WORKDIR/logs/trainer.log" | head -n2
senders=$(grep -c "sync 1 (version 1): \(source\|sender [0-9]*\) of stage 0 for 5 agents in 5 receiver groups" \
  "$WSYNC_WORKDIR/logs/trainer.log" || true)
[ "$senders" = 3 ] || fail "sync 1 had $senders senders of stage 0, expected 3 (the source, its TP peer, its EP peer)"
echo "ok: three trainer ranks sent stage 0 (the source, its TP peer, its EP peer)"

received() {  # received: "LOG BYTES" of every agent's last prepared sync
  for f in "$WSYNC_WORKDIR"/logs/agent-*.log; do
    echo "$(basename "$f" .log) $(grep "prepared:" "$f" | tail -n1 | sed -n 's/.* tensors, \([0-9]*\) bytes in.*/\1/p')"
  done
}
run() {  # run MODE: a sync of that delivery, verified bit-exact on every engine rank
  "${ctl[@]}" sync --wait --delivery "$1" > /dev/null || fail "the $1 sync failed"
  "${ctl[@]}" timings | head -n1 | grep -q "$1 delivery" || fail "the sync was not $1"
  local out n
  out=$("${ctl[@]}" verify --against "$WSYNC_HF" 2>&1) || fail "verify after the $1 sync: $out"
  n=$(grep -c ": bit-exact" <<<"$out" || true)
  [ "$n" = 5 ] || fail "after the $1 sync, $n of 5 engine ranks are bit-exact: $out"
  echo "ok: a $1 sync, bit-exact on all 5 engine ranks"
}
run broadcast
received > "$WSYNC_WORKDIR/broadcast.bytes"
run sharded
received > "$WSYNC_WORKDIR/sharded.bytes"
python3 - "$WSYNC_WORKDIR" <<'PY'
import sys
work = sys.argv[1]
def load(name):
    return {a: int(b) for a, b in (l.split() for l in open(f"{work}/{name}.bytes") if len(l.split()) == 2)}
b, s = load("broadcast"), load("sharded")
ok = True
print(f"   {'agent':<12} {'broadcast':>12} {'sharded':>12} {'ratio':>6}")
for a in sorted(b):
    r = s[a] / b[a]
    print(f"   {a:<12} {b[a]:>12} {s[a]:>12} {r:>6.3f}")
# agent-E-R: engines 0 and 1 are TP 2, engine 2 TP 1 (the test's fleet).
for a in b:
    e = int(a.split("-")[1])
    if e < 2 and not s[a] <= 0.6 * b[a]: print(f"FAIL: {a} (TP 2) received {s[a]} of {b[a]} bytes"); ok = False
    if e == 2 and not abs(s[a] - b[a]) <= 0.01 * b[a]: print(f"FAIL: {a} (TP 1) received {s[a]}, broadcast {b[a]}"); ok = False
sys.exit(0 if ok else 1)
PY
echo "ok: every TP 2 rank received at most 0.6 of the broadcast bytes, the TP 1 rank all of them"
# The plan is computed once per sender and kept: three sharded syncs, three plans.
plans=$(grep -c "sharded delivery: planned 5 receiver groups" "$WSYNC_WORKDIR/logs/trainer.log" || true)
[ "$plans" = 3 ] || fail "the trainer ranks planned $plans times for three sharded syncs on three senders (want 3)"
echo "ok: each sender planned once and kept its plan for the next syncs"
echo "e2e_sharded: ok"
