#!/usr/bin/env bash
# Three hosts on one machine: network namespaces joined by veth pairs to a bridge (in a fourth
# namespace, so the machine's own network is never touched; 10.211.0.0/24 exists only in there).
#   trainer host (10.211.0.1)   4 trainer agents under mpirun (TP 2 x EP 2 x DP... of the default
#                               model); rank 0 runs the coordinator, bound to 0.0.0.0
#   engine hosts (.2, .3)       a rollout agent (--listen 0.0.0.0:0: it advertises the address that
#                               faces the coordinator, and its data plane listens there) and a
#                               reference engine each
# Checks:
#   1. a sync crosses the network (every listener on its host's address, none on loopback) and is
#      bit-exact on both engines (`wsyncctl verify`);
#   2. a link taken down mid-sync (`ip link set eth0 down` on engine host 2, while its link is
#      slowed with tbf so that the transfer is under way) ends the sync within its timeout, and
#      nothing changed on any engine: both still verify bit-exact against the previous weights;
#   3. while host 2 stays cut off (its agent dropped for silence), engine 1 still holds sync 1's
#      weights, and a sync is not held back: it commits on engine 1 and ends partial (exit 6),
#      naming engine 2 behind (docs/sync.md "Versions");
#   4. with the link back, engine 2's agent rejoins and catches up to that version from engine 1's
#      agent with no sync (no engine behind, both bit-exact); the next sync succeeds, bit-exact on both;
#   5. a sharded sync (three trainer ranks sending) across the hosts is bit-exact on both.
# Needs root and `ip netns` (CI runs as root); otherwise it exits 77 (ctest: skipped).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "e2e_multihost: needs root, ip and tc (iproute2): skipped"; exit 77
fi
e2e_start e2e_multihost
s=$(( $$ % 100000 ))
lan="wsmh$s-lan" nt="wsmh$s-t" ne1="wsmh$s-e1" ne2="wsmh$s-e2"
e2e_cleanup_extra() {  # the namespaces (and whatever still runs in them) and their bridge
  for n in "$nt" "$ne1" "$ne2" "$lan"; do ip netns pids "$n" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true; done
  for n in "$nt" "$ne1" "$ne2" "$lan"; do ip netns del "$n" 2>/dev/null || true; done
}

# --- the hosts ---------------------------------------------------------------------------------
if ! ip netns add "$lan" 2>/dev/null; then echo "e2e_multihost: cannot create network namespaces: skipped"; exit 77; fi
ip -n "$lan" link add br0 type bridge
ip -n "$lan" link set br0 up
i=0
for n in "$nt" "$ne1" "$ne2"; do
  i=$((i + 1))
  ip netns add "$n"
  ip link add "wsmh$s-$i" type veth peer name "wsmh$s-p$i"
  ip link set "wsmh$s-$i" netns "$lan"
  ip link set "wsmh$s-p$i" netns "$n"
  ip -n "$n" link set "wsmh$s-p$i" name eth0
  ip -n "$lan" link set "wsmh$s-$i" master br0 up
  ip -n "$n" addr add "10.211.0.$i/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$n" link set lo up
done
on() { local n="$1"; shift; ip netns exec "$n" "$@"; }

# --- the model: two trainer steps of the default model, sharded TP 2 x EP 2 x DP 2 ----------------
for v in 1 2; do
  "$bin/wsync-model-gen" --from-config default --seed $((60 + v)) --out "$work/hf$v" > /dev/null
done
"$bin/wsync-shard" --hf "$work/hf1" --out "$work/megatron" --tp 2 --ep 2 --dp 2 > /dev/null
timeout_s=15

wait_file() {  # wait_file PATH SECONDS WHAT
  for _ in $(seq $(( $2 * 10 ))); do [ -s "$1" ] && return 0; sleep 0.1; done
  fail "$3 did not start within $2 s"
}

# --- trainer host ---------------------------------------------------------------------------------
on "$nt" mpirun --allow-run-as-root --oversubscribe -np 4 \
  "$bin/wsync-trainer-agent" --source "dir:$work/megatron" --coordinator 10.211.0.1:0 \
  --coordinator-listen 0.0.0.0:0 --sync-timeout "$timeout_s" --bucket-mib 4 --token-file "$token" \
  --address-file "$work/coordinator" --state-dir "$work/state" > "$work/logs/trainer.log" 2>&1 &
