#!/usr/bin/env bash
# The GPU run whose files the docs quote: on the machine with the GPU, unpacks the device bundle
# (tools/device-bundle.sh), runs every check of its run.sh with the full benchmarks into a local
# directory, plus the comm benchmark of docs/comm.md, and copies what the docs cite (summary.txt,
# every check's .log, the benchmarks' own tables; never the models the benchmarks generate) into
# OUT/results.tar.gz (the device tool returns at most 8 files) and OUT/summary.txt as the checks
# finish, so that a run cut short still returns what it completed. Unpack it into
# docs/results/<gpu>/<date>-<commit>/ and commit that.
#
#   tools/device-results.sh BUNDLE.tar.xz OUT [--quick]
set -uo pipefail
bundle="${1:?usage: tools/device-results.sh BUNDLE.tar.xz OUT [--quick]}"
out="${2:?usage: tools/device-results.sh BUNDLE.tar.xz OUT [--quick]}"
quick="${3:-}"
work="${TMPDIR:-/tmp}/wsync-device-results"
rm -rf "$work" && mkdir -p "$work" "$out" || exit 1
tar -xJf "$bundle" -C "$work" || { echo "device-results: cannot unpack $bundle" >&2; exit 1; }
b="$work/device-bundle"
res="$work/results"
collect() {
  mkdir -p "$out" && cp -p "$res/summary.txt" "$out/" 2>/dev/null
  (cd "$res" && tar -czf "$out/results.tar.gz.tmp" --exclude='bench-*' --exclude='*.safetensors' . 2>/dev/null &&
    mv "$out/results.tar.gz.tmp" "$out/results.tar.gz")
  true
}
( while sleep 10; do collect; done ) &
collector=$!
"$b/run.sh" "$res" $quick
rc=$?
# Gloo vs shm broadcast on this host's CPUs (docs/comm.md), 3 members, 16 MiB to 1 GiB.
for backend in gloo shm; do
  timeout 180 env PATH="$b/bin:$PATH" LD_LIBRARY_PATH="$b/lib" "$b/bin/wsync-bench-comm" --backend "$backend" --ranks 3 \
    -b 16M -e 1G -f 4 > "$res/bench_comm_$backend.log" 2>&1 || echo "exit $?" >> "$res/bench_comm_$backend.log"
done
kill "$collector" 2>/dev/null
collect
{ nproc; lscpu | grep -m1 'Model name'; free -g | sed -n 2p
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__)'; } > "$out/host.txt" 2>&1
echo "device-results: run.sh exit $rc (failed checks); files in $out"
exit "$rc"
