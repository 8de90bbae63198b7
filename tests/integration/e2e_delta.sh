#!/usr/bin/env bash
# Delta sync (docs/sync.md "Delta sync"): two engines of TP 1 serving the default model (INT4
# experts), each with its rollout agent, 4 trainer agents under mpirun with --delta auto. Between
# syncs the checkpoint changes as an RL step changes it (train_step.sh: 1 % of the bf16 elements by
# one ulp) and is sharded again; every sync is checked bit-exact against that checkpoint by
# `wsyncctl verify` and by the independent reference (`verify --independent`).
#   1. The first sync is sent in full (no base yet).
#   2. The first delta is corrupted (failpoint delta.corrupt:1 on the trainer agents: one bit of a
#      delta flipped after its checksums were taken, as a delta from the wrong base would be). Both
#      agents refuse it, the sync fails, and both engines still serve the first version bit-exact.
#   3. The next sync goes in full (the trainer's base is no longer known to match what the engines
#      hold), the one after as deltas: a few percent of the full bytes (wsyncctl timings).
#   4. Engine 0's agent restarts: its engine keeps serving from its memory, but no staging holds a
#      base. --delta auto then sends every byte to both; --delta on sends engine 1 the delta while
#      engine 0 sits the sync out and copies the new version from engine 1's agent.
#   5. Sharded delivery: in full first (its senders' bases are per receiver group); a corrupted
#      delta refused; in full again, then deltas.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_delta
WSYNC_FAILPOINTS=delta.corrupt:1 e2e_trainer 91 -x WSYNC_FAILPOINTS -- --delta auto
perturb() {  # one "training step" (train_step.sh): $work/hf changed, the trainer's rank files cut from it again
  WSYNC_BIN="$bin" "$here/tests/integration/train_step.sh" "$work/hf" "$work/megatron" "$1" --tp 2 --ep 2 --dp 2
}
verified() {  # every engine rank bit-exact with $1 at version $2: the sync's checksums, the independent reference
  local n
  n=$("${ctl[@]}" verify --against "$1" | grep -c "version $2: bit-exact") || true
  [ "$n" = 2 ] || fail "version $2 is bit-exact on $n of 2 engines (wsyncctl verify against $1)"
  n=$("${ctl[@]}" verify --against "$1" --independent | grep -c "version $2: independent: equal to the reference") ||
    true
  [ "$n" = 2 ] || fail "version $2 is bit-exact on $n of 2 engines (verify --independent against $1)"
}
synced() {  # wsyncctl sync --wait ARGS, with the heartbeats' staged versions in: the published version
  local out
  sleep 1
  out=$("${ctl[@]}" sync --wait "$@" 2>&1) || fail "sync $*: $out"
  sed -n 's/.*version \([0-9]*\) published.*/\1/p' <<<"$out" | tail -n1
}
delta_line() { "${ctl[@]}" timings "$1" | grep -E "^(deltas from|in full)" || true; }
percent() { sed -n 's/^[^(]*(\([0-9.]*\) %);.*/\1/p' <<<"$1"; }  # the first: of the bytes

for e in 0 1; do e2e_start_agent $e; e2e_start_engine $e; done
for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge 2 ] && break; sleep 0.1; done

# 1. In full.
v1=$(synced --min-agents 2)
verified "$work/hf" "$v1"
line=$(delta_line "$v1")
grep -q "^in full (delta base kept)" <<<"$line" || fail "the first sync: '$line' (want it in full, a base kept)"
echo "e2e_delta: version $v1 in full ($line), bit-exact on both engines"

# 2. A corrupted delta.
cp -r "$work/hf" "$work/hf.1"
perturb 2
sleep 1
out=$("${ctl[@]}" sync --wait 2>&1) && fail "a sync with a corrupted delta succeeded: $out"
grep -q "failed" <<<"$out" || fail "the corrupted delta's sync: $out"
for e in 0 1; do
  grep -q "DATA_LOSS.*not the new version\|DATA_LOSS.*delta" "$work/logs/agent-$e.log" ||
    fail "agent $e did not refuse the corrupted delta (DATA_LOSS): $(grep -i delta "$work/logs/agent-$e.log" | tail -n 3)"
done
verified "$work/hf.1" "$v1"
why=$(grep -o "DATA_LOSS.*" "$work/logs/agent-0.log" | head -n1 | cut -c1-200)
echo "e2e_delta: a corrupted delta refused by both agents ($why); both engines still serve version $v1 bit-exact"

# 3. In full once more, then deltas.
v3=$(synced)
verified "$work/hf" "$v3"
line=$(delta_line "$v3")
grep -q "^in full" <<<"$line" || fail "the sync after the refused delta: '$line' (want it in full)"
perturb 3
v4=$(synced)
verified "$work/hf" "$v4"
line=$(delta_line "$v4")
grep -q "^deltas from version $v3: " <<<"$line" || fail "version $v4: '$line' (want deltas from version $v3)"
grep -q "; [1-9][0-9]* of [0-9]* quantization groups not quantized again" <<<"$line" ||
  fail "version $v4: no INT4 group was reused ($line)"
