#!/usr/bin/env bash
# `pip install ./python` as a user runs it, in a fresh virtual environment (Debian's python3, no
# system site packages): pip fetches scikit-build-core from PyPI into its isolated build
# environment, which configures the project with CMake and builds only libwsync_trainer_client and
# libwsync_engine_host into the wheel (python/pyproject.toml, cmake/WsyncPythonPackage.cmake). Then,
# outside the checkout, the installed package must import, load both libraries from inside itself,
# carry the project's version (CMakeLists.txt), py.typed and the vLLM plugin entry point, and run
# `python -m wsync --help`.
#
#   tools/check-pip-install.sh [PIP_INSTALL_ARGS...]   # e.g. --config-settings=cmake.define.WSYNC_WITH_CUDA=ON
#
# Built from a copy of the checkout's files (tracked and untracked, not ignored): never the
# checkout's build/. CUDA off unless given (this checks the packaging; the C++ build checks CUDA).
# Needs PyPI and the C++ build's Debian packages (tools/setup.sh --deps-only). Measured on the 2-core
# CI machine: 256 CPU-seconds in all (CMake's configure, the 92 build steps of the two libraries,
# pip), so about 2.5-3 minutes with both cores free.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d /tmp/wsync-pip-install.XXXXXX)"
trap 'rc=$?; [ $rc = 0 ] && rm -rf "$work" || echo "check-pip-install: failed; pip log in $work/pip.log" >&2' EXIT
t0=$SECONDS
mkdir "$work/src"
git -C "$root" ls-files -z -co --exclude-standard |
  tar -C "$root" --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$work/src" -xf -
/usr/bin/python3 -m venv "$work/venv"
echo "check-pip-install: pip install ./python (a fresh venv in $work)"
if ! "$work/venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -v \
    --config-settings=cmake.define.WSYNC_WITH_CUDA=OFF "$@" "$work/src/python" >"$work/pip.log" 2>&1; then
  tail -n 40 "$work/pip.log" >&2
  exit 1
fi
built=$((SECONDS - t0))
want="$(sed -n 's/^project(wsync VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")"
cd "$work"  # not the checkout: the installed package, not python/ on the path
"$work/venv/bin/python" - "$want" <<'PY'
import importlib.metadata as md
import pathlib
import subprocess
import sys

import wsync
from wsync import _engine_host, _trainer_client

pkg = pathlib.Path(wsync.__file__).parent
assert "site-packages" in str(pkg), pkg
assert wsync.__version__ == sys.argv[1], (wsync.__version__, sys.argv[1])
for lib in (_trainer_client.library(), _engine_host.library()):
    assert pathlib.Path(lib._name).parent == pkg / "_lib", lib._name
assert (pkg / "py.typed").exists()
plugins = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "wsync"]
assert plugins == ["wsync.adapters.vllm:register"], plugins
out = subprocess.run([sys.executable, "-m", "wsync", "--help"], capture_output=True, text=True, check=True).stdout
assert "--adapter" in out, out
sizes = {p.name: p.stat().st_size >> 20 for p in (pkg / "_lib").iterdir()}
print(f"check-pip-install: wsync {wsync.__version__} in {pkg}: both libraries load from wsync/_lib ({sizes} MiB), "
      "py.typed, the vLLM entry point, python -m wsync")
PY
echo "check-pip-install: ok (pip install: ${built} s; $(nproc) cores)"
