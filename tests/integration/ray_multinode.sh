#!/usr/bin/env bash
# A Ray cluster of three nodes on one machine, each node a network namespace (veth pairs to a bridge
# in a fourth namespace; 10.212.0.0/24 exists only in there): `ray start --head` on node 1
# (10.212.0.1), `ray start --address` on nodes 2 and 3. The driver (ray_multinode.py, on node 1)
# places two trainer actors on node 1 and two engine actors on nodes 2 and 3, and starts wsync's
# agents beside them with wsync.ray (python/wsync/ray.py), so every byte of a sync crosses a link.
# Checks:
#   1. a trainer agent that cannot start (a missing source) fails the start naming its node;
#   2. a broadcast sync, then a sharded one, each bit-exact on both engines (`wsyncctl verify`,
#      against the checkpoint and with the independent decoder);
#   3. node 3 killed with -9 (every process in its namespace: raylet, actors, agent, engine) in the
#      middle of a sync (its link slowed with tbf so the transfer is under way): engine 0 serves one
#      whole version; node 3 started again, Ray restarts its actors in their placement-group bundle,
#      the rollout agent rejoins, and the next sync is bit-exact on both engines;
#   4. a trainer agent killed with -9: the trainer agents restart as one job (rank 0 with its durable
#      state), and the next sync is bit-exact;
#   5. the agents end with their group: the rollout agents at RolloutAgents.stop(), the trainer
#      agents with the driver's job (no stop(): Ray ends the host actors, each agent dies with its own).
# Needs root, `ip netns`, tc and Ray (build/venv-torch, pinned in tools/setup.sh); otherwise exits 77
# (ctest: skipped), naming why.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${WSYNC_RAY_PYTHON:-$root/build/venv-torch/bin/python}"
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "ray_multinode: needs root, ip and tc (iproute2): skipped"; exit 77
fi
if ! "$py" -c 'import ray, wsync.ray' 2>/dev/null; then
  echo "ray_multinode: no Ray in $py (tools/setup.sh --torch installs it): skipped"; exit 77
fi
ray_bin="$(dirname "$py")/ray"
e2e_start ray_multinode
s=$(( $$ % 100000 ))
lan="wsry$s-lan" n1="wsry$s-1" n2="wsry$s-2" n3="wsry$s-3"
rtmp="/tmp/wsry$s"  # Ray's temp dirs: short (its socket paths must fit 107 bytes)
ray_token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')  # the cluster's (Ray 2.60 token auth)
e2e_cleanup_extra() {
  for n in "$n1" "$n2" "$n3" "$lan"; do ip netns pids "$n" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true; done
  for n in "$n1" "$n2" "$n3" "$lan"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$rtmp" /tmp/ray-mn-engine-*
  local f
  for f in "$work"/trainer/*/log "$work"/rollout/*/log; do [ -f "$f" ] && { echo "---- $f" >&2; tail -n 15 "$f" >&2; }; done
  return 0
}

# --- the nodes ------------------------------------------------------------------------------------
if ! ip netns add "$lan" 2>/dev/null; then echo "ray_multinode: cannot create network namespaces: skipped"; exit 77; fi
ip -n "$lan" link add br0 type bridge
ip -n "$lan" link set br0 up
i=0
for n in "$n1" "$n2" "$n3"; do
  i=$((i + 1))
  ip netns add "$n"
  ip link add "wsry$s-$i" type veth peer name "wsry$s-p$i"
  ip link set "wsry$s-$i" netns "$lan"
  ip link set "wsry$s-p$i" netns "$n"
  ip -n "$n" link set "wsry$s-p$i" name eth0
  ip -n "$lan" link set "wsry$s-$i" master br0 up
  ip -n "$n" addr add "10.212.0.$i/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$n" link set lo up
done
on() { local n="$1"; shift; ip netns exec "$n" "$@"; }
ray_node() {  # ray_node NS INDEX RESOURCES [--head | --address HEAD]
  local n="$1" k="$2" res="$3"; shift 3
  mkdir -p "$rtmp"
  on "$n" env RAY_DISABLE_USAGE_STATS=1 RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$ray_token" "$ray_bin" start "$@" --node-ip-address="10.212.0.$k" --num-cpus=2 \
    --resources="$res" --disable-usage-stats --object-store-memory=100000000 \
    --temp-dir="$rtmp/n$k-$(date +%s%N)" > "$work/logs/ray-node$k.log" 2>&1 ||
    { cat "$work/logs/ray-node$k.log" >&2; fail "ray start on node $k failed"; }
}

# --- the model: two trainer steps of the default model, TP 2 --------------------------------------
for v in 1 2; do
  "$bin/wsync-model-gen" --from-config default --seed $((80 + v)) --out "$work/hf$v" > /dev/null
  "$bin/wsync-shard" --hf "$work/hf$v" --out "$work/megatron$v" --tp 2 > /dev/null
done
cp -r "$work/megatron1" "$work/megatron"

# --- the cluster ----------------------------------------------------------------------------------
t0=$SECONDS
ray_node "$n1" 1 '{"wsync_trainer": 4}' --head --port=6379 --include-dashboard=false
ray_node "$n2" 2 '{"wsync_engine": 1}' --address=10.212.0.1:6379
ray_node "$n3" 3 '{"wsync_engine": 1}' --address=10.212.0.1:6379
echo "ray_multinode: a Ray cluster of 3 nodes up in $((SECONDS - t0)) s"
# Node 3's link slowed just before the sync it is killed in (that sync must still be under way 2 s in).
kill_node3="tc -n $lan qdisc add dev wsry$s-3 root tbf rate 4mbit burst 32kbit latency 1s"
kill_node3="$kill_node3 && sleep 2 && ip netns pids $n3 | xargs -r kill -KILL"
restart_node3="tc -n $lan qdisc del dev wsry$s-3 root; $(declare -f on ray_node fail); \
  here=$here work=$work rtmp=$rtmp ray_bin=$ray_bin ray_token=$ray_token e2e_name=$e2e_name; \
  ray_node $n3 3 '{\"wsync_engine\": 1}' --address=10.212.0.1:6379"

on "$n1" env WSYNC_BIN="$bin" RAY_ADDRESS=10.212.0.1:6379 RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$ray_token" "$py" "$here/tests/integration/ray_multinode.py" \
  "$work" "$bin" "$token" "$kill_node3" "$restart_node3" 2>&1 | tee "$work/logs/driver.log"
[ "${PIPESTATUS[0]}" = 0 ] || fail "the driver failed"
grep -q "ray_multinode: passed" "$work/logs/driver.log" || fail "the driver did not finish"
agent_pids=$(sed -n 's/^ray_multinode: trainer agent pids //p' "$work/logs/driver.log")
[ -n "$agent_pids" ] || fail "the driver did not name the trainer agents"
alive() { local p; for p in $agent_pids; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
for _ in $(seq 150); do alive || break; sleep 0.1; done
! alive || fail "trainer agents (pids $agent_pids) outlived the driver's job"
echo "ray_multinode: the trainer agents ended with the driver's job"
echo "ray_multinode: passed in $((SECONDS - t0)) s"
