#!/usr/bin/env bash
# One RL "training step" for the e2e scripts: the HF checkpoint HF changes in place as an optimizer
# step at an RL learning rate changes it (perturb_hf.py: 1 % of its bf16 elements by one ulp, drawn
# with SEED), and the trainer's rank files in SRC are cut from it again (wsync-shard with the given
# arguments). The trainer agents re-read SRC at every sync. Optional: QUANT_OUT=DIR QUANT_ARGS="..."
# also writes the FP8 checkpoint of the new weights (wsync-quant fp8), for engines started from one.
#   train_step.sh HF SRC SEED [wsync-shard args...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="${WSYNC_BIN:-$here/build/bin}"
hf=$1 src=$2 seed=$3
shift 3
python3 "$here/tests/integration/perturb_hf.py" "$hf" 0.01 "$seed" > /dev/null
rm -rf "$src.new"
"$bin/wsync-shard" --hf "$hf" --out "$src.new" "$@" > /dev/null
cp "$src.new"/* "$src/"
rm -rf "$src.new"
if [ -n "${QUANT_OUT:-}" ]; then
  rm -rf "$QUANT_OUT"
  # shellcheck disable=SC2086  # QUANT_ARGS is a list of flags
  "$bin/wsync-quant" fp8 --hf "$hf" --out "$QUANT_OUT" ${QUANT_ARGS:-} > /dev/null
fi
