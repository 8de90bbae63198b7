#!/usr/bin/env bash
# Catch-up from a peer: two engines of TP 1, each with its rollout agent, 4 trainer agents under
# mpirun. Version V is published bit-exact; then engine 1 AND its agent are killed (-9), so neither
# its memory nor the agent's staging survives, and both are started again (the agent on a new
# port, the engine without a checkpoint). The coordinator tells the new agent that the fleet serves
# V and that engine 0's agent holds it; the agent copies V from that peer (FetchStaging, checksums
# per param) and commits it, the engine holds requests until then, and serves V bit-exact with no
# sync. The next sync is published bit-exact on both.
# Then a catch-up no peer can serve: engine 1, its agent AND engine 0's agent are killed (engine 0
# keeps serving from its memory, but no staging holds the version any more). Agent 1 asks agent 0
# (restarted, no staging), which refuses; agent 1 lets engine 1 serve what it has (no weights: a
# clear refusal, not a hold that never ends) and retries; the next sync brings both engines on.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_catchup
e2e_trainer 83

for e in 0 1; do e2e_start_agent $e; e2e_start_engine $e; done
for _ in $(seq 600); do [ "$(members "${ctl[@]}")" -ge 2 ] && break; sleep 0.1; done
v=$(e2e_sync_verified "the first sync" 2)
echo "e2e_catchup: version $v published bit-exact on both engines"

kill -KILL "${engine_pid[1]}" "${agent_pid[1]}"
wait "${engine_pid[1]}" "${agent_pid[1]}" 2>/dev/null || true
t0=$(date +%s.%N)
e2e_start_agent 1
e2e_start_engine 1
ok=
for _ in $(seq 300); do
  out=$("${ctl[@]}" generate --engine "$(cat "$work/engine-1")" --prompt 1,2,3 --max-new-tokens 2 2>&1) && { ok=1; break; }
  sleep 0.1
done
[ -n "$ok" ] || fail "engine 1 does not serve after it and its agent came back: $out"
t1=$(date +%s.%N)
grep -q "^version $v:" <<<"$out" || fail "engine 1 came back serving: $out (want version $v)"
copied=$(grep -o "copied version $v from the rollout agent at [^ ]*: [0-9]* bytes in .*GB/s)" "$work/logs/agent-1.log" | head -n1)
[ -n "$copied" ] || fail "agent 1 did not copy version $v from a peer"
grep -q "from the rollout agent at $(cat "$work/agent-0")" <<<"$copied" || fail "agent 1 copied from another peer: $copied"
grep -q "it catches this engine up to version $v" "$work/logs/engine-1.log" ||
  fail "engine 1 was not told of the catch-up (it would have served nothing or old weights meanwhile)"
"${ctl[@]}" verify --against "$work/hf" | grep -c "version $v: bit-exact" | grep -qx 2 ||
  fail "after the catch-up the engines are not both bit-exact on version $v"
echo "e2e_catchup: engine 1 and its agent killed and started again: $copied; serving version $v bit-exact $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s after the restart, no sync"

# UpdateWeights: the newest published version (min 0) is the one engine 1 now holds; a version
# nobody published makes the call wait for the next sync, and its deadline error says so.
out=$("${ctl[@]}" update-weights --agent "$(cat "$work/agent-1")" --min-version 0) || fail "update-weights: $out"
grep -q "^version $v " <<<"$out" || fail "update-weights --min-version 0 answered $out, want version $v"
late=$("${ctl[@]}" --timeout 2 update-weights --agent "$(cat "$work/agent-1")" --min-version $((v + 100)) 2>&1) &&
  fail "update-weights to an unpublished version succeeded: $late"
grep -q "DEADLINE_EXCEEDED.*waiting for the next sync" <<<"$late" || fail "update-weights to an unpublished version: $late"
echo "e2e_catchup: update-weights: the newest published version $v at once ($out); version $((v + 100)) waits for a sync"

v2=$(e2e_sync_verified "the sync after the catch-up" 2)
[ "$v2" -gt "$v" ] || fail "the next sync published version $v2"
echo "e2e_catchup: the next sync publishes version $v2 bit-exact"

kill -KILL "${agent_pid[0]}" "${engine_pid[1]}" "${agent_pid[1]}"
wait "${agent_pid[0]}" "${engine_pid[1]}" "${agent_pid[1]}" 2>/dev/null || true
e2e_start_agent 0  # engine 0 re-registers with it, still on version $v2 in its memory
for _ in $(seq 100); do grep -q "registered engine" <(tail -n 20 "$work/logs/agent-0.log") && break; sleep 0.1; done
e2e_start_agent 1
e2e_start_engine 1
refused=
for _ in $(seq 200); do
  refused=$(grep -m1 "catching up to version $v2 from a peer failed" "$work/logs/agent-1.log") && break
  sleep 0.1
done
[ -n "$refused" ] || fail "agent 1 did not report the failed catch-up to version $v2"
out=
for _ in $(seq 100); do
  out=$("${ctl[@]}" generate --engine "$(cat "$work/engine-1")" --prompt 1,2,3 --max-new-tokens 2 2>&1) && break
  grep -q "holds no weights yet" <<<"$out" && break
  sleep 0.1
done
grep -q "holds no weights yet" <<<"$out" ||
  fail "with no peer to copy from, engine 1 should serve what it has (no weights), not: $out"
out=$("${ctl[@]}" generate --engine "$(cat "$work/engine-0")" --prompt 1,2,3 --max-new-tokens 2 2>&1) ||
  fail "engine 0 stopped serving: $out"
grep -q "^version $v2:" <<<"$out" || fail "engine 0 serves $out, want version $v2"
why=$(grep -o 'retrying): .*' <<<"$refused" | cut -c12-220)
echo "e2e_catchup: no peer holds version $v2 ($why); engine 1 answers \"holds no weights yet\" instead of waiting, engine 0 keeps serving"
v3=$(e2e_sync_verified "the sync after a catch-up no peer could serve" 2)
[ "$v3" -gt "$v2" ] || fail "the next sync published version $v3"
echo "e2e_catchup: the next sync publishes version $v3 bit-exact on both"
echo "e2e_catchup: ok"
