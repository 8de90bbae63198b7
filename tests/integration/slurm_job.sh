#!/usr/bin/env bash
# The Slurm recipes (deploy/slurm/) on a real Slurm cluster: Debian's slurm-wlm 22.05 and munge,
# configured here as a two-node cluster on this host (slurmctld, and one slurmd per node, n1 and n2,
# each on its own port; every daemon as root, state under a fresh /tmp dir).
#   1. `sbatch` deploy/slurm/wsync-trainer-agents.sbatch as it is (2 nodes x 1 task): the trainer
#      agents under `srun --mpi=pmix` on a TP 2 Megatron cut, the coordinator in task 0 at n1's
#      NodeAddr.
#   2. `sbatch` deploy/slurm/wsync-rollout.sbatch (2 nodes x 1 task): a rollout agent and a reference
#      engine per task, joining that coordinator.
#   3. Two syncs of two versions (a broadcast one, then a sharded one: two TP 1 engines make one
#      receiver group), each bit-exact on both engines under `wsyncctl verify` (the independent
#      reference) for the version it published; `scancel` ends both jobs and every process of theirs.
# Skips (77) where slurm-wlm or munge is not installed (tools/setup.sh installs them) or not root
# (the daemons run as root).
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
for cmd in slurmctld slurmd sbatch munged; do
  command -v "$cmd" > /dev/null || { echo "slurm_job: SKIP: no $cmd (Debian's slurm-wlm and munge)"; exit 77; }
