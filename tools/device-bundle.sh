#!/usr/bin/env bash
# tools/device-bundle.sh: a self-contained folder (and a .tar.xz of it) that runs wsync's binaries,
# its test binaries and its GPU checks on a machine that has none of our Debian libraries (the GPU
# machines lent to sessions: a CUDA driver, Python with PyTorch and NVIDIA's NCCL wheel, no registry).
#
#   tools/device-bundle.sh [--build DIR] [--out DIR] [--all-tests]
#
# Contents (docs/gpu.md):
#   bin/   every wsync-* executable and the test binaries of the labels kernels and gpu (--all-tests:
#          every test binary), stripped
#   lib/   the shared libraries they load (ldd), except the C library, the CUDA driver and NCCL
#   mpi/   OpenMPI's orterun, its MCA components and help files, relocated through OPAL_PREFIX
#   data/  the golden files the kernel tests read
#   tools/ demo.sh, wsync-local, bench-sync.sh and bench-colocated.sh (the local deployment the
#          engine_sync, bench_sync and colocated_whole checks run)
#   tests/integration/e2e_shm.sh, e2e_python_cuda.sh (live training processes: the trainer_cuda
#          and python_cuda checks), tests/python/ and python/ (the Python publisher they run)
#   run.sh the GPU checks of docs/gpu.md; it works on a machine without a GPU (the GPU checks skip)
# NCCL (libnccl.so.2, 218 MB here) is never bundled: run.sh takes it from WSYNC_NCCL_LIB, the
# Python wheel nvidia-nccl-cu* or the system, and only the NCCL backend needs it.
# Errors: a missing build directory or binary stops the script with a message; nothing is half
# written (the folder is built under a temporary name and renamed at the end).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build"
OUT="$ROOT/device-bundle"
ALL_TESTS=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$(cd "$2" && pwd)"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --all-tests) ALL_TESTS=1; shift ;;
    -h|--help) sed -n 2,19p "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "device-bundle: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -d "$BUILD/bin" ]] || { echo "device-bundle: no build at $BUILD (run tools/setup.sh first)" >&2; exit 1; }
if ! [[ -x "$BUILD/bin/wsync-bench-kernels-gpu" ]]; then
  echo "device-bundle: $BUILD was built without CUDA (no wsync-bench-kernels-gpu); the bundle would" \
       "have no GPU code. Build with -DWSYNC_WITH_CUDA=ON." >&2
  exit 1
fi

TMP="$OUT.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin" "$TMP/lib" "$TMP/data"
trap 'rm -rf "$TMP"' EXIT

# The binaries: every executable, and the test binaries of the chosen labels (from ctest's listing).
mapfile -t tools < <(cd "$BUILD/bin" && ls wsync-* wsyncctl 2>/dev/null | sort -u)
if [[ $ALL_TESTS == 1 ]]; then
  mapfile -t tests < <(cd "$BUILD/bin" && ls ./*_test | sed 's|^\./||')
else
  mapfile -t tests < <(cd "$BUILD" && ctest -N -V -L 'kernels|gpu' 2>/dev/null |
                         sed -n 's|^.*Test command: \(/[^ ]*/bin/[A-Za-z0-9_]*_test\).*$|\1|p' |
                         xargs -r -n1 basename | sort -u)
