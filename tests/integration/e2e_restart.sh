#!/usr/bin/env bash
# A trainer job restarted with the same --state-dir continues where it left off: 4 trainer agents
# under mpirun (coordinator on a fixed port, state in a directory), one rollout agent and a
# reference engine of TP 1. Two syncs (versions 1, 2); the trainer job is stopped (SIGTERM to
# mpirun) and started again with the same command; the rollout agent, which kept running, rejoins;
# a plain `wsyncctl sync` then publishes version 3 (not 1, which the agent would refuse), the
# engine verifies bit-exact, and `wsyncctl versions` still lists versions 1 and 2. Then a trainer
# rank is killed mid-sync (below).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_restart
"$bin/wsync-model-gen" --from-config default --seed 71 --out "$work/hf" > /dev/null
"$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2 > /dev/null
port=$(e2e_fixed_port)  # the coordinator's, the same at every start of the job
coord="127.0.0.1:$port"
ctl=("$bin/wsyncctl" --coordinator "$coord" --token-file "$token")

start_trainer() {  # start_trainer N: the trainer job, log N
  mpirun --allow-run-as-root --oversubscribe -np 4 "$bin/wsync-trainer-agent" --source "dir:$work/megatron" \
    --coordinator "$coord" --state-dir "${state_dir:-$work/state}" --token-file "$token" > "$work/logs/trainer-$1.log" 2>&1 &
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
  --token-file "$token" --address-file "$work/engine-address" > "$work/logs/engine.log" 2>&1 &
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

# A trainer rank dies mid-sync: rank 1 is stopped (so the sync cannot finish), sync 4 is triggered,
# and rank 1 is killed (-9). mpirun takes the whole trainer job down, the coordinator with it: the
# operator's `wsyncctl sync --wait` fails at once; the engine keeps serving version 3 throughout.
# The job is started again: its first plain sync publishes version 5 (4 was taken by the sync that
# died, and is durable since its trigger), although the rollout agent still holds the dead sync
# 4 (that sync is superseded, not waited out for its 600 s timeout).
# Then the same crash with the job started again without its state (--state-dir none): its first
# sync still succeeds at once, past the version the engine serves.
engine=$(cat "$work/engine-address" 2>/dev/null || true)
r1=$(e2e_rank_pid 1) || fail "no trainer agent rank 1 found"
kill -STOP "$r1"
"${ctl[@]}" sync --wait --min-agents 1 > "$work/logs/sync4.log" 2>&1 &
sync4=$!
sleep 2
t0=$(date +%s.%N)
kill -KILL "$r1"
rc=0
wait "$sync4" || rc=$?
t1=$(date +%s.%N)
[ "$rc" != 0 ] || fail "sync 4 succeeded although trainer rank 1 was killed: $(cat "$work/logs/sync4.log")"
echo "e2e_restart: trainer rank 1 killed mid-sync: wsyncctl sync --wait failed after $(python3 -c "print(f'{$t1 - $t0:.1f}')") s:" \
  "$(grep -v '^ *(' "$work/logs/sync4.log" | tail -n 1)"
wait "$trainer_pid" 2>/dev/null || true
if [ -n "$engine" ]; then
  out=$("${ctl[@]}" generate --engine "$engine" --prompt 1,2,3 --max-new-tokens 2) || fail "the engine stopped serving: $out"
  grep -q "^version 3:" <<<"$out" || fail "the engine does not serve version 3 after the failed sync: $out"
  echo "e2e_restart: the engine kept serving version 3 ($out)"
fi
start_trainer 3
wait_member
s0=$(date +%s)
out=$("${ctl[@]}" sync --wait --min-agents 1 2>&1) || fail "the first sync after the crash restart failed: $out"
grep -q "version 5 published" <<<"$out" || fail "the first sync after the crash restart did not publish version 5: $out"
(( $(date +%s) - s0 < 60 )) || fail "the first sync after the crash restart took $(( $(date +%s) - s0 )) s"
"${ctl[@]}" verify --against "$work/hf" | grep -q "version 5: bit-exact" || fail "the engine is not bit-exact on version 5"
grep -q "superseded by sync" "$work/logs/agent.log" || fail "the rollout agent did not supersede the dead sync"
echo "e2e_restart: after the crash restart, version 5 published bit-exact in $(( $(date +%s) - s0 )) s"

# The same crash, and the job started again WITHOUT its state (--state-dir none: as if the directory
# were lost): the agent still holds the dead sync (receiving), and the new coordinator numbers its
# syncs from 1. Its first plain sync must still succeed at once: the agent ends the dead sync of the
# other coordinator run whatever its id, and the version goes past the one the engine serves (5).
r1=$(e2e_rank_pid 1) || fail "no trainer agent rank 1 found"
kill -STOP "$r1"
"${ctl[@]}" sync --wait --min-agents 1 > "$work/logs/sync-dead.log" 2>&1 &
dead=$!
sleep 2
kill -KILL "$r1"
wait "$dead" 2>/dev/null || true
wait "$trainer_pid" 2>/dev/null || true
state_dir="none" start_trainer 4
wait_member
s0=$(date +%s)
out=$("${ctl[@]}" sync --wait --min-agents 1 2>&1) || fail "the first sync of a job restarted without its state failed: $out"
v=$(sed -n 's/.*version \([0-9]*\) published.*/\1/p' <<<"$out")
[ -n "$v" ] && [ "$v" -gt 5 ] || fail "the first sync of a job restarted without its state did not publish a version past 5: $out"
"${ctl[@]}" verify --against "$work/hf" | grep -q "version $v: bit-exact" || fail "the engine is not bit-exact on version $v"
echo "e2e_restart: restarted without its state, the job's first sync published version $v bit-exact in $(( $(date +%s) - s0 )) s"
echo "e2e_restart: ok"
