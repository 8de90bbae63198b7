#!/usr/bin/env bash
# A rollout agent killed (-9) and restarted on another port is found again: 4 trainer agents under
# mpirun, one reference engine of TP 2 whose ranks follow their agents through the agents' address
# files (--agent-file). Sync 1 is verified; agent 1 is killed: the engine keeps serving version 1,
# and a sync is refused naming the engine that misses its rank; agent 1 is started again with the
# same command on a new port: engine rank 1 registers with it (it re-reads the file), the agent
# rejoins the coordinator, and the next sync publishes a new version, bit-exact on both ranks.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_rejoin
e2e_trainer 81

start_agent() {  # start_agent R: rollout agent of engine rank R (a new port each time)
  rm -f "$work/agent-$1"
  "$bin/wsync-rollout-agent" --listen 127.0.0.1:0 --coordinator "$coord" --token-file "$token" --heartbeat-ms 300 \
    --address-file "$work/agent-$1" >> "$work/logs/agent-$1.log" 2>&1 &
  agent_pid[$1]=$!
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/agent-$1" ] && return 0; sleep 0.1; done
  fail "rollout agent $1 did not start"
}
wait_members() {  # wait_members N
  for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge "$1" ] && return 0; sleep 0.1; done
  fail "only $(members "${ctl[@]}") of $1 rollout agents joined"
}
declare -a agent_pid
start_agent 0
start_agent 1
"$bin/wsync-ref-engine" --model "$work/hf" --engine-id engine-0 --tp-size 2 --tp-rank 0 --tp-store 127.0.0.1:0 \
  --listen 127.0.0.1:0 --address-file "$work/engine-0" --agent-file "$work/agent-0" --agent-poll-ms 300 \
  --token-file "$token" > "$work/logs/engine-0.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do
  store=$(sed -n 's/^tp-store on //p' "$work/logs/engine-0.log" 2>/dev/null | head -n1 || true)
  [ -n "$store" ] && break
  sleep 0.1
done
[ -n "$store" ] || fail "engine rank 0 did not open its TP store"
"$bin/wsync-ref-engine" --model "$work/hf" --engine-id engine-0 --tp-size 2 --tp-rank 1 --tp-store "$store" \
  --listen 127.0.0.1:0 --address-file "$work/engine-1" --agent-file "$work/agent-1" --agent-poll-ms 300 \
  --token-file "$token" > "$work/logs/engine-1.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do [ -s "$work/engine-0" ] && break; sleep 0.1; done
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
# (heartbeats), a sync is refused before it starts, naming the engine that misses its rank.
out=$("${ctl[@]}" sync --wait 2>&1) && fail "a sync succeeded without agent 1: $out"
grep -q "agent-1 (.*engine engine-0 tp 1)" <<<"$out" || fail "the failed sync does not name agent 1: $out"
echo "e2e_rejoin: agent 1 killed: the engine serves version 1; a sync fails:"; sed "s/^/   /" <<<"$out"
wait_members_exactly() {
  for _ in $(seq 300); do [ "$(members "${ctl[@]}")" = "$1" ] && return 0; sleep 0.1; done
  fail "the coordinator still lists $(members "${ctl[@]}") rollout agents, want $1"
}
wait_members_exactly 1
refused=$("${ctl[@]}" sync --wait 2>&1) && fail "a sync was published to half of engine-0: $refused"
grep -q "engine engine-0 has no agent for TP rank 1" <<<"$refused" || fail "the sync was not refused naming engine-0: $refused"
echo "e2e_rejoin: agent 1 dropped: a sync is refused: $(grep -v '^ *(' <<<"$refused" | tail -n1 | cut -c1-140)"

start_agent 1
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
echo "e2e_rejoin: ok"
