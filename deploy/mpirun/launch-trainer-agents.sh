#!/usr/bin/env bash
# Starts the wsync trainer agents beside a Megatron job: same hosts, same world size, same rank
# order (Megatron's tp-cp-ep-dp-pp), so agent rank r reads Megatron rank r's shard.
#
#   deploy/mpirun/launch-trainer-agents.sh --hostfile HOSTS --np N --source dir:/ckpt/megatron \
#       [--coordinator HOST0:7070] [--token-file /etc/wsync/token] [--state-dir /var/lib/wsync/state]
#       [-- extra agent flags]
#
# Use the hostfile (and slots) of the Megatron launch so that `mpirun --map-by` places rank r on
# the host of Megatron rank r; with torchrun-launched Megatron, list each host once per GPU in
# RANK order. The coordinator runs in agent rank 0: give it an address reachable from the rollout
# hosts (HOST0 = the host of rank 0); rank 0 binds 0.0.0.0 on its port (a Debian `hostname -f` may
# resolve to 127.0.1.1 on its own host), and every rank's data plane listens on the address that
# faces the coordinator (pass `-- --data-host ADDR` to pick another interface). Environment: WSYNC_BIN (default /opt/wsync/bin),
# MPIRUN_ARGS (e.g. "--mca btl_tcp_if_include eth0").
# The coordinator's durable state (versions, the fleet, a commit in progress) lives in --state-dir on
# rank 0's host (default /var/lib/wsync/state; "none": in memory only): the job started again with
# this same command continues its versions (docs/sync.md "Versions").
# Live training (--source shm:JOB): run the agents as the training job's user, with the same
# WSYNC_RUNTIME_DIR (or XDG_RUNTIME_DIR) as the training processes; Megatron rank r then calls
# wsync_client_open("JOB", r, ...) (src/trainer_client) and requests its syncs. The agents wait
# for the training processes to register before the coordinator comes up.
set -euo pipefail
hostfile="" np="" source="" coordinator="" token="/etc/wsync/token" state_dir="/var/lib/wsync/state"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile) hostfile="$2"; shift 2 ;;
    --np) np="$2"; shift 2 ;;
    --source) source="$2"; shift 2 ;;
    --coordinator) coordinator="$2"; shift 2 ;;
    --token-file) token="$2"; shift 2 ;;
    --state-dir) state_dir="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$np" ] && [ -n "$source" ] || { sed -n '2,18p' "$0"; exit 2; }
bin="${WSYNC_BIN:-/opt/wsync/bin}"
coordinator="${coordinator:-$(hostname -f):7070}"
hosts=()
[ -n "$hostfile" ] && hosts=(--hostfile "$hostfile" --map-by slot)
# shellcheck disable=SC2086
exec mpirun ${MPIRUN_ARGS:-} "${hosts[@]}" -np "$np" \
  -x WSYNC_LOG_LEVEL -x WSYNC_TOKEN \
  "$bin/wsync-trainer-agent" --source "$source" --coordinator "$coordinator" \
  --coordinator-listen "0.0.0.0:${coordinator##*:}" --token-file "$token" --state-dir "$state_dir" "${extra[@]}"
