#!/usr/bin/env bash
# Expert pruning end to end (docs/expert-pruning.md): an INT4 DeepSeek-V3 checkpoint (8 routed
# experts, two MoE layers) cut for TP 1 x EP 2 x PP 2, trainer agents under mpirun with an expert map
# keeping 4 experts per layer in a scrambled order (an item pruned on both EP members, mixed ones),
# one reference engine of TP 2 x EP 2 serving the pruned config. Two sharded syncs (each engine rank
# receives only its blocks, planned on the pruned config), each verified bit for bit against the
# pruned oracle checkpoint (wsync-prune --hf), then a broadcast one, verified too; then an engine
# started from that checkpoint must generate exactly what the synced engine generates.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
e2e_workdir e2e_prune

e2e_int4_quant "$w/quant.json"
"$bin/wsync-model-gen" --arch deepseek-v3 --preset tiny --layers 3 --seed 20261126 --out "$w/hf" \
  --quant-config "$w/quant.json" > /dev/null
"$bin/wsync-shard" --hf "$w/hf" --out "$w/src" --tp 1 --pp 2 --ep 2 --dp 2 --layers-per-stage 2,1 > /dev/null
# Layers 1 and 2 are MoE. EP 2: member 0 holds experts 0-3, member 1 experts 4-7; local expert 1
# (experts 1 and 5) is pruned on both members in layer 1.
echo '{"num_experts": 8, "layers": {"1": [6, 0, 3, 4], "2": [7, 2, 5, 1]}}' > "$w/map.json"
"$bin/wsync-prune" --expert-map "$w/map.json" --hf "$w/hf" --out "$w/hf_pruned"

e2e_then "$w/then.sh"
WSYNC_BIN="$bin" W="$w" T="$here/tests/integration/e2e_tokens.sh" THEN_DELIVERY=broadcast RANKS=2 \
  THEN_AS="an engine started from the pruned checkpoint" "$here/tools/wsync-local" --source "$w/src" \
  --expert-map "$w/map.json" --hf "$w/hf_pruned" \
  --verify --syncs 2 --engine-tp 2 --engine-ep 2 --delivery sharded --bucket-mib 1 --workdir "$w/run" \
  --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "e2e_prune: ok"
