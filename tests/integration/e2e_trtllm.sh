#!/usr/bin/env bash
# Syncs to engines that hold TensorRT-LLM's INT4 layout end to end (docs/engine-formats.md,
# docs/spec/TRTLLM_INT4.md): a Qwen3-MoE checkpoint cut for TP 2 x EP 2 x DP 2, trainer agents under
# mpirun given no quantization config, quantizing to compressed-tensors INT4 because the engines
# declare it (as for a Marlin engine), two reference engines that
# declare "engine_layout": "trtllm-sm80" (TP 2 x EP 2) and "trtllm-sm90" (TP 1), whose rollout
# agents preprocess into TensorRT-LLM's W4A16 bytes (up_proj before gate_proj in w3_w1). With
# --delta auto, between syncs the checkpoint changes as an RL step changes it (train_step.sh): a
# sharded sync in full, one as deltas, a broadcast one in full (the first of its delivery), one more
# as deltas, each verified bit for bit (the sync's checksums and the independent reference); then a
# Marlin engine started from the same checkpoint (the same INT4 values in SGLang's layout) must
# generate exactly what both generate.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
e2e_workdir e2e_trtllm

quant() {  # quant LAYOUT: the compressed-tensors config, with the engine layout the engine declares
  cat <<JSON
{"quant_method": "compressed-tensors", "format": "pack-quantized", "engine_layout": "$1",
 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
   "strategy": "group", "group_size": 64, "symmetric": true, "actorder": null}}},
 "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*mlp\\\\.gate\$"]}
JSON
}
quant trtllm-sm80 > "$w/sm80.json"
quant trtllm-sm90 > "$w/sm90.json"
quant marlin > "$w/marlin.json"
"$bin/wsync-model-gen" --arch qwen3-moe --preset tiny --seed 20261127 --out "$w/hf" > /dev/null
"$bin/wsync-shard" --hf "$w/hf" --out "$w/src" --tp 2 --pp 1 --ep 2 --dp 2 > /dev/null

cat > "$w/then.sh" <<'THEN'
set -euo pipefail
ctl=("$WSYNC_BIN/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE")
grep -q "compressed-tensors pack-quantized 4-bit group 64 symmetric, 3 ignore rules (as the engines declare)" \
  "$WSYNC_WORKDIR/logs/trainer.log" || { echo "FAIL: the trainer agents did not follow the engines' quantization"; exit 1; }
echo "ok: the trainer agents, given no --quant-config, quantize as the engines declare"
step() { WSYNC_BIN="$WSYNC_BIN" "$HERE/tests/integration/train_step.sh" "$WSYNC_HF" "$W/src" "$1" --tp 2 --pp 1 --ep 2 --dp 2; }
delta=$("${ctl[@]}" timings | grep "^deltas from version ") ||
  { echo "FAIL: the second sharded sync was not sent as deltas: $("${ctl[@]}" timings)"; exit 1; }
echo "ok: the second sharded sync as $delta"
for kind in "in full" "deltas from version"; do
  [ "$kind" = "in full" ] || step 3
  "${ctl[@]}" sync --wait --delivery broadcast > /dev/null
  for how in "" --independent; do
    "${ctl[@]}" verify --against "$WSYNC_HF" $how | grep -c ": bit-exact\|: independent: equal" | grep -qx 3 ||
      { echo "FAIL: the broadcast sync is not bit-exact $how on the 3 TensorRT-LLM engine ranks"; exit 1; }
  done
  line=$("${ctl[@]}" timings | grep "^$kind") ||
    { echo "FAIL: the broadcast sync was not sent $kind: $("${ctl[@]}" timings)"; exit 1; }
  echo "ok: a broadcast sync to the TensorRT-LLM-layout engines, bit-exact on all 3 engine ranks: $line"
done
# The sm80 engine (TP 2 x EP 2) and the sm90 one (TP 1).
"$T" --every-engine-as "a Marlin engine of the same checkpoint" "$WSYNC_HF" "$W" --quant-config "$W/marlin.json"
THEN
# Each engine declares its own layout: one quant file per engine; the trainer agents get none and
# quantize as the engines declare (docs/engine-formats.md).
WSYNC_BIN="$bin" W="$w" HERE="$here" T="$here/tests/integration/e2e_tokens.sh" "$here/tools/wsync-local" --source "$w/src" \
  --quant-config "$w/sm80.json,$w/sm90.json" --hf "$w/hf" --verify --syncs 2 --delta auto \
  --between-syncs "WSYNC_BIN=$bin $here/tests/integration/train_step.sh $w/hf $w/src 2 --tp 2 --pp 1 --ep 2 --dp 2" \
  --rollout-engines 2 --engine-tp 2,1 --engine-ep 2,1 --delivery sharded \
  --bucket-mib 1 --workdir "$w/run" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "e2e_trtllm: ok"
