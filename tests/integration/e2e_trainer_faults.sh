#!/usr/bin/env bash
# The trainer side of the fault matrix, through the real processes: 4 trainer agents under mpirun
# (the coordinator in rank 0 on a fixed port, --state-dir, --sync-timeout 6), two reference
# engines (TP 1) with their rollout agents. Each case breaks one trainer process at one phase of a
# sync (failpoints, common/failpoint.h, or signals):
#   coordinator killed (-9) once an agent has begun (BeginSync answered), during the transfer and
#   before PrepareSync: the engines keep serving and the restarted job's first sync (superseding
#   the orphaned one) is published bit-exact;
#   coordinator killed (-9) at the start of the commit (every agent prepared, none committed):
#   mpirun takes the job down; the engines keep serving; the job started again with the same
#   command finds the commit in its state directory and rolls both engines forward to that version
#   from their agents' staging: it is published, bit-exact on both engines, with no new sync;
#   coordinator killed after engine 0 committed, engine 1's agent killed in its own commit (engine
#   1 paused on the old version): the restarted agent continues engine 1 (mixed versions, each
#   reply naming its own); the restarted job tells it the fleet converges on the new version, it
#   copies that from engine 0's agent (catch-up from a peer), and the version is published,
#   bit-exact on both, with no new sync;
#   trainer rank 2 hung (SIGSTOP) during the transfer: the sync fails within timeout + 10 s naming
#   rank 2, the engines keep serving; continued, the job runs the next sync bit-exact;
#   coordinator hung (SIGSTOP) during the transfer: the agents abort on their own (the engines
#   never paused, they keep serving); continued, the coordinator fails that sync and the next one
#   is published bit-exact;
#   coordinator hung in its commit (after one agent committed): the engines keep serving (maybe
#   on different versions, each reply naming its own); continued, the commit is completed by
#   rolling the laggard forward, and the version is published bit-exact on both.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_trainer_faults
e2e_cleanup_extra() { for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; done; }
timeout_s=6
"$bin/wsync-model-gen" --from-config default --seed 73 --out "$work/hf" > /dev/null
"$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2 > /dev/null
port=$(e2e_fixed_port)  # the coordinator's, the same at every start of the job
coord="127.0.0.1:$port"
ctl=("$bin/wsyncctl" --coordinator "$coord" --token-file "$token")

start_trainer() {  # start_trainer N [FAILPOINTS]: the trainer job (log N)
  WSYNC_FAILPOINTS="${2:-}" mpirun --allow-run-as-root --oversubscribe -np 4 -x WSYNC_FAILPOINTS \
    "$bin/wsync-trainer-agent" --source "dir:$work/megatron" --coordinator "$coord" --state-dir "$work/state" \
    --sync-timeout "$timeout_s" --delta "${WSYNC_E2E_DELTA:-off}" --token-file "$token" \
    > "$work/logs/trainer-$1.log" 2>&1 &
  trainer_pid=$!
  pids+=($trainer_pid)
}
wait_members() {
  for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge 2 ] && return 0; sleep 0.1; done
  fail "the rollout agents did not join the coordinator at $coord"
}
published() { "${ctl[@]}" --json status 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])' 2>/dev/null || echo 0; }
behind() { "${ctl[@]}" --json status 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["engines_behind"])' 2>/dev/null || echo -1; }
serves() {  # serves E V: engine E answers, on version V
  local out
  out=$("${ctl[@]}" generate --engine "$(cat "$work/engine-$1")" --prompt 1,2,3 --max-new-tokens 2 2>&1) ||
    fail "engine $1 stopped serving: $out"
  grep -q "^version $2:" <<<"$out" || fail "engine $1 serves $out, want version $2"
}
bit_exact() {  # bit_exact V WHAT
  "${ctl[@]}" verify --against "$work/hf" | grep -c "version $1: bit-exact" | grep -qx 2 ||
    fail "$2: the engines are not both bit-exact on version $1"
}
restart_agent() {  # restart_agent E [FAILPOINTS]: (re)start engine E's rollout agent, on a new port
  [ -n "${agent_pid[$1]:-}" ] && { kill -KILL "${agent_pid[$1]}" 2>/dev/null || true; wait "${agent_pid[$1]}" 2>/dev/null || true; }
  e2e_start_agent "$@"
}
# stop_coordinator_at FAILPOINT WHERE: the job started again with rank 0 (the coordinator) stopping
# at FAILPOINT (SIGSTOP), a sync triggered, and the stop awaited; sets r0 to rank 0's pid.
stop_coordinator_at() {
  kill -TERM "$trainer_pid"; wait "$trainer_pid" 2>/dev/null || true
  run=$((run + 1)); start_trainer $run "$1"
  wait_members
  "${ctl[@]}" sync --min-agents 2 > /dev/null 2>&1 || fail "the trigger was refused"
  for _ in $(seq 200); do
    r0=$(e2e_rank_pid 0) && [ "$(awk '{print $3}' "/proc/$r0/stat" 2>/dev/null)" = T ] && return 0
    sleep 0.1
  done
  fail "the coordinator did not stop $2"
}
for e in 0 1; do restart_agent $e; e2e_start_engine $e; done

