#!/usr/bin/env bash
# Python training processes (tests/python/cuda_publish.py, wsync.trainer.Publisher) publishing
# tensors that live on a device: 2 ranks (TP 2) under tools/wsync-local --trainer, one reference
# engine of TP 2, two versions (as loaded, then doubled in place), each verified bit-exact.
#
#   tests/integration/e2e_python_cuda.sh [--cuda N]
#
# Without --cuda the tensors are host tensors (moved into the shared segment): what CI runs here.
# With --cuda N (the device bundle's python_cuda check) they stay in CUDA memory on device N,
# declared by IPC handle (wsync.trainer.cuda_ipc), and the engine's parameters are on the device too;
# the trainer agents' logs must show the CUDA tensors. $WSYNC_PYTHON: the Python with torch
# (default: the checkout's build/venv, else python3); $WSYNC_BIN: the binaries.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${WSYNC_BIN:-$root/build/bin}"
py="${WSYNC_PYTHON:-}"
[ -n "$py" ] || { [ -x "$root/build/venv/bin/python" ] && py="$root/build/venv/bin/python"; } || py=python3
device=cpu engine_flags=()
if [ "${1:-}" = --cuda ]; then
  device="cuda:$2"; engine_flags=(--engine-flags "--param-memory cuda:$2")
  # Legacy IPC handles need cudaMalloc'd blocks; expandable segments have none (wsync.trainer.cuda_ipc).
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:False}"
fi
work=$(mktemp -d /tmp/e2e-python-cuda.XXXXXX)
trap 'rc=$?; [ $rc = 0 ] && rm -rf "$work" || echo "e2e_python_cuda: logs in $work/run/logs" >&2' EXIT
"$bin/wsync-model-gen" --arch qwen3 --preset tiny --seed 9 --out "$work/hf" > /dev/null
"$bin/wsync-shard" --hf "$work/hf" --out "$work/src" --tp 2 > /dev/null
pkg="$root/python"  # the wsync package (a checkout, or the device bundle)
out=$(PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}" WSYNC_BIN="$bin" "$root/tools/wsync-local" --source "$work/src" \
  --rollout-engines 1 --engine-tp 2 --workdir "$work/run" "${engine_flags[@]}" \
  --trainer "$py $root/tests/python/cuda_publish.py --src $work/src --device $device --out $work/out" 2>&1) ||
  { echo "$out" | tail -n 40; echo "e2e_python_cuda: the run failed" >&2; exit 1; }
echo "$out" | grep -E "shared|verified" | sed 's/^ */   /'
for v in 1 2; do
  grep -q "version $v: every engine bit-exact with the HF conversion" <<<"$out" ||
    { echo "e2e_python_cuda: version $v not verified" >&2; exit 1; }
done
if [ "$device" != cpu ]; then
  n=$(grep -c "on CUDA devices" "$work/run/logs/trainer.log" || true)
  [ "$n" -ge 2 ] || { echo "e2e_python_cuda: $n of 2 trainer agents registered CUDA tensors" >&2; exit 1; }
  grep -q "on $device" <<<"$out" || { echo "e2e_python_cuda: the tensors were not on $device" >&2; exit 1; }
fi
echo "e2e_python_cuda: ok ($device)"