pids+=($!)
wait_file "$work/coordinator" 60 "the trainer job"
coord=$(cat "$work/coordinator")
case "$coord" in 10.211.0.1:*) ;; *) fail "the coordinator advertises $coord, want 10.211.0.1:PORT" ;; esac
ctl=(on "$nt" "$bin/wsyncctl" --coordinator "$coord" --token-file "$token")

# --- engine hosts ---------------------------------------------------------------------------------
for e in 1 2; do
  n=$ne1; [ "$e" = 2 ] && n=$ne2
  on "$n" "$bin/wsync-rollout-agent" --listen 0.0.0.0:0 --coordinator "$coord" --token-file "$token" \
    --heartbeat-ms 500 --address-file "$work/agent-$e" > "$work/logs/agent-$e.log" 2>&1 &
  pids+=($!)
  wait_file "$work/agent-$e" 30 "rollout agent $e"
  port=$(sed 's/.*://' "$work/agent-$e")
  on "$n" "$bin/wsync-ref-engine" --checkpoint "$work/hf1" --engine-id "engine-$e" --listen 127.0.0.1:0 \
    --agent "127.0.0.1:$port" --token-file "$token" > "$work/logs/engine-$e.log" 2>&1 &
  pids+=($!)
done
wait_members() {
  for _ in $(seq 300); do [ "$(members "${ctl[@]}")" -ge 2 ] && return 0; sleep 0.1; done
  fail "only $(members "${ctl[@]}") of 2 rollout agents joined the coordinator"
}
wait_members
verify() {  # verify HF [SECONDS]: both engines bit-exact against it, retried for SECONDS (default 0)
  local out="" end=$((SECONDS + ${2:-0}))
  while :; do
    if out=$("${ctl[@]}" verify --against "$1" 2>&1) && [ "$(grep -c 'bit-exact' <<<"$out")" = 2 ]; then return 0; fi
    [ "$SECONDS" -lt "$end" ] || break
    sleep 1
  done
  echo "$out" >&2
  fail "verify against $1: not both engines bit-exact"
}

# 1. A sync across the network.
"${ctl[@]}" sync --wait --min-agents 2 > "$work/logs/sync1.log" 2>&1 || { cat "$work/logs/sync1.log" >&2; fail "sync 1 failed"; }
verify "$work/hf1"
grep -q "data plane on 10.211.0.1" "$work/logs/trainer.log" || fail "the trainer's data plane is not on 10.211.0.1"
"${ctl[@]}" --json members | python3 -c '
import json, sys
print("\n".join(sorted(m["address"] for m in json.load(sys.stdin))))' > "$work/addrs"
grep -q '^10\.211\.0\.2:' "$work/addrs" && grep -q '^10\.211\.0\.3:' "$work/addrs" ||
  { cat "$work/addrs" >&2; fail "the agents do not advertise their hosts' addresses"; }
echo "e2e_multihost: sync 1 crossed hosts 10.211.0.1 -> .2, .3: bit-exact on both engines"

# 2. Link down mid-sync. New weights in the source, engine host 2's link slowed to 4 Mbit/s (the
# 19 MiB sync then needs ~40 s), the sync started, the link cut 3 s into it.
"$bin/wsync-shard" --hf "$work/hf2" --out "$work/megatron.next" --tp 2 --ep 2 --dp 2 > /dev/null
for f in "$work/megatron.next"/rank-*.safetensors; do mv "$f" "$work/megatron/$(basename "$f")"; done
if ! ip netns exec "$lan" tc qdisc add dev "wsmh$s-3" root tbf rate 4mbit burst 32kbit latency 1s; then
  echo "e2e_multihost: this kernel has no tbf qdisc to slow a link, so no cut can land mid-transfer: skipped"
  exit 77
fi
t0=$SECONDS
"${ctl[@]}" sync --wait --min-agents 2 > "$work/logs/sync2.log" 2>&1 &
sync_pid=$!
sleep 3
kill -0 "$sync_pid" 2>/dev/null || { cat "$work/logs/sync2.log" >&2; fail "sync 2 ended before the link went down"; }
ip -n "$ne2" link set eth0 down
rc=0
wait "$sync_pid" || rc=$?
took=$((SECONDS - t0))
[ "$rc" != 0 ] || { cat "$work/logs/sync2.log" >&2; fail "sync 2 succeeded with engine host 2 cut off"; }
[ "$took" -le $((timeout_s + 10)) ] || fail "sync 2 took $took s to fail, its timeout is $timeout_s s"
echo "e2e_multihost: sync 2 failed after $took s (timeout $timeout_s s): $(grep -m1 -iE 'fail|abort|error|deadline' "$work/logs/sync2.log" || tail -n1 "$work/logs/sync2.log")"