fi
# comm_group_test for the NCCL formation check (its other cases are CPU ones).
[[ $ALL_TESTS == 1 ]] || tests+=(comm_group_test)
[[ ${#tests[@]} -gt 0 ]] || { echo "device-bundle: no test binaries found in $BUILD" >&2; exit 1; }
for b in "${tools[@]}" "${tests[@]}"; do
  strip --strip-unneeded -o "$TMP/bin/$b" "$BUILD/bin/$b"
done

# OpenMPI: orterun (mpirun), its components and help files, laid out under mpi/ as under /usr so
# that OPAL_PREFIX relocates every compiled-in path.
MPI_LIBDIR=/usr/lib/x86_64-linux-gnu/openmpi/lib
if [[ -x /usr/bin/orterun && -d "$MPI_LIBDIR/openmpi3" ]]; then
  mkdir -p "$TMP/mpi/bin" "$TMP/mpi/lib/x86_64-linux-gnu/openmpi/lib" "$TMP/mpi/share"
  cp /usr/bin/orterun /usr/bin/orted "$TMP/mpi/bin/"
  ln -s orterun "$TMP/mpi/bin/mpirun"
  cp -r "$MPI_LIBDIR/openmpi3" "$TMP/mpi/lib/x86_64-linux-gnu/openmpi/lib/"
  # Components that pull in large fabrics we never use on one host (UCX, OFI, verbs) stay out;
  # run.sh excludes them by MCA parameters as well.
  find "$TMP/mpi" -name 'mca_*ucx*' -o -name 'mca_*ofi*' -o -name 'mca_*verbs*' -o -name 'mca_*openib*' |
    xargs -r rm -f
  cp -r /usr/share/openmpi "$TMP/mpi/share/"
fi

# The shared libraries every ELF file in the bundle loads, minus the C library (the target's
# glibc is newer), the CUDA driver (the target's own) and NCCL (see the header).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libcuda\.so|libnccl\.so)'
declare -A seen=()
while IFS= read -r f; do
  while read -r name _ path _; do
    [[ -n "${path:-}" && "$path" == /* ]] || continue
    [[ "$name" =~ $skip ]] && continue
    [[ -n "${seen[$name]:-}" ]] && continue
    seen[$name]=1
    cp -L "$path" "$TMP/lib/$name"
    strip --strip-unneeded "$TMP/lib/$name" 2>/dev/null || true
  done < <(LD_LIBRARY_PATH="$MPI_LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$f" 2>/dev/null)
done < <(find "$TMP/bin" "$TMP/mpi" -type f \( -perm -u+x -o -name '*.so*' \) 2>/dev/null)

cp -r "$ROOT/tests/data/golden" "$TMP/data/"
cp "$ROOT/tools/device-run.sh" "$TMP/run.sh"
chmod +x "$TMP/run.sh"
# The local deployment scripts (run.sh's engine_sync_* checks run the demo with WSYNC_BIN=bin/).
mkdir -p "$TMP/tools"
cp "$ROOT/tools/demo.sh" "$ROOT/tools/wsync-local" "$ROOT/tools/bench-sync.sh" "$ROOT/tools/bench-colocated.sh" "$TMP/tools/"
mkdir -p "$TMP/tests/integration"
cp "$ROOT/tests/integration/e2e_shm.sh" "$ROOT/tests/integration/e2e_python_cuda.sh" "$TMP/tests/integration/"
# The Python package (pure Python and the libc-only trainer client) and the training processes of
# the python_cuda check, run by the GPU host's own Python and torch.
mkdir -p "$TMP/python/wsync/_lib" "$TMP/tests/python"
cp "$ROOT"/python/wsync/*.py "$TMP/python/wsync/"
cp -L "$BUILD/lib/libwsync_trainer_client.so" "$TMP/python/wsync/_lib/"
cp "$ROOT/tests/python/cuda_publish.py" "$ROOT/tests/python/safetensors_files.py" "$TMP/tests/python/"
git -C "$ROOT" rev-parse HEAD >"$TMP/COMMIT" 2>/dev/null || echo unknown >"$TMP/COMMIT"

rm -rf "$OUT" "$OUT.tar.xz"
mv "$TMP" "$OUT"
trap - EXIT
# xz, not zstd: tar -xJf (or Python's tarfile) unpacks it on machines without zstd.
tar -C "$(dirname "$OUT")" -cf - "$(basename "$OUT")" | xz -T0 -6 >"$OUT.tar.xz"
folder=$(du -sm "$OUT" | cut -f1)
archive=$(( $(stat -c %s "$OUT.tar.xz") / 1048576 ))
echo "device-bundle: $OUT (${folder} MiB: ${#tools[@]} tools, ${#tests[@]} test binaries, $(ls "$OUT/lib" | wc -l) libraries)"
echo "device-bundle: $OUT.tar.xz (${archive} MiB)"
if (( archive >= 60 )); then
  echo "device-bundle: the archive is ${archive} MiB, over the 60 MiB a device call can carry" >&2
  exit 1
fi
