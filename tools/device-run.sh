#!/usr/bin/env bash
# run.sh of the device bundle (tools/device-bundle.sh copies this file there): the GPU checks of
# docs/gpu.md, run from the bundle's folder on any x86-64 Linux machine with or without a GPU.
#
#   ./run.sh [RESULTS_DIR] [--quick]        (WSYNC_CHECKS=REGEX: only the checks whose names match)
#
# Every check writes RESULTS_DIR/<check>.log; RESULTS_DIR/summary.txt lists PASS / FAIL / SKIP per
# check, and the exit status is the number of failed checks. Without a GPU the GPU checks report
# SKIP (the test binaries skip themselves; the benchmark says there is no device). --quick runs the
# benchmark on small sizes only.
set -uo pipefail

B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RES="${1:-$B/results}"
QUICK=0
[[ "${2:-}" == --quick || "${1:-}" == --quick ]] && QUICK=1
[[ "$RES" == --quick ]] && RES="$B/results"
mkdir -p "$RES"
: >"$RES/summary.txt"

# NCCL is not in the bundle (see tools/device-bundle.sh): WSYNC_NCCL_LIB, NVIDIA's Python wheel, or the system.
nccl_dir="${WSYNC_NCCL_LIB:-}"
if [[ -z "$nccl_dir" ]] && command -v python3 >/dev/null; then
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
fi
if [[ -z "$nccl_dir" ]]; then
  nccl_dir=$(ldconfig -p 2>/dev/null | sed -n 's|.*libnccl\.so\.2 .*=> \(.*\)/libnccl\.so\.2$|\1|p' | head -1)
fi
export LD_LIBRARY_PATH="$B/lib${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export WSYNC_GOLDEN_DIR="$B/data/golden"
export OPAL_PREFIX="$B/mpi" PATH="$B/mpi/bin:$B/bin:$PATH"
export OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_MCA_btl='self,vader,tcp' OMPI_MCA_pml=ob1 \
       OMPI_MCA_mtl='^ofi' OMPI_MCA_btl_base_warn_component_unused=0 OMPI_MCA_plm_rsh_agent=false \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

failed=0
# check NAME COMMAND...: runs COMMAND (at most $WSYNC_CHECK_TIMEOUT s, default 300), logs it, and records PASS, FAIL or SKIP (a gtest run that
# skipped every case, or a benchmark without a device).
check() {
  local name="$1"; shift
  # WSYNC_CHECKS=REGEX runs only the checks whose names match (e.g. 'repack|engine_sync').
  [[ -n "${WSYNC_CHECKS:-}" && ! "$name" =~ ${WSYNC_CHECKS} ]] && return 0
  local t0=$SECONDS status
  if [[ $(type -t "$1") == function ]]; then "$@"; else timeout "${WSYNC_CHECK_TIMEOUT:-300}" "$@"; fi \
    >"$RES/$name.log" 2>&1
  local rc=$?
  (( rc == 124 )) && echo "timed out after ${WSYNC_CHECK_TIMEOUT:-300} s" >>"$RES/$name.log"
  if (( rc != 0 )); then
    status=FAIL; failed=$((failed + 1))
  elif grep -qE '^\[  SKIPPED \]|no CUDA device|^skipped: ' "$RES/$name.log" && ! grep -qE '^\[  PASSED  \] [1-9]' "$RES/$name.log"; then
    status=SKIP
  else
    status=PASS
  fi
  printf '%-28s %-5s %4ds  %s\n' "$name" "$status" $((SECONDS - t0)) "$*" | tee -a "$RES/summary.txt"
}

{
  echo "# wsync device bundle at commit $(cat "$B/COMMIT"), $(date -u +%FT%TZ), $(uname -m)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "# NCCL from: ${nccl_dir:-not found (only the NCCL backend needs it)}"
} | tee -a "$RES/summary.txt"

