#!/usr/bin/env bash
# Megatron's pipeline layouts beyond an even split, end to end (MEGATRON_TO_HF.md §4):
#   1. An INT4 DeepSeek-V3 (MLA, a dense first layer then MoE; 4 layers) cut for TP 2 x PP 2 x VPP 2
#      x EP 2 (expert TP 1): each pipeline rank holds two model chunks (layers 0 and 2, 1 and 3,
#      named model0. / model1. as Megatron's checkpoints key them). Trainer agents under mpirun, two
#      reference engines (TP 2 x EP 2 and TP 1); two sharded syncs and a broadcast one.
#   2. Qwen3 (dense, 4 layers) cut for PP 2 with Megatron's --decoder-first-pipeline-num-layers 1
#      (the last stage holds 3): one engine of TP 2, a broadcast and a sharded sync.
# Every sync is verified bit for bit by `wsyncctl verify` (the independent reference), and every
# synced engine must generate exactly what an engine started from the checkpoint generates.
# wsync-shard --verify checks each cut against the checkpoint first (its gathers simulated).
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
e2e_workdir e2e_vpp

e2e_int4_quant "$w/quant.json"
"$bin/wsync-model-gen" --arch deepseek-v3 --preset tiny --layers 4 --seed 20261201 --out "$w/ds" \
  --quant-config "$w/quant.json" > /dev/null
"$bin/wsync-shard" --hf "$w/ds" --out "$w/ds-src" --tp 2 --pp 2 --vpp 2 --ep 2 --etp 1 --dp 1 --verify |
  grep -q "bit-exact" || { echo "FAIL: the PP 2 x VPP 2 cut is not the checkpoint"; exit 1; }
grep -q '"layers_per_chunk": \[' "$w/ds-src/parallel.json" ||
  { echo "FAIL: parallel.json has no layers_per_chunk"; cat "$w/ds-src/parallel.json"; exit 1; }
echo "ok: DeepSeek-V3 cut for TP 2 x PP 2 x VPP 2 x EP 2 ($(tr -d ' \n' < "$w/ds-src/parallel.json" |
  grep -o '"layers_per_chunk":\[[0-9,]*\]'))"
"$bin/wsync-model-gen" --arch qwen3 --preset tiny --layers 4 --seed 20261202 --out "$w/qw" > /dev/null
"$bin/wsync-shard" --hf "$w/qw" --out "$w/qw-src" --tp 1 --pp 2 --dp 1 --decoder-first-pipeline-num-layers 1 --verify |
  grep -q "bit-exact" || { echo "FAIL: the uneven PP 2 cut is not the checkpoint"; exit 1; }
tr -d ' \n' < "$w/qw-src/parallel.json" | grep -q '"layers_per_stage":\[1,3\]' ||
  { echo "FAIL: --decoder-first-pipeline-num-layers 1 did not give stages [1, 3]"; cat "$w/qw-src/parallel.json"; exit 1; }
echo "ok: Qwen3 cut for PP 2 with the first stage holding 1 layer (Megatron's split: [1, 3])"

e2e_then "$w/then.sh"
T="$here/tests/integration/e2e_tokens.sh"
WSYNC_BIN="$bin" W="$w" T="$T" THEN_DELIVERY=broadcast RANKS=3 "$here/tools/wsync-local" --source "$w/ds-src" \
  --hf "$w/ds" --verify --syncs 2 --rollout-engines 2 --engine-tp 2,1 --engine-ep 2,1 --delivery sharded \
  --bucket-mib 1 --workdir "$w/run-ds" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "ok: DeepSeek-V3 INT4 from PP 2 x VPP 2, sharded and broadcast"
WSYNC_BIN="$bin" W="$w" T="$T" THEN_DELIVERY=sharded RANKS=2 "$here/tools/wsync-local" --source "$w/qw-src" \
  --hf "$w/qw" --verify --syncs 1 --rollout-engines 1 --engine-tp 2 --delivery broadcast --bucket-mib 1 \
  --workdir "$w/run-qw" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "ok: Qwen3 from an uneven PP 2, broadcast and sharded"
echo "e2e_vpp: ok"