# While host 2 stays cut off, its agent is dropped for silence; engine 1 still holds sync 1's weights.
missing() { "${ctl[@]}" --json engines 2>/dev/null |
  python3 -c 'import json,sys; print(sum(len(e["missing_ranks"]) for e in json.load(sys.stdin) if e["engine_id"] == "engine-2"))' \
  2>/dev/null || echo 0; }
for _ in $(seq 300); do [ "$(missing)" -ge 1 ] && break; sleep 0.1; done
[ "$(missing)" -ge 1 ] || fail "engine host 2's agent was never dropped from the fleet"
out=$("${ctl[@]}" verify --against "$work/hf1" 2>&1) && [ "$(grep -c 'bit-exact' <<<"$out")" = 1 ] ||
  fail "engine 1 does not hold sync 1's weights after the failed sync: $out"
echo "e2e_multihost: after the failed sync engine 1 still holds sync 1's weights, bit-exact"
# A sync is not held back by the engine that is cut off: partial, engine 2 named behind.
rc=0
out=$("${ctl[@]}" sync --wait 2>&1) || rc=$?
[ "$rc" = 6 ] || fail "with engine 2 cut off, the sync exited $rc, want 6 (partial): $out"
grep -q "engine-2 (no agent for TP rank 0 of 1) sat it out" <<<"$out" || fail "the partial sync does not name engine 2: $out"
partial=$(sed -n 's/^sync [0-9]*: version \([0-9]*\) PARTIAL.*/\1/p' <<<"$out")
echo "e2e_multihost: with engine 2 down, version $partial is published to engine 1 alone, partial: $(grep -o 'engine-2 (no agent[^)]*) sat it out' <<<"$out")"

# The link back: engine 2's agent rejoins and copies the fleet's version from engine 1's agent.
ip netns exec "$lan" tc qdisc del dev "wsmh$s-3" root
ip -n "$ne2" link set eth0 up
wait_members
behind() { "${ctl[@]}" --json status 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["engines_behind"])' 2>/dev/null || echo -1; }
for _ in $(seq 600); do [ "$(behind)" = 0 ] && break; sleep 0.1; done
[ "$(behind)" = 0 ] || fail "engine 2 did not catch up to version $partial: $("${ctl[@]}" status 2>&1)"
verify "$work/hf2" 30
echo "e2e_multihost: with the link back, engine 2 caught up to version $partial from a peer, bit-exact on both"

# 3. The next sync succeeds.
ok=0
end=$((SECONDS + 60))
while [ "$SECONDS" -lt "$end" ]; do  # the coordinator may still be dropping / re-admitting host 2's agent
  if "${ctl[@]}" sync --wait --min-agents 2 > "$work/logs/sync3.log" 2>&1; then ok=1; break; fi
  sleep 2
done
[ "$ok" = 1 ] || { cat "$work/logs/sync3.log" >&2; fail "the sync after the link came back failed"; }
verify "$work/hf2" 30
echo "e2e_multihost: the next sync is bit-exact on both engines"

# 4. Sharded delivery across the hosts: sync 1's weights again, sent by three trainer ranks.
"$bin/wsync-shard" --hf "$work/hf1" --out "$work/megatron.next" --tp 2 --ep 2 --dp 2 > /dev/null
for f in "$work/megatron.next"/rank-*.safetensors; do mv "$f" "$work/megatron/$(basename "$f")"; done
"${ctl[@]}" sync --wait --min-agents 2 --delivery sharded > "$work/logs/sync4.log" 2>&1 ||
  { cat "$work/logs/sync4.log" >&2; fail "the sharded sync 4 failed"; }
"${ctl[@]}" timings | head -n1 | grep -q "sharded delivery" || fail "sync 4 was not sharded"
verify "$work/hf1" 30
echo "e2e_multihost: a sharded sync across the hosts is bit-exact on both engines"
echo "e2e_multihost: ok"
