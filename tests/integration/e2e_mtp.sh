#!/usr/bin/env bash
# DeepSeek-V3 with its MTP layer end to end (MEGATRON_TO_HF.md §5.7, engine_model README decision 20):
#   1. An INT4 checkpoint (experts and dense MLPs in INT4) with one MTP layer, cut for TP 2 x PP 2 x
#      EP 2 (expert TP 1) with mtp_num_layers 1: mtp.layers.0.* on the last stage, beside its copy
#      of the embedding (wsync-shard --verify: the cut is the checkpoint, bit for bit).
#   2. Trainer agents under mpirun, two reference engines (TP 2 x EP 2 and TP 1) that also hold the
#      MTP layer as SGLang's NextN draft does (--mtp-draft); two broadcast syncs and a sharded one
#      (the coordinator tells the trainer agents which receivers hold the draft, and only those get
#      the MTP layer's blocks), each bit-exact on the 3 engine ranks under `wsyncctl verify` (the
#      independent reference, which expects the draft where an engine holds one), the draft's params
#      included; the synced engines generating as an engine started from the checkpoint.
#   3. The premise broken: the same engines fed by a trainer that does not train the MTP layer
#      (mtp_num_layers 0) refuse the sync, naming the draft's missing pieces, rather than serve a
#      stale draft beside a new target.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
e2e_workdir e2e_mtp

e2e_int4_quant "$w/quant.json"
"$bin/wsync-model-gen" --arch deepseek-v3 --preset tiny --layers 2 --mtp 1 --seed 20261204 --out "$w/ds" \
  --quant-config "$w/quant.json" > /dev/null
for mtp in 1 0; do
  "$bin/wsync-shard" --hf "$w/ds" --out "$w/src$mtp" --tp 2 --pp 2 --ep 2 --etp 1 --dp 1 --mtp-num-layers "$mtp" \
    --verify | grep -q "bit-exact" || { echo "FAIL: the cut with mtp_num_layers $mtp is not the checkpoint"; exit 1; }
done
grep -q '"mtp_num_layers": 1' "$w/src1/parallel.json" || { echo "FAIL: parallel.json lacks mtp_num_layers"; exit 1; }
echo "ok: DeepSeek-V3 with an MTP layer cut for TP 2 x PP 2 x EP 2 (wsync-shard --verify)"

cat > "$w/first.sh" <<'FIRST'
set -euo pipefail
n=$(cat "$WSYNC_WORKDIR"/logs/agent-*.log | grep -c "with the NextN draft of MTP layer 2" || true)
[ "$n" = 3 ] || { echo "FAIL: $n of 3 engine ranks registered a NextN draft"; exit 1; }
echo "ok: every engine rank holds the NextN draft (model.layers.2.*)"
FIRST
e2e_then "$w/then.sh"
WSYNC_BIN="$bin" W="$w" HERE="$here" T="$here/tests/integration/e2e_tokens.sh" THEN_FIRST="$w/first.sh" \
  THEN_DELIVERY=sharded RANKS=3 "$here/tools/wsync-local" \
  --source "$w/src1" --hf "$w/ds" --verify --syncs 2 --rollout-engines 2 --engine-tp 2,1 --engine-ep 2,1 \
  --engine-flags "--mtp-draft" --bucket-mib 1 --workdir "$w/run" --prompt 3,14,15,92 --max-new-tokens 8 \
  --then "bash $w/then.sh"
grep -rq "sharded delivery to 3 receiver groups" "$w/run/logs" ||
  { echo "FAIL: the coordinator did not plan the sharded sync for 3 receiver groups"; exit 1; }
echo "ok: two broadcast syncs and a sharded one with the MTP layer, bit-exact with the draft on all 3 engine ranks"

if "$here/tools/wsync-local" --source "$w/src0" --hf "$w/ds" --syncs 1 --rollout-engines 1 --engine-tp 1 \
  --engine-flags "--mtp-draft" --workdir "$w/run0" > "$w/run0.out" 2>&1; then
  echo "FAIL: a sync without the MTP layer was done on an engine holding the NextN draft"; exit 1
fi
grep -rq "model.layers.2.eh_proj.weight" "$w/run0.out" "$w/run0/logs" ||
  { echo "FAIL: the refused sync does not name the draft's missing eh_proj"; tail -20 "$w/run0.out"; exit 1; }
echo "ok: a trainer without the MTP layer cannot sync an engine holding the draft (its pieces named missing)"
echo "e2e_mtp: ok"
