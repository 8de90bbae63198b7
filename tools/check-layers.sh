#!/usr/bin/env bash
# Checks the house's include rules (src/README.md "Floors"), and, given the trainer agent's binary,
# that it carries no repack. Exit 0 when every rule holds; else names each breach and exits 1.
#   tools/check-layers.sh [WSYNC_TRAINER_AGENT_BINARY]     (ctest runs this as tool.check_layers)
# Rules:
#   1. Nothing outside src/rollout_agent/ includes rollout_agent/ (tests of the agent under tests/ may).
#   2. Nothing outside src/ref_engine/ includes ref_engine/, but for tests that drive the engine side
#      with the reference model (*_test.cc, tests/, tools/bench/).
#   3. src/engine_model/, src/engine_memory/ and src/engine_side/ include no agent
#      (rollout_agent/, trainer_agent/), plan/ or engine process (ref_engine/, engine_host/).
#   4. The trainer agent's binary has no engine_model repack symbol (Commit, Restore, DequantizeToDense).
#   5. src/trainer_agent/coordinator/ (the control plane, tests included) includes nothing of
#      trainer_agent/ outside coordinator/: it reaches the trainer ranks only through TrainerSide.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bad=0
breach() { echo "check-layers.sh: $*" >&2; bad=1; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files 'src/*' 'tools/*' 'tests/*' | grep -E '\.(h|cc|cu|cuh)$')
else
  mapfile -t files < <(find src tools tests -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh')
fi
for f in "${files[@]}"; do
  while IFS=: read -r line inc; do
    target=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<<"$inc")
    case "$target" in
      rollout_agent/*)
        case "$f" in src/rollout_agent/* | tests/*) ;; *) breach "$f:$line includes $target (rule 1)" ;; esac ;;
      ref_engine/*)
        case "$f" in src/ref_engine/* | tests/* | tools/bench/* | *_test.cc) ;; *) breach "$f:$line includes $target (rule 2)" ;; esac ;;
    esac
    case "$f" in
      src/engine_model/* | src/engine_memory/* | src/engine_side/*)
        case "$f" in *_test.cc) continue ;; esac
        case "$target" in
          rollout_agent/* | trainer_agent/* | plan/* | ref_engine/* | engine_host/*) breach "$f:$line includes $target (rule 3)" ;;
        esac ;;
      src/trainer_agent/coordinator/*)
        case "$target" in
          trainer_agent/coordinator/*) ;;
          trainer_agent/*) breach "$f:$line includes $target (rule 5)" ;;
        esac ;;
    esac
  done < <(grep -nE '^\s*#\s*include "' "$f" || true)
done
if [ -n "${1:-}" ]; then
  [ -x "$1" ] || { echo "check-layers.sh: $1 is not an executable" >&2; exit 2; }
  syms=$(nm -C "$1")
  repack=$(grep -E 'wsync::engine_model::(Commit|Restore|DequantizeToDense|RestoreParamToLoaded)\(' <<<"$syms" || true)
  [ -z "$repack" ] || breach "$1 carries repack (rule 4): $(head -1 <<<"$repack" | cut -c1-160)"
  grep -q ' wsync::' <<<"$syms" || breach "$1: no wsync symbol seen by nm (is it stripped? rule 4 cannot be checked)"
fi
if ((bad)); then exit 1; fi
echo "check-layers.sh: ${#files[@]} files follow the include rules${1:+; $(basename "$1") carries no repack}"
