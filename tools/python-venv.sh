#!/usr/bin/env bash
# Makes BUILD/venv, the virtual environment the Python tests run in (the ctest tests python.test_*): Debian's
# Python with its site packages (torch, numpy, pytest from the Debian packages tools/setup.sh
# installs), and the wsync package (python/) installed with this build's libwsync_trainer_client.so
# and libwsync_engine_host.so inside. Run by the build (CMake target wsync_python_venv, whenever the
# package or those libraries change) and by nothing else; offline (no index, no dependencies).
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
# A private copy of the sources: pip builds in place, and two builds must not share python/build.
tmp="$(mktemp -d "$build/python-pkg.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cp -r python/. "$tmp/"
rm -rf "$tmp/build" "$tmp"/*.egg-info
WSYNC_BUILD_DIR="$build" "$venv/bin/pip" install -q --disable-pip-version-check --no-index --no-deps \
  --no-build-isolation --force-reinstall "$tmp"
touch "$venv/.wsync-installed"