run=1
start_trainer $run
wait_members
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "sync 1 failed: $out"
bit_exact 1 "sync 1"
v=1

# The coordinator killed before the commit: as the agents begin, while they receive, and once they
# received everything (before PrepareSync). Nothing was committed: the engines keep serving, and the first
# sync of the job started again supersedes the orphaned one at once (not after its timeout).
for point in coordinator.begin coordinator.transfer coordinator.prepare; do
  kill -TERM "$trainer_pid"; wait "$trainer_pid" 2>/dev/null || true
  run=$((run + 1)); start_trainer $run "$point:1@kill"
  wait_members
  out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) && fail "$point: the sync succeeded with the coordinator killed: $out"
  wait "$trainer_pid" 2>/dev/null || true
  for e in 0 1; do serves $e $v; done
  run=$((run + 1)); start_trainer $run
  wait_members
  t0=$(date +%s.%N)
  out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "$point: the first sync after the restart failed: $out"
  t1=$(date +%s.%N)
  next=$(sed -n 's/.*version \([0-9]*\) published.*/\1/p' <<<"$out" | head -n1)
  [ -n "$next" ] && [ "$next" -gt "$v" ] || fail "$point: the first sync after the restart published no newer version: $out"
  took=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  awk -v t="$took" -v lim="$timeout_s" 'BEGIN { exit !(t < lim) }' ||
    fail "$point: the first sync after the restart took $took s (it waited for the orphaned sync?)"
  bit_exact "$next" "$point"
  echo "e2e_trainer_faults: coordinator killed at $point: the engines kept serving version $v; the restarted job's first sync published version $next bit-exact in $took s"
  v=$next
done

# The coordinator killed during the commit: before any engine committed; then after engine 0
# committed while engine 1's agent was killed in its own commit (engine 1 left paused on the old
# version): mixed versions, and no staging on engine 1's side once its agent is started again.
for point in coordinator.commit coordinator.committed; do
  kill -TERM "$trainer_pid"; wait "$trainer_pid" 2>/dev/null || true
  if [ "$point" = coordinator.committed ]; then restart_agent 1 rollout.commit@kill; fi
  run=$((run + 1)); start_trainer $run "$point@kill"
  wait_members
  want=$((v + 1))
  out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) && fail "$point: the sync succeeded with the coordinator killed: $out"
  wait "$trainer_pid" 2>/dev/null || true
  if [ "$point" = coordinator.committed ]; then
    wait "${agent_pid[1]}" 2>/dev/null || true
    serves 0 "$want"
    restart_agent 1  # engine 1 registers with it and is continued (still on version $v)
    for _ in $(seq 100); do grep -q "registered engine" <(tail -n 5 "$work/logs/agent-1.log") && break; sleep 0.1; done
  fi
  on=$(for e in 0 1; do "${ctl[@]}" generate --engine "$(cat "$work/engine-$e")" --prompt 1,2,3 --max-new-tokens 2 | cut -d: -f1; done | tr '\n' ' ')
  t0=$(date +%s.%N)
  run=$((run + 1)); start_trainer $run
  # Published as soon as an engine serves it (partial), complete once both do (no engine behind).
  for _ in $(seq 300); do [ "$(published) $(behind)" = "$want 0" ] && break; sleep 0.1; done
  [ "$(published) $(behind)" = "$want 0" ] || fail "$point: the restarted coordinator did not bring both engines to version $want (status: $("${ctl[@]}" status 2>&1 | head -n 5))"
  t1=$(date +%s.%N)
  grep -q "was committing version $want when the previous coordinator stopped" "$work/logs/trainer-$run.log" ||
    fail "$point: the restarted coordinator did not find the commit in its state"
  for e in 0 1; do serves $e $want; done
  bit_exact $want "$point"
  if [ "$point" = coordinator.committed ]; then
    grep -q "copied version $want from the rollout agent at $(cat "$work/agent-0")" "$work/logs/agent-1.log" ||
      fail "$point: agent 1 did not copy version $want from engine 0's agent"
  fi
  echo "e2e_trainer_faults: coordinator killed at $point: the engines served [$on]; the restarted job rolled both forward to version $want, published bit-exact $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s after its start, no new sync"
  v=$want
done

