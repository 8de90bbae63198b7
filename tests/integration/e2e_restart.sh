#!/usr/bin/env bash
# A trainer job restarted with the same --state-dir continues where it left off: 4 trainer agents
# under mpirun (coordinator on a fixed port, state in a directory), one rollout agent and a
# reference engine of TP 1. Two syncs (versions 1, 2); the trainer job is stopped (SIGTERM to
# mpirun) and started again with the same command; the rollout agent, which kept running, rejoins;
# a plain `wsyncctl sync` then publishes version 3 (not 1, which the agent would refuse), the
# engine verifies bit-exact, and `wsyncctl versions` still lists versions 1 and 2.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_restart
"$bin/wsync-model-gen" --from-config default --seed 71 --out "$work/hf" > /dev/null
"$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2 > /dev/null
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
coord="127.0.0.1:$port"
ctl=("$bin/wsyncctl" --coordinator "$coord" --token-file "$token")

start_trainer() {  # start_trainer N: the trainer job, log N
  mpirun --allow-run-as-root --oversubscribe -np 4 "$bin/wsync-trainer-agent" --source "dir:$work/megatron" \
    --coordinator "$coord" --state-dir "$work/state" --token-file "$token" > "$work/logs/trainer-$1.log" 2>&1 &
  trainer_pid=$!
  pids+=($trainer_pid)
}
wait_member() {
  for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge 1 ] && return 0; sleep 0.1; done
  fail "the rollout agent did not join the coordinator at $coord"
}

start_trainer 1
"$bin/wsync-rollout-agent" --listen 127.0.0.1:0 --coordinator "$coord" --token-file "$token" --heartbeat-ms 300 \
  --address-file "$work/agent" > "$work/logs/agent.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do [ -s "$work/agent" ] && break; sleep 0.1; done
"$bin/wsync-ref-engine" --model "$work/hf" --engine-id engine-0 --listen 127.0.0.1:0 --agent "$(cat "$work/agent")" \
  --token-file "$token" > "$work/logs/engine.log" 2>&1 &
pids+=($!)
wait_member
for v in 1 2; do
  "${ctl[@]}" sync --wait --min-agents 1 > "$work/logs/sync$v.log" 2>&1 || fail "sync $v failed: $(tail -n 3 "$work/logs/sync$v.log")"
done
[ -s "$work/state/coordinator-state.json" ] || fail "no coordinator-state.json in the state directory"

# The trainer job goes away (as when mpirun loses a rank) and is started again with the same command.
kill -TERM "$trainer_pid"
wait "$trainer_pid" 2>/dev/null || true
start_trainer 2
wait_member
out=$("${ctl[@]}" sync --wait --min-agents 1 2>&1) || fail "the first sync after the restart failed: $out"
grep -q "version 3 published" <<<"$out" || fail "the first sync after the restart did not publish version 3: $out"
"${ctl[@]}" verify --against "$work/hf" | tee "$work/logs/verify.log" | grep -q "version 3: bit-exact" ||
  fail "the engine is not bit-exact on version 3: $(cat "$work/logs/verify.log")"
n=$("${ctl[@]}" --json versions | python3 -c 'import json,sys; print(sum(1 for v in json.load(sys.stdin) if v["ok"]))')
[ "$n" = 3 ] || fail "wsyncctl versions lists $n published versions after the restart, want 3"
echo "e2e_restart: the restarted trainer job published version 3, bit-exact; versions 1-3 listed"
echo "e2e_restart: ok"
