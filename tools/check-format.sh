#!/usr/bin/env bash
# Checks that every C++ / CUDA source the repository tracks is formatted as .clang-format says
# (clang-format 14, Debian 12's). Exit 0 when all are; else lists the files and exits 1.
#   tools/check-format.sh          check (ctest runs this as `format_check`)
#   tools/check-format.sh --fix    rewrite the files in place
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$fmt" ]; then
  echo "check-format.sh: clang-format not found (tools/setup.sh installs it)" >&2
  exit 2
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
else
  mapfile -t files < <(find src tools tests -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh')
fi
if [ "${1:-}" = "--fix" ]; then
  "$fmt" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$fmt" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "check-format.sh: ${#bad[@]} file(s) differ from .clang-format (fix: tools/check-format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check-format.sh: ${#files[@]} files formatted"
