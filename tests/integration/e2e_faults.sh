#!/usr/bin/env bash
# The fault matrix of the rollout side, through the real processes: 4 trainer agents under mpirun
# (--sync-timeout 5), two reference engines (TP 1) with their rollout agents. For each fault, one
# process of engine 1 is (re)started with a failpoint (common/failpoint.h) that kills it (-9) or
# stops it (SIGSTOP: a hung process) at one phase of the next sync:
#   rollout agent: begin (BeginSync), transfer (first bucket arrived), prepare (PrepareSync),
#                  commit (engine paused, before the repack);
#   engine:        pause (the commit's Pause), continue (the commit's Continue). A restarted engine
#                  is first caught up by its agent (a commit of the staged version: its own Pause
#                  and Continue), so the engine's points fire on their second hit, the sync's.
# After each: the sync failed within timeout + 10 s with an error naming engine-1; engine 0 kept
# answering, on one version (every reply names its version); a stopped process is continued; the
# faulty process is restarted clean (on a new port) and found again, and the next sync publishes a
# version bit-exact on both engines. Deltas on (--delta auto): every sync whose engines hold the
# trainer's base goes as deltas, the others in full (docs/sync.md "Delta sync"); the same checks hold.
# Trainer-rank and coordinator faults: e2e.trainer_faults, e2e.restart, e2e.hang (full syncs, unless
# WSYNC_E2E_DELTA=auto|on).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_faults
e2e_cleanup_extra() { for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; done; }
timeout_s=5
e2e_trainer 5 -- --sync-timeout "$timeout_s" --delta auto
registrations() { grep -c 'registered engine "engine-1"' "$work/logs/agent-1.log" 2>/dev/null || true; }
ready() {  # ready N: agent 1 has registered engine 1 more than N times, and is a member at its address
  local addr
  for _ in $(seq 300); do
    addr=$(cat "$work/agent-1" 2>/dev/null || true)
    if [ "$(registrations)" -gt "$1" ] && [ "$(members "${ctl[@]}")" = 2 ] &&
       "${ctl[@]}" --json members 2>/dev/null | grep -q "\"$addr\""; then
      return 0
    fi
    sleep 0.1
  done
  fail "agent 1 ($addr) did not register engine 1 and join"
}
stop_proc() {  # stop_proc PID: kill -9 (continued first if stopped), reaped
  kill -CONT "$1" 2>/dev/null || true
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
for e in 0 1; do e2e_start_agent "$e"; e2e_start_engine "$e"; done
v=$(e2e_sync_verified "the first sync" 2)
echo "e2e_faults: version $v bit-exact on both engines; the faults:"

fault() {  # fault KIND PHASE ACTION: kind agent|engine, the failpoint point, kill|stop
  local kind="$1" point="$2" action="$3" pid rc=0 out took gen n
  n=$(registrations)
  if [ "$kind" = agent ]; then
    stop_proc "${agent_pid[1]}"; e2e_start_agent 1 "$point:1@$action"; pid=${agent_pid[1]}
  else  # hit 1 is the catch-up's commit into the restarted engine (see the top), hit 2 the sync's
    stop_proc "${engine_pid[1]}"; e2e_start_engine 1 "$point:2@$action"; pid=${engine_pid[1]}
  fi
  ready "$n"
  local t0 t1
  t0=$(date +%s.%N)
  out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || rc=$?
  t1=$(date +%s.%N)
  took=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
  [ "$rc" != 0 ] || fail "$kind $point@$action: the sync succeeded: $out"
  python3 -c "import sys; sys.exit(0 if $t1 - $t0 <= $timeout_s + 10 else 1)" ||
    fail "$kind $point@$action: the failed sync took $took s (timeout $timeout_s s): $out"
  grep -q "engine-1" <<<"$out" || fail "$kind $point@$action: the error does not name engine-1: $out"
  grep -q "failpoint $point fires" "$work/logs/$kind-1.log" || fail "$kind $point@$action: the failpoint did not fire"
  gen=$("${ctl[@]}" generate --engine "$(cat "$work/engine-0")" --prompt 1,2,3 --max-new-tokens 2 2>&1) ||
    fail "$kind $point@$action: engine 0 stopped answering: $gen"
  grep -q "^version [0-9]*:" <<<"$gen" || fail "$kind $point@$action: engine 0's reply names no version: $gen"
  # One truth about versions (docs/sync.md "Versions"): a fault before the commit fails the sync (no
  # engine took it: engine 0 still serves the version before); a fault in engine 1's commit leaves
  # the sync partial (engine 0 committed it and serves it), engine-1 named behind, exit 6; the
  # coordinator's versions, status and the sync's own exit status all say the same.
  local want_outcome=failed want_rc=1 last lv lo lb served
  case "$point" in rollout.commit | engine.*) want_outcome=partial want_rc=6 ;; esac
  last=$("${ctl[@]}" --json versions | python3 -c 'import json,sys; v=json.load(sys.stdin)[-1]; print(v["version"], v["outcome"], ";".join(v["behind"]) or "-")')
  read -r lv lo lb <<<"$last"
  [ "$lo" = "$want_outcome" ] || fail "$kind $point@$action: versions says $lo for version $lv, want $want_outcome: $out"
  [ "$rc" = "$want_rc" ] || fail "$kind $point@$action: sync --wait exited $rc for a $lo sync (want $want_rc): $out"
  served=$(sed -n 's/^version \([0-9]*\):.*/\1/p' <<<"$gen")
  if [ "$lo" = partial ]; then
    [ "$served" = "$lv" ] || fail "$kind $point@$action: engine 0 serves version $served, not the partial version $lv"
    grep -q "engine-1" <<<"$lb $out" || fail "$kind $point@$action: the partial version names no engine-1 behind: $lb / $out"
    "${ctl[@]}" --json status | python3 -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if s["version"] == '"$lv"' else 1)' ||
      fail "$kind $point@$action: status does not give version $lv as the fleet's: $("${ctl[@]}" status)"
  else
    [ "$served" -lt "$lv" ] || fail "$kind $point@$action: engine 0 serves version $served of a failed sync ($lv)"
  fi
  echo "   $kind $point@$action: $lo in $took s (engine 0 on version $served): $(grep "FAILED\|PARTIAL" <<<"$out" | head -n1 | cut -c1-150)"
  # Bring the process back clean; the next sync must be published on both engines.
  n=$(registrations)
  if [ "$kind" = agent ]; then
    stop_proc "$pid"; e2e_start_agent 1
  else
    stop_proc "$pid"; e2e_start_engine 1
  fi
  ready "$n"
  v=$(e2e_sync_verified "after $kind $point@$action" 2)
  echo "     restarted: version $v bit-exact on both engines ($(how "$v"))"
}
how() { "${ctl[@]}" timings "$1" | grep -oE "^(deltas from version [0-9]+|in full)" || echo "?"; }
for action in kill stop; do
  for point in rollout.begin rollout.transfer rollout.prepare rollout.commit; do fault agent "$point" "$action"; done
  for point in engine.pause engine.continue; do fault engine "$point" "$action"; done
done
# With every engine on the trainer's base again, a sync goes as deltas.
v=$(e2e_sync_verified "the last sync" 2)
grep -q "^deltas from version" <<<"$(how "$v")" || fail "the last sync (version $v) went $(how "$v"), not as deltas"
echo "e2e_faults: version $v $(how "$v"), bit-exact on both engines"
echo "e2e_faults: ok"