done
[ "$(id -u)" = 0 ] || { echo "slurm_job: SKIP: not root (the test's slurmctld and slurmd run as root)"; exit 77; }
e2e_workdir slurm_job
# Everything started here stops on exit, on every path: this cluster's jobs (cancelled, then waited
# for), any process left with this test's token, then the daemons (waited for before the rm).
jobs_here=()
stop_cluster() {
  local f pids=()
  if [ "${#jobs_here[@]}" -gt 0 ]; then
    local ids
    ids=$(IFS=,; echo "${jobs_here[*]}")
    SLURM_CONF="$w/slurm.conf" scancel --quiet "${jobs_here[@]}" 2> /dev/null || true
    for _ in $(seq 200); do
      [ -z "$(SLURM_CONF="$w/slurm.conf" squeue -h -j "$ids" 2> /dev/null)" ] && break
      sleep 0.2
    done
  fi
  pkill -KILL -f -- "--token-file $w/token" 2> /dev/null || true
  for f in "$w"/slurmd-*.pid "$w"/slurmctld.pid "$w"/munge/pid; do
    [ -s "$f" ] && pids+=("$(cat "$f")")
  done
  [ "${#pids[@]}" -gt 0 ] || return 0
  kill "${pids[@]}" 2> /dev/null || true
  for _ in $(seq 50); do kill -0 "${pids[@]}" 2> /dev/null || return 0; sleep 0.2; done
  kill -KILL "${pids[@]}" 2> /dev/null || true
}
trap 'rc=$?; stop_cluster; if [ "$rc" = 0 ]; then rm -rf "$w"; else echo "slurm_job: FAILED; files in $w" >&2; fi' EXIT
fail() { echo "FAIL: $*" >&2; for f in "$w"/log/*.log "$w"/*.out; do [ -f "$f" ] && { echo "--- $f" >&2; tail -15 "$f" >&2; }; done; exit 1; }

# --- the cluster -------------------------------------------------------------------------------
mkdir -p "$w"/{munge,state,log,spool/n1,spool/n2,tmp/n1,tmp/n2}
chmod 711 "$w/munge"
head -c 1024 /dev/urandom > "$w/munge/munge.key" && chmod 400 "$w/munge/munge.key"
munged -f --key-file="$w/munge/munge.key" --socket="$w/munge/sock" --pid-file="$w/munge/pid" \
  --log-file="$w/log/munged.log" --seed-file="$w/munge/seed"
ports=()
for _ in 1 2 3 4; do ports+=("$(e2e_fixed_port)"); done
cat > "$w/slurm.conf" <<EOF
ClusterName=wsync
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$w/munge/sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$w/state
SlurmdSpoolDir=$w/spool/%n
SlurmctldPidFile=$w/slurmctld.pid
SlurmdPidFile=$w/slurmd-%n.pid
SlurmctldLogFile=$w/log/slurmctld.log
SlurmdLogFile=$w/log/slurmd-%n.log
TmpFS=$w/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
NodeName=n1 NodeAddr=127.0.0.1 Port=${ports[2]} CPUs=4 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=${ports[3]} CPUs=4 State=UNKNOWN
PartitionName=main Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$w/slurm.conf"
slurmctld -c -i
slurmd -N n1
slurmd -N n2
for _ in $(seq 300); do
  [ "$(sinfo -h -o '%T %D' 2> /dev/null)" = "idle 2" ] && break
  sleep 0.1
done
[ "$(sinfo -h -o '%T %D')" = "idle 2" ] || fail "the Slurm cluster did not come up: $(sinfo 2>&1)"
echo "ok: a Slurm $(sinfo -V | awk '{print $2}') cluster of 2 nodes (n1, n2) is up"

# --- the model, the token, the jobs ------------------------------------------------------------
"$bin/wsync-model-gen" --from-config default --seed 20261129 --out "$w/hf" > /dev/null
"$bin/wsync-shard" --hf "$w/hf" --out "$w/src" --tp 2 > /dev/null
( umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$w/token" )
port=$(e2e_fixed_port)
export WSYNC_BIN="$bin" WSYNC_TOKEN_FILE="$w/token" WSYNC_COORDINATOR_PORT="$port" WSYNC_STATE_DIR="$w/state-wsync"
trainer_job=$(sbatch --parsable --nodes=2 --ntasks-per-node=1 --chdir="$w" --output="$w/trainer.out" \
  "$here/deploy/slurm/wsync-trainer-agents.sbatch" "dir:$w/src" --backend gloo --bucket-mib 1)
jobs_here+=("$trainer_job")
ctl=("$bin/wsyncctl" --coordinator "127.0.0.1:$port" --token-file "$w/token")
for _ in $(seq 300); do "${ctl[@]}" status > /dev/null 2>&1 && break; sleep 0.2; done
"${ctl[@]}" status > /dev/null 2>&1 || fail "the trainer agents' job ($trainer_job) started no coordinator"
rollout_job=$(sbatch --parsable --nodes=2 --ntasks-per-node=1 --chdir="$w" --output="$w/rollout.out" \
  "$here/deploy/slurm/wsync-rollout.sbatch" "127.0.0.1:$port" "$bin/wsync-ref-engine" --model "$w/hf/config.json")
jobs_here+=("$rollout_job")
[ "$(members "${ctl[@]}")" = 2 ] || for _ in $(seq 300); do
  [ "$(members "${ctl[@]}")" = 2 ] && break
  sleep 0.2
done
[ "$(members "${ctl[@]}")" = 2 ] || fail "the rollout job ($rollout_job) brought $(members "${ctl[@]}") of 2 agents"
nodes=$(squeue -h -j "$trainer_job,$rollout_job" -o '%i %N' | sort | tr '\n' ' ')
echo "ok: trainer agents (job $trainer_job) and rollout engines (job $rollout_job) running: $nodes"
grep -q "task 0 on n1" "$w/rollout.out" && grep -q "task 1 on n2" "$w/rollout.out" ||
  fail "the rollout tasks did not run one on each node"

seed=20261129
for delivery in broadcast sharded; do
  if [ "$delivery" = sharded ]; then  # the next version: the trainer agents re-read the directory
    seed=$((seed + 1))
    rm -rf "$w/hf" "$w/src"
    "$bin/wsync-model-gen" --from-config default --seed "$seed" --out "$w/hf" > /dev/null
    "$bin/wsync-shard" --hf "$w/hf" --out "$w/src" --tp 2 > /dev/null
  fi
  "${ctl[@]}" sync --wait --delivery "$delivery" > "$w/sync-$delivery.out" 2>&1 ||
    fail "a $delivery sync failed: $(tail -3 "$w/sync-$delivery.out")"
  v=$(sed -n 's/.*version \([0-9]*\) published.*/\1/p' "$w/sync-$delivery.out" | tail -n1)
  [ -n "$v" ] || fail "the $delivery sync published no version: $(tail -3 "$w/sync-$delivery.out")"
  n=$("${ctl[@]}" verify --against "$w/hf" | grep -c "version $v: bit-exact" || true)
  [ "$n" = 2 ] || fail "version $v ($delivery, seed $seed) is bit-exact on $n of 2 engines"
  echo "ok: version $v, a $delivery sync through the Slurm jobs, bit-exact on both engines (wsyncctl verify)"
done

scancel "$rollout_job" "$trainer_job"
for _ in $(seq 300); do [ -z "$(squeue -h -j "$trainer_job,$rollout_job" 2> /dev/null)" ] && break; sleep 0.2; done
[ -z "$(squeue -h -j "$trainer_job,$rollout_job")" ] || fail "scancel left the jobs running"
for _ in $(seq 100); do pgrep -f -- "--token-file $w/token" > /dev/null || break; sleep 0.2; done
! pgrep -af -- "--token-file $w/token" || fail "processes of the cancelled jobs are still running"
echo "ok: scancel ended both jobs and their processes"
echo "slurm_job: ok"