# Trainer rank 2 hung during the transfer.
r2=$(e2e_rank_pid 2) || fail "no trainer agent rank 2"
kill -STOP "$r2"
t0=$(date +%s)
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) && { kill -CONT "$r2"; fail "a sync succeeded with trainer rank 2 stopped: $out"; }
took=$(( $(date +%s) - t0 ))
for e in 0 1; do serves $e $v; done
kill -CONT "$r2"
(( took <= timeout_s + 10 )) || fail "the sync with a hung trainer rank failed only after $took s (timeout $timeout_s s)"
grep -q "trainer rank 2 was silent for the whole sync" <<<"$out" || fail "the failed sync does not name trainer rank 2: $out"
echo "e2e_trainer_faults: trainer rank 2 hung: the sync failed in $took s: $(grep -v '^ *(' <<<"$out" | grep -m1 FAILED | cut -c1-160)"
# Continued, the ranks finish the failed sync in the background first (its data-plane group waits
# out its join timeout, the agents having aborted). The next sync, triggered at once, waits for them
# before any agent begins it and then has its whole timeout. The failed sync is marked abandoned in
# the store, so the ranks stop forming its group at once instead of waiting out their join timeout.
failed_sync=$(sed -n 's/.*sync \([0-9]*\) FAILED.*/\1/p' <<<"$out" | head -n1)
v=$((v + 2))
t0=$(date +%s.%N)
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "the sync after rank 2 was continued failed: $out"
took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
awk -v t="$took" -v lim="$timeout_s" 'BEGIN { exit !(t < lim) }' ||
  fail "the sync after rank 2 was continued took $took s: the ranks drained the abandoned sync $failed_sync only after a join timeout ($timeout_s s)"
grep -q "version $v published" <<<"$out" || fail "the sync after rank 2 was continued: $out (want version $v)"
bit_exact $v "after trainer rank 2 was continued"
waited=no
grep -q "waits for the trainer ranks to finish sync $failed_sync" "$work/logs/trainer-$run.log" && waited=yes
echo "e2e_trainer_faults: rank 2 continued: version $v published bit-exact in $took s (waited for sync $failed_sync to drain: $waited)"

# The coordinator hung during the transfer.
stop_coordinator_at coordinator.transfer:1@stop "at the transfer"
t0=$(date +%s)
for e in 0 1; do
  for _ in $(seq 400); do grep -q "aborting on my own" "$work/logs/agent-$e.log" && break; sleep 0.1; done
  grep -q "aborting on my own" "$work/logs/agent-$e.log" || fail "agent $e did not abort the orphaned sync on its own"
done
took=$(( $(date +%s) - t0 ))
for e in 0 1; do serves $e $v; done
kill -CONT "$r0"
echo "e2e_trainer_faults: coordinator hung at the transfer: both agents aborted on their own within $took s of the stop; the engines kept serving version $v"
for _ in $(seq 300); do "${ctl[@]}" --json status 2>/dev/null | grep -q '"state": "idle"' && break; sleep 0.1; done
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "the sync after the coordinator was continued failed: $out"
v=$(sed -n 's/.*version \([0-9]*\) published.*/\1/p' <<<"$out" | head -n1)
[ -n "$v" ] || fail "no version published after the coordinator was continued: $out"
bit_exact "$v" "after the coordinator was continued"
echo "e2e_trainer_faults: coordinator continued: version $v published bit-exact"

# The coordinator hung in the middle of the commit, once an agent's CommitSync succeeded (the other
# agent's may be in flight, or not sent). An agent left prepared gives up on its own after its
# timeout (its engine keeps serving the old version, each reply naming its own); continued, the
# coordinator finds the commit partial (the version published, the laggard behind), the laggard
# rolls forward from its staging, and both engines serve the new version, bit-exact, with no new sync.
stop_coordinator_at coordinator.committed:1@stop "in the commit"
sleep $((2 * timeout_s + 2))  # past the agents' own abort of a sync left prepared
on=$(for e in 0 1; do
  out=$("${ctl[@]}" generate --engine "$(cat "$work/engine-$e")" --prompt 1,2,3 --max-new-tokens 2 2>&1) ||
    { kill -CONT "$r0"; fail "engine $e stopped serving while the coordinator was stopped in the commit: $out"; }
  cut -d: -f1 <<<"$out"
done | tr '\n' ' ')
kill -CONT "$r0"
want=
for _ in $(seq 300); do
  p=$(published); [ "$p" -gt "$v" ] && [ "$(behind)" = 0 ] && { want=$p; break; }
  sleep 0.1
done
[ -n "$want" ] || fail "the coordinator continued in its commit did not bring both engines to a newer version (status: $("${ctl[@]}" status 2>&1 | head -n 5))"
for e in 0 1; do serves $e "$want"; done
bit_exact "$want" "after the coordinator stopped in its commit was continued"
echo "e2e_trainer_faults: coordinator hung in its commit: the engines served [$on] meanwhile; continued, version $want published bit-exact on both"
v=$want
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "the sync after the commit was completed failed: $out"
v=$(sed -n 's/.*version \([0-9]*\) published.*/\1/p' <<<"$out" | head -n1)
bit_exact "$v" "the sync after the stopped commit"
echo "e2e_trainer_faults: the next sync published version $v bit-exact"
echo "e2e_trainer_faults: ok"
