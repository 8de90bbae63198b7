#!/usr/bin/env bash
# Makes BUILD/venv, the virtual environment the Python tests run in (the ctest tests python.*): Debian's
# Python with its site packages (torch, numpy, pytest, mypy from the Debian packages tools/setup.sh
# installs), and the wsync package (python/) installed with this build's libwsync_trainer_client.so
# and libwsync_engine_host.so inside; the package goes into BUILD/venv-torch too where that exists
# (tools/setup.sh --torch makes it). Run by the build (CMake target wsync_python_venv, whenever the
# package or those libraries change) and by tools/setup.sh after it makes BUILD/venv-torch.
#
# Offline and without a rebuild: tools/python-wheel.py packs python/ and BUILD/lib's two libraries
# into the wheel `pip install ./python` would build through CMake (scikit-build-core), and pip
# installs that wheel (no index, no dependencies, no build backend).
#
#   tools/python-venv.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${1:?usage: tools/python-venv.sh BUILD_DIR}"
case "$build" in /*) ;; *) build="$PWD/$build" ;; esac
venv="$build/venv"
py=/usr/bin/python3
[ -x "$py" ] || { echo "python-venv.sh: no $py (Debian's python3; tools/setup.sh --deps-only installs it)" >&2; exit 1; }
grep -qs '^home = /usr/bin$' "$venv/pyvenv.cfg" && grep -qs '^include-system-site-packages = true$' "$venv/pyvenv.cfg" ||
  { rm -rf "$venv"; "$py" -m venv --system-site-packages "$venv"; }
tmp="$(mktemp -d "$build/python-wheel.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
wheel="$("$py" tools/python-wheel.py "$build/lib" "$tmp")"
for env in "$venv" "$build/venv-torch"; do
  [ -x "$env/bin/python" ] || continue
  "$env/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps --force-reinstall "$wheel"
done
touch "$venv/.wsync-installed"