pct=$(percent "$line")
awk -v p="$pct" 'BEGIN { exit !(p < 25) }' || fail "the delta sent $pct % of the full bytes: $line"
echo "e2e_delta: version $v3 in full, version $v4 $line; bit-exact on both engines"

# 4. An agent without a base.
kill -KILL "${agent_pid[0]}"
wait "${agent_pid[0]}" 2>/dev/null || true
e2e_start_agent 0  # engine 0 registers again with it, still serving version $v4 from its memory
for _ in $(seq 100); do grep -q "registered engine" <(tail -n 20 "$work/logs/agent-0.log") && break; sleep 0.1; done
for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge 2 ] && break; sleep 0.1; done
perturb 4
v5=$(synced)
verified "$work/hf" "$v5"
line=$(delta_line "$v5")
grep -q "^in full" <<<"$line" || fail "--delta auto with an agent off the base: '$line' (want it in full)"
grep -q "sync .* is sent in full: 1 of 2 engines do not hold version $v4 (engine-0)" "$work/logs/trainer.log" ||
  fail "the coordinator did not say why version $v5 went in full"
echo "e2e_delta: engine 0's agent restarted without a base: version $v5 in full to both (--delta auto), bit-exact"
# Its staging holds version $v5 now: restart it again, and sync with --delta on.
kill -KILL "${agent_pid[0]}"
wait "${agent_pid[0]}" 2>/dev/null || true
e2e_start_agent 0
for _ in $(seq 100); do grep -q "registered engine" <(tail -n 20 "$work/logs/agent-0.log") && break; sleep 0.1; done
for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge 2 ] && break; sleep 0.1; done
perturb 5
sleep 1
out=$("${ctl[@]}" sync --wait --delta on 2>&1) && rc=0 || rc=$?
[ "$rc" = 6 ] || fail "--delta on with engine 0 off the base: exit $rc (want 6, partial: engine 0 sat out): $out"
v6=$(sed -n 's/.*version \([0-9]*\) .*/\1/p' <<<"$out" | tail -n1)
line=$(delta_line "$v6")
grep -q "^deltas from version $v5: " <<<"$line" || fail "--delta on: '$line' (want deltas from version $v5)"
copied=
for _ in $(seq 300); do
  copied=$(grep -o "copied version $v6 from the rollout agent at [^ ]*" "$work/logs/agent-0.log" | head -n1) && break
  sleep 0.1
done
[ -n "$copied" ] || fail "engine 0 sat version $v6 out and did not copy it from a peer"
for _ in $(seq 100); do
  "${ctl[@]}" verify --against "$work/hf" | grep -c "version $v6: bit-exact" | grep -qx 2 && break
  sleep 0.1
done
verified "$work/hf" "$v6"
echo "e2e_delta: --delta on: engine 1 took version $v6 $line; engine 0 (no base) sat it out and $copied; both bit-exact"

# 5. Sharded delivery: its senders keep a base per receiver group, so its first sync goes in full.
#    The trainer ranks that send only under sharded delivery (1 and 2) corrupt their first delta
#    (the failpoint is armed on every rank): refused by both agents, the engines keep version v7.
#    Then in full again (the trainer's bases are unknown after a failure), then deltas of the blocks
#    cut for each group.
perturb 6
v7=$(synced --delivery sharded)
verified "$work/hf" "$v7"
line=$(delta_line "$v7")
grep -q "^in full" <<<"$line" || fail "the first sharded sync: '$line' (want it in full: no sharded base yet)"
rm -rf "$work/hf.7" && cp -r "$work/hf" "$work/hf.7"
perturb 7
sleep 1
declare -A seen
for e in 0 1; do seen[$e]=$(wc -l < "$work/logs/agent-$e.log"); done
out=$("${ctl[@]}" sync --wait --delivery sharded 2>&1) && fail "a sharded sync with a corrupted delta succeeded: $out"
for e in 0 1; do
  tail -n +"$((seen[$e] + 1))" "$work/logs/agent-$e.log" | grep -q "DATA_LOSS.*not the new version" ||
    fail "agent $e did not refuse the corrupted sharded delta: $out"
done
verified "$work/hf.7" "$v7"
v9=$(synced --delivery sharded)
verified "$work/hf" "$v9"
grep -q "^in full" <<<"$(delta_line "$v9")" || fail "the sharded sync after a refused delta: $(delta_line "$v9")"
perturb 9
v10=$(synced --delivery sharded)
verified "$work/hf" "$v10"
line=$(delta_line "$v10")
grep -q "^deltas from version $v9: " <<<"$line" || fail "sharded version $v10: '$line' (want deltas from version $v9)"
pct=$(percent "$line")
awk -v p="$pct" 'BEGIN { exit !(p < 25) }' || fail "the sharded delta sent $pct % of the full bytes: $line"
"${ctl[@]}" timings "$v10" | grep -q "sharded delivery" || fail "version $v10 was not sharded: $("${ctl[@]}" timings "$v10")"
echo "e2e_delta: sharded: version $v7 in full; a corrupted sharded delta refused (both engines kept $v7); version $v9 in full, version $v10 $line; bit-exact on both engines"
echo "e2e_delta: ok"
