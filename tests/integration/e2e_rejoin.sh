#!/usr/bin/env bash
# A rollout agent killed (-9) and restarted on another port is found again: 4 trainer agents under
# mpirun, one reference engine of TP 2 whose ranks follow their agents through the agents' address
# files (--agent-file). Sync 1 is verified; agent 1 is killed: the engine keeps serving version 1,
# and (engine-0 being the only engine of the fleet) a sync is refused naming the engine that misses
# its rank; agent 1 is started again with the
# same command on a new port: engine rank 1 registers with it (it re-reads the file), the agent
# rejoins the coordinator, and the next sync publishes a new version, bit-exact on both ranks.
# Then each engine rank in turn is killed (-9) and started again: the TP group re-forms, the agent
# catches the new process up from its staging, the engine serves that version without a sync.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_rejoin
e2e_trainer 81

wait_members() {  # wait_members N
  for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge "$1" ] && return 0; sleep 0.1; done
  fail "only $(members "${ctl[@]}") of $1 rollout agents joined"
}
e2e_start_agent 0
e2e_start_agent 1
start_engine() {  # start_engine R STORE: engine rank R, following agent R through its address file
  rm -f "$work/engine-$1"
  "$bin/wsync-ref-engine" --model "$work/hf" --engine-id engine-0 --tp-size 2 --tp-rank "$1" --tp-store "$2" \
    --listen 127.0.0.1:0 --address-file "$work/engine-$1" --agent-file "$work/agent-$1" --agent-poll-ms 300 \
    --heartbeat-ms 200 --token-file "$token" >> "$work/logs/engine-$1.log" 2>&1 &
  engine_pid[$1]=$!
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/engine-$1" ] && return 0; sleep 0.1; done
  fail "engine rank $1 did not start"
}
start_engine 0 127.0.0.1:0
store=$(sed -n 's/^tp-store on //p' "$work/logs/engine-0.log" | head -n1)
[ -n "$store" ] || fail "engine rank 0 did not open its TP store"
start_engine 1 "$store"
engine=$(cat "$work/engine-0")
wait_members 2
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "sync 1 failed: $out"
"${ctl[@]}" verify --against "$work/hf" | grep -c "version 1: bit-exact" | grep -qx 2 || fail "sync 1 is not bit-exact"

old_port=$(cat "$work/agent-1")
kill -KILL "${agent_pid[1]}"
wait "${agent_pid[1]}" 2>/dev/null || true
out=$("${ctl[@]}" generate --engine "$engine" --prompt 1,2,3 --max-new-tokens 2) || fail "the engine stopped serving: $out"
grep -q "^version 1:" <<<"$out" || fail "the engine does not serve version 1: $out"
# A sync right away fails naming the member; once the coordinator has dropped the silent agent
# (heartbeats), the engine misses a rank and sits syncs out; with no other engine in the fleet, a
# sync is refused before it starts, naming the engine that misses its rank.
out=$("${ctl[@]}" sync --wait 2>&1) && fail "a sync succeeded without agent 1: $out"
grep -q "agent-1 (.*engine engine-0 tp 1)" <<<"$out" || fail "the failed sync does not name agent 1: $out"
echo "e2e_rejoin: agent 1 killed: the engine serves version 1; a sync fails:"; sed "s/^/   /" <<<"$out"
wait_members_exactly() {
  for _ in $(seq 300); do [ "$(members "${ctl[@]}")" = "$1" ] && return 0; sleep 0.1; done
  fail "the coordinator still lists $(members "${ctl[@]}") rollout agents, want $1"
}
wait_members_exactly 1
refused=$("${ctl[@]}" sync --wait 2>&1) && fail "a sync was published to half of engine-0: $refused"
grep -q "engine-0 (no agent for TP rank 1 of 2)" <<<"$refused" || fail "the sync was not refused naming engine-0: $refused"
echo "e2e_rejoin: agent 1 dropped: a sync is refused: $(grep -v '^ *(' <<<"$refused" | tail -n1 | cut -c1-140)"

e2e_start_agent 1
[ "$(cat "$work/agent-1")" != "$old_port" ] || fail "agent 1 came back on its old address $old_port"
wait_members 2
for _ in $(seq 100); do
  grep -q "rollout agent address now $(cat "$work/agent-1")" "$work/logs/engine-1.log" && break
  sleep 0.1
done
grep -q "rollout agent address now $(cat "$work/agent-1")" "$work/logs/engine-1.log" ||
  fail "engine rank 1 did not follow agent 1 to $(cat "$work/agent-1")"
# The restarted agent needs its engine's registration before it can sync.
v=$(e2e_sync_verified "after agent 1 came back" 2)
echo "e2e_rejoin: agent 1 restarted on $(cat "$work/agent-1") (was $old_port): engine rank 1 found it; version $v bit-exact on both ranks"

# An engine rank killed (-9) and started again with its own command line: the TP group re-forms
# around it (the other rank keeps serving nothing meanwhile, but keeps its weights), its agent
# commits the version its staging holds into the new memory, and the engine serves version $v
# again, bit-exact on both ranks, with no new sync; the dead process's shm segment is removed.
for r in 1 0; do
  killed=${engine_pid[$r]}
  kill -KILL "${engine_pid[$r]}"
  wait "${engine_pid[$r]}" 2>/dev/null || true
  t0=$(date +%s.%N)
  start_engine "$r" "$store"
  engine=$(cat "$work/engine-0")
  ok=
  for _ in $(seq 300); do
    out=$("${ctl[@]}" generate --engine "$engine" --prompt 1,2,3 --max-new-tokens 2 2>&1) && { ok=1; break; }
    sleep 0.1
  done
  [ -n "$ok" ] || fail "the engine does not serve after rank $r came back: $out"
  t1=$(date +%s.%N)
  grep -q "^version $v:" <<<"$out" || fail "after rank $r came back the engine serves: $out (want version $v)"
  grep -q "catching the engine up to it" "$work/logs/agent-$r.log" || fail "agent $r did not catch its engine up"
  grep -q "it catches this engine up to version $v" "$work/logs/engine-$r.log" ||
    fail "engine rank $r was not told of the catch-up (it would serve its checkpoint meanwhile)"
  "${ctl[@]}" verify --against "$work/hf" | grep -c "version $v: bit-exact" | grep -qx 2 ||
    fail "after rank $r came back the engine is not bit-exact on version $v"
  # Segments are named wsync-engine-<id>-r<rank>-<pid>-<nonce>: only this deployment's processes
  # count (other deployments on the machine, e.g. a concurrent test, may use the same engine id).
  n=$(find /dev/shm -maxdepth 1 -name "wsync-engine-engine-0-r$r-$killed-*" | wc -l)
  [ "$n" = 0 ] || fail "the shm segment of the killed engine rank $r (pid $killed) was not removed"
  n=$(find /dev/shm -maxdepth 1 -name "wsync-engine-engine-0-r$r-${engine_pid[$r]}-*" | wc -l)
  [ "$n" = 1 ] || fail "$n shm segments of the restarted engine rank $r (pid ${engine_pid[$r]}) in /dev/shm"
  echo "e2e_rejoin: engine rank $r killed and started again: TP group re-formed, caught up from the agent's staging, serving version $v bit-exact $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s after the start"
done
v2=$(e2e_sync_verified "after both engine ranks came back" 2)
echo "e2e_rejoin: the next sync publishes version $v2 bit-exact"
echo "e2e_rejoin: ok"
