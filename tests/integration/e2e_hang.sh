#!/usr/bin/env bash
# A hung member fails the sync within its timeout, not a multiple of it: 4 trainer agents under
# mpirun (--sync-timeout 5), two reference engines (TP 1) with their rollout agents. Sync 1 is
# verified. Then, for each phase a sync can hang in, one member is stopped (SIGSTOP) and a sync
# triggered: the rollout agent of engine 1 (before BeginSync), and that engine itself (before
# its commit: the agent pauses it). Each sync must end within timeout + 10 s, naming the member,
# and the other engine must keep serving: failed when no engine committed (the stopped agent), and
# partial when engine 0 committed before engine 1's commit timed out (exit 6): the error says which
# engine holds the version, the version is the fleet's with engine-1 behind, and engine 1, once
# continued, rolls forward to it from its agent's staging without a new sync, after which no
# engine is behind. Then the next sync succeeds bit-exact on both engines.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_hang
e2e_cleanup_extra() { for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; done; }
timeout_s=5
e2e_trainer 91 -- --sync-timeout "$timeout_s"
declare -a agent_pid engine_pid
for e in 0 1; do
  "$bin/wsync-rollout-agent" --listen 127.0.0.1:0 --coordinator "$coord" --token-file "$token" \
    --heartbeat-ms 300 --address-file "$work/agent-$e" > "$work/logs/agent-$e.log" 2>&1 &
  agent_pid[$e]=$!
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/agent-$e" ] && break; sleep 0.1; done
  "$bin/wsync-ref-engine" --model "$work/hf" --engine-id "engine-$e" --listen 127.0.0.1:0 \
    --address-file "$work/engine-$e" --agent-file "$work/agent-$e" --token-file "$token" \
    > "$work/logs/engine-$e.log" 2>&1 &
  engine_pid[$e]=$!
  pids+=($!)
done
for _ in $(seq 300); do [ -s "$work/engine-1" ] && [ "$(members "${ctl[@]}")" -ge 2 ] && break; sleep 0.1; done
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "sync 1 failed: $out"

hang() {  # hang WHAT PID: stop PID, sync, expect a bounded failure naming WHAT, continue PID
  local what="$1" pid="$2" t0 t1 rc=0
  kill -STOP "$pid"
  t0=$(date +%s.%N)
  out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || rc=$?
  t1=$(date +%s.%N)
  local took
  took=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
  gen=$("${ctl[@]}" generate --engine "$(cat "$work/engine-0")" --prompt 1,2,3 --max-new-tokens 2 2>&1) ||
    { kill -CONT "$pid"; fail "engine 0 stopped serving while $what hung: $gen"; }
  kill -CONT "$pid"
  [ "$rc" != 0 ] || fail "the sync succeeded with $what stopped: $out"
  python3 -c "import sys; sys.exit(0 if $t1 - $t0 <= $timeout_s + 10 else 1)" ||
    fail "the sync with $what stopped took $took s (timeout $timeout_s s): $out"
  grep -q "$3" <<<"$out" || fail "the failed sync does not name $what ($3): $out"
  [ "$rc" = "$4" ] || fail "the sync with $what stopped exited $rc, want $4 ($5): $out"
  echo "e2e_hang: $what stopped: the sync ended $5 in $took s (timeout $timeout_s s); engine 0 kept serving ($gen)"
  echo "   $(grep "FAILED\|PARTIAL" <<<"$out" | head -n1 | cut -c1-200)"
}
hang "rollout agent 1" "${agent_pid[1]}" "engine-1" 1 failed
hang "engine 1" "${engine_pid[1]}" "engine-1" 6 partial
# Engine 0 committed that version before engine 1's commit timed out: the error says so first,
# and engine 1 rolls forward to it from its agent's staging once it runs again (no new sync).
grep -q "was committed on engine engine-0 tp 0 but not on engine engine-1 tp 0" <<<"$out" ||
  fail "the partial commit is not reported by engine: $out"
partial=$(sed -n 's/.*version \([0-9]*\) was committed on engine engine-0.*/\1/p' <<<"$out" | head -n1)
t0=$(date +%s)
for _ in $(seq 120); do
  gen=$("${ctl[@]}" generate --engine "$(cat "$work/engine-1")" --prompt 1,2,3 --max-new-tokens 2 2>&1) || true
  grep -q "^version $partial:" <<<"$gen" && break
  sleep 0.5
done
grep -q "^version $partial:" <<<"$gen" || fail "engine 1 did not roll forward to version $partial: $gen"
grep -q "rolling forward to version $partial .*committed from the staging" "$work/logs/agent-1.log" ||
  fail "agent 1 did not log its roll forward to version $partial"
echo "e2e_hang: engine 1 rolled forward to version $partial from its agent's staging in $(( $(date +%s) - t0 )) s ($gen)"
state=""
for _ in $(seq 100); do
  state=$("${ctl[@]}" --json status | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["version"], s["engines_behind"])')
  [ "$state" = "$partial 0" ] && break
  sleep 0.1
done
[ "$state" = "$partial 0" ] || fail "after engine 1 rolled forward, status says (version, engines behind) = $state, want $partial 0"
"${ctl[@]}" --json versions | python3 -c '
import json, sys
v = [r for r in json.load(sys.stdin) if r["version"] == '"$partial"'][-1]
sys.exit(0 if v["outcome"] == "partial" and not v["behind"] and v["caught_up_unix_ms"] > 0 else 1)' ||
  fail "versions does not show version $partial as partial and caught up: $("${ctl[@]}" versions)"
echo "e2e_hang: version $partial: partial, and no engine behind it once engine 1 rolled forward"
v=$(e2e_sync_verified "after the members continued" 2)
echo "e2e_hang: after SIGCONT, version $v published bit-exact on both engines"
echo "e2e_hang: ok"