# 0. Every binary resolves every library: from the bundle, except the C library, the CUDA driver and NCCL.
foreign() {
  local bad=0 f line
  for f in "$B"/bin/* "$B"/mpi/bin/orterun; do
    while IFS= read -r line; do
      case "$line" in
        *"not found"*) echo "$f: $line"; bad=1 ;;
        *"=> $B/lib/"* | *linux-vdso* | *ld-linux* | *libc.so* | *libm.so* | *libdl.so* | *libpthread.so* | \
          *librt.so* | *libresolv.so* | *libcuda.so* | *libnccl.so*) ;;
        *"=> /"*) echo "$f: from outside the bundle: $line"; bad=1 ;;
      esac
    done < <(ldd "$f")
  done
  return $bad
}
check libraries foreign
# 1. Device discovery.
check dispatch "$B/bin/kernels_dispatch_test"
# 2. The CUDA kernels bit-exact against the CPU kernels (symmetric INT4 + Marlin; AWQ; TensorRT-LLM).
check int4_cuda "$B/bin/kernels_int4_cuda_test"
check awq_cuda "$B/bin/kernels_awq_cuda_test"
check fp8_cuda "$B/bin/kernels_fp8_cuda_test"
# Sum64, the device buckets' checksum: the CUDA kernel against the host function (any size and alignment).
check sum64_cuda "$B/bin/kernels_checksum_test"
# The block transpose a device staging loads and repacks with: the CUDA kernel against a reference.
check transpose_cuda "$B/bin/kernels_transpose_test"
# 3. The CPU kernels and the per-item CUDA bodies on this machine's CPU (golden files included).
for t in kernels_int4_test kernels_awq_test kernels_trtllm_test kernels_int4_cuda_bodies_test kernels_awq_cuda_bodies_test; do
  [[ -x "$B/bin/$t" ]] && check "${t#kernels_}" "$B/bin/$t"
done
# 4. OpenMPI from the bundle: the trainer side of a sync (TP2 x EP2 gathers, conversion, INT4) under mpirun.
check mpi_trainer mpirun -np 4 --oversubscribe "$B/bin/wsync-bench-trainer" --preset tiny --work "$RES/bench-trainer" \
  --regen --bucket-mb 0.25 -n 1 -w 0
# 5. The GPU kernel benchmark: GB/s next to a device-to-device copy, every row checked against the CPU.
if (( QUICK )); then
  check bench_kernels_gpu "$B/bin/wsync-bench-kernels-gpu" -b 4M -e 64M -f 4 -n 3 -w 1
else
  check bench_kernels_gpu "$B/bin/wsync-bench-kernels-gpu" -b 16M -e 1G -f 4 -n 10 -w 2
fi
# 6. The device path of the rollout side, end to end: the demo (4 trainer ranks under mpirun, two
#    reference engines of TP 2) with every engine's parameters in CUDA memory on device 0, registered by
#    IPC handle; the rollout agents repack on the device straight into them. Each sync is verified
#    bit-exact (wsyncctl verify: checksums of the device memory vs the oracle); the engines read their
#    device memory back to generate. The same demo with shared-memory engines gives the baseline.
have_gpu() {
  "$B/bin/kernels_dispatch_test" --gtest_filter=DispatchTest.GpuPresentWhenReported 2>/dev/null | grep -q '^\[       OK \]'
}
engine_sync() {  # engine_sync shm|cuda:0 [demo flags]
  if [[ "$1" == cuda:* ]] && ! have_gpu; then
    echo "no CUDA device: the device engine sync needs one"
    return 0
  fi
  local memory="$1"; shift
  WSYNC_BIN="$B/bin" "$B/tools/demo.sh" --syncs 3 --engine-flags "--param-memory $memory" "$@"
}
# 7. Commit into device memory vs the host path, param by param (dense and MoE, bf16 and INT4, TP 1/2).
check repack_device "$B/bin/rollout_repack_device_test"
# 8. The commit's speed: host and device engine memory next to memcpy / host-to-device copies.
if (( QUICK )); then
  check bench_repack "$B/bin/wsync-bench-repack" --work "$RES/bench-repack" --preset small -n 3
else
  check bench_repack "$B/bin/wsync-bench-repack" --work "$RES/bench-repack" --preset bench2g -n 5
fi
check engine_sync_shm engine_sync shm
check engine_sync_cuda engine_sync cuda:0
# Sharded delivery into device engine memory: each rollout agent receives only its rank's blocks.
check engine_sync_cuda_sharded engine_sync cuda:0 --delivery sharded
# The staging on the engine's GPU (--staging device): every bucket uploaded once and loaded, and
# the commit repacked, on the device; the agents' logs must say where their staging is.
engine_sync_device_staging() {
  if ! have_gpu; then
    echo "no CUDA device: the device staging needs one"
    return 0
  fi
  local run="$RES/device-staging-run"
  rm -rf "$run"
  engine_sync cuda:0 --agent-flags "--staging device" --workdir "$run" "$@" || return 1
  local n
  n=$(grep -l 'bytes in cuda:0' "$run"/logs/agent-*.log 2>/dev/null | wc -l)
  echo "rollout agents with their staging in cuda:0: $n of 4"
  grep -h 'staging .* bytes in' "$run"/logs/agent-*.log | head -4
  rm -rf "$run"
  (( n == 4 ))
}
check engine_sync_device_staging engine_sync_device_staging
check engine_sync_device_staging_sharded engine_sync_device_staging --delivery sharded
# 9. Both ends on the GPU: training processes (wsync-shm-trainer) hold their tensors in CUDA memory,
#    the trainer agents read them by IPC handle, the engine's parameters are on the device too.
trainer_cuda() {
  if ! have_gpu; then
    echo "no CUDA device: the device trainer sync needs one"
    return 0
  fi
  WSYNC_BIN="$B/bin" "$B/tests/integration/e2e_shm.sh" --cuda 0 "$@"
}
check trainer_cuda trainer_cuda
# 10. Colocated on the GPU: the same, with the trainer -> rollout hand-off through shared memory
#     (backend shm: no network, no NCCL group).
check colocated_cuda trainer_cuda --backend shm
# 10a. Colocated on the GPU through the device ring (backend cuda-ipc): the buckets go from the
#     stage sources to the rollout agents through one CUDA allocation opened by IPC handle.
check colocated_device_ring trainer_cuda --backend cuda-ipc
check colocated_device_ring_tp1 trainer_cuda --tp1 --backend cuda-ipc
# 10c. The whole colocated sync on one GPU, measured (tools/bench-colocated.sh): one training process
#     holding CUDA tensors -> the device ring -> a device staging -> the engine's CUDA parameters,
#     for the demo model and the >= 8 GB bench8g Qwen3 (generated here); each version verified
#     bit-exact and its greedy tokens equal to a fresh engine's; the table of sync time, downtime,
#     payload and the same bytes through a device-to-device copy, and peak GPU memory per process.
colocated_whole() {
  if ! have_gpu; then
    echo "no CUDA device: the whole colocated sync on the GPU needs one"
    return 0
  fi
  WSYNC_BIN="$B/bin" WSYNC_PYTHON=python3 timeout 480 "$B/tools/bench-colocated.sh" --cuda 0 --model default --model bench8g \
    --out "${TMPDIR:-/tmp}/wsync-colocated" && cp "${TMPDIR:-/tmp}"/wsync-colocated/*/timings-v*.json "$RES/" 2>/dev/null
}
check colocated_whole colocated_whole  # at most 8 minutes
# 10b. Python training processes (wsync.trainer.Publisher) whose tensors stay in CUDA memory,
#     declared by IPC handle from torch (wsync.trainer.cuda_ipc); the host's python3 and torch.
python_cuda() {
  if ! have_gpu; then
    echo "no CUDA device: the Python CUDA publisher needs one"
    return 0
  fi
  if ! python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "no CUDA device usable from python3 (torch) on this host"
    return 0
  fi
  WSYNC_BIN="$B/bin" WSYNC_PYTHON=python3 "$B/tests/integration/e2e_python_cuda.sh" --cuda 0
}
check python_cuda python_cuda
# 11. The trainer's device stages: memory spaces, device buckets staged to the host, and RunRankSync
#     with every tensor in CUDA memory (ToHf copies, CUDA INT4 kernels, device buckets) against the
#     host stages, byte for byte (dense / MoE / MLA, bf16 / INT4, PP 1 / 2).
check memory_space "$B/bin/common_memory_space_test"
check nccl_formation "$B/bin/comm_group_test" --gtest_filter='CommFactoryTest.*Nccl*'
# The shm backend's device ring (the colocated device hand-off): every comm group scenario
# (collectives 2 / 3 / 5 members, > 2 GiB, a member missing, killed, aborted, silent) with the ring
# in one CUDA allocation of device 0 that every member process opens by IPC handle.
check device_ring "$B/bin/comm_group_test" --gtest_filter='*CommGroupTest.*/shm_device'
check device_staging "$B/bin/comm_space_staging_test"
# The NCCL data plane's bucket stream with device buckets: one GPU, a lone sender over real NCCL
# (Sum64 on the device, the framing, the ordering after the device work); two GPUs, sender and
# receiver on different devices, every bucket byte-equal, Sum64 and tag verified.
check device_stream "$B/bin/comm_device_stream_test"
# The rollout side of it: a stage received over NCCL on GPU 1 from a source on GPU 0, into device
# buffers, copied down once each, loaded into staging equal to a direct load (two GPUs).
check receive_nccl "$B/bin/rollout_receive_test" --gtest_filter='*Nccl*'
# A device staging: over Gloo every bucket uploaded once and loaded on the GPU (one GPU); over NCCL
# loaded where it arrives, no copy down (two GPUs).
check receive_device_staging "$B/bin/rollout_receive_test" --gtest_filter='*DeviceStaging*'
check trainer_device "$B/bin/trainer_rank_sync_device_test"
# 12. The device stages end to end: a TP 1 x DP 4 training job holding CUDA tensors, the stage
#     source converting and quantizing on the GPU, into device engine memory (Gloo, then colocated).
check trainer_cuda_tp1 trainer_cuda --tp1
check colocated_cuda_tp1 trainer_cuda --tp1 --backend shm
# 13. The trainer side's speed, host stages vs device stages, on the same model and rank (TP 1).
# bench_trainer_pair NP WORK FLAG...: wsync-bench-trainer (TP = NP, every Linear INT4) under mpirun -np
# NP, with the host stages and then with FLAG... (a device path), on bench2g (--quick: small).
bench_trainer_pair() {
  local np="$1" work="$2"; shift 2
  local preset=bench2g
  (( QUICK )) && preset=small
  local args=(--preset "$preset" --work "$RES/$work" --tp "$np" --ep 1 --quant all --sinks discard -n 3 -w 1)
  mpirun -np "$np" "$B/bin/wsync-bench-trainer" "${args[@]}" &&
    mpirun -np "$np" "$B/bin/wsync-bench-trainer" "${args[@]}" "$@"
}
bench_trainer_device() {
  if ! have_gpu; then
    echo "no CUDA device: the device stages' benchmark needs one"
    return 0
  fi
  bench_trainer_pair 1 bench-trainer-tp1 --cuda-device 0
}
check bench_trainer_device bench_trainer_device
# 13b. The device gathers' speed (two GPUs): TP 2 on the host, then with rank r's tensors on GPU r
#      (the TP all-gathers over NCCL on the GPUs, sync/rank_sync.h).
bench_trainer_gathers() {
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if (( ${gpus:-0} < 2 )); then
    echo "skipped: fewer than two GPUs (the device gathers' benchmark needs two)"
    return 0
  fi
  bench_trainer_pair 2 bench-trainer-tp2 --gpu-per-rank
}
check bench_trainer_gathers bench_trainer_gathers
# 14. Broadcast vs sharded delivery end to end on this host's CPUs (bench2g, 4 trainer ranks ->
#     2 engines of TP 2): the same benchmark as docs/sync.md's 2-core table, on a larger host.
bench_sync() {
  if (( QUICK )); then
    echo "skipped: a quick run leaves the end-to-end benchmark out"
    return 0
  fi
  WSYNC_BIN="$B/bin" "$B/tools/bench-sync.sh" --mode both --engine-tp 2 --workdir "${TMPDIR:-/tmp}/wsync-bench-sync"
}
WSYNC_CHECK_TIMEOUT=${WSYNC_CHECK_TIMEOUT:-300} check bench_sync bench_sync
[[ -f "$RES/bench_kernels_gpu.log" ]] && grep -qE ' [1-9][0-9]*$' "$RES/bench_kernels_gpu.log" && { echo "bench_kernels_gpu: rows with #wrong > 0" |
  tee -a "$RES/summary.txt"; failed=$((failed + 1)); }
echo "# failed checks: $failed" | tee -a "$RES/summary.txt"
exit "$failed"
