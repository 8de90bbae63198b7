#!/usr/bin/env bash
# FP8 syncs end to end (docs/spec/FP8.md): Megatron shards -> trainer agents under mpirun,
# quantizing to FP8 as the engines declare it -> reference engines.
#   1. DeepSeek-V3 (MoE, MLA), block FP8 with 64 x 64 blocks (the tiny model's partitions are 64
#      rows: DeepSeek-V3's own 128 x 128 would be refused at TP 2, as the engines refuse it), cut for
#      TP 2 x EP 2 x DP 2; two engines, TP 2 x EP 2 and TP 1; two sharded syncs and a broadcast one.
#   2. Qwen3 (dense), FP8 per channel (compressed-tensors FP8_DYNAMIC), cut for TP 2 x DP 2; one
#      engine of TP 2; two broadcast syncs and a sharded one.
# Both run with --delta auto: before each run's second sync the checkpoint changes as an RL step
# changes it (train_step.sh; DeepSeek's FP8 checkpoint is written again from the new weights), and
# that sync must go as deltas (Qwen3's, broadcast, quantizing only the FP8 rows whose inputs
# changed); the one in the other delivery after it goes in full.
# Every sync is verified bit for bit by `wsyncctl verify` (the independent reference: the checkpoint
# quantized by tools/wsyncctl/reference/fp8_scalar.h, laid out from the specs), and every synced
# engine must generate exactly what an engine started from a checkpoint generates (DeepSeek: the
# FP8 one, loaded as it is; Qwen3: the bf16 one, quantized at load, engine_side/checkpoint.cc); the engines' FP8 forward itself is checked against
# the HF oracle in ref_engine_test (EngineVsHfTest fp8_*). Finally a model whose engine TP cut splits
# an FP8 block is refused before any byte moves.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
e2e_workdir e2e_fp8

cat > "$w/block.json" <<'JSON'
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
JSON
cat > "$w/channel.json" <<'JSON'
{"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
   "strategy": "channel", "symmetric": true, "dynamic": false}}}}
JSON
# DeepSeek-V3 starts from an FP8 checkpoint, as it ships: wsync-quant writes one from a random bf16
# model; wsync-shard dequantizes it into the trainer's bf16 source; the verifier's checkpoint is the
# same dequantization (wsync-quant dequantize), the checkpoint engine loads the FP8 one as it is.
"$bin/wsync-model-gen" --arch deepseek-v3 --preset tiny --seed 20261129 --out "$w/ds-bf16" > /dev/null
"$bin/wsync-quant" fp8 --hf "$w/ds-bf16" --out "$w/ds-fp8" --block 64,64 > /dev/null
"$bin/wsync-quant" dequantize --hf "$w/ds-fp8" --out "$w/ds" > /dev/null
"$bin/wsync-shard" --hf "$w/ds-fp8" --out "$w/ds-src" --tp 2 --pp 1 --ep 2 --dp 2 --verify | grep -q "bit-exact" ||
  { echo "FAIL: the source cut from the FP8 checkpoint is not its dequantization"; exit 1; }
echo "ok: a DeepSeek-V3 FP8 checkpoint (wsync-quant fp8) is a trainer source (wsync-shard dequantizes it)"
"$bin/wsync-model-gen" --arch qwen3 --preset tiny --seed 20261130 --out "$w/qw" > /dev/null
"$bin/wsync-shard" --hf "$w/qw" --out "$w/qw-src" --tp 2 --pp 1 --dp 2 > /dev/null

cat > "$w/then.sh" <<'THEN'
set -euo pipefail
ctl=("$WSYNC_BIN/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE")
grep -qF "$WANT_QUANT (--quant-config, what the engines declare)" "$WSYNC_WORKDIR/logs/trainer.log" ||
  { echo "FAIL: the trainer agents did not sync in the engines' FP8 quantization"; exit 1; }
echo "ok: the trainer agents sync in the engines' quantization: $WANT_QUANT"
delta=$("${ctl[@]}" timings | grep "^deltas from version ") ||
  { echo "FAIL: the second sync was not sent as deltas: $("${ctl[@]}" timings)"; exit 1; }
if [ -n "${WANT_REUSE:-}" ]; then  # broadcast: the stage sources quantize only the rows whose inputs changed
  grep -q "; [1-9][0-9]* of [0-9]* quantization groups not quantized again" <<<"$delta" ||
    { echo "FAIL: no FP8 row was reused: $delta"; exit 1; }
fi
echo "ok: the second sync (FP8 engines) as $delta"
"$T" --every-engine-as "an engine started from $CKPT_WHAT" "$CKPT" "$W" --quant-config "$Q"
"${ctl[@]}" sync --wait --delivery "$THEN_DELIVERY" > /dev/null
"${ctl[@]}" verify --against "$WSYNC_HF" | grep -c ": bit-exact" | grep -qx "$RANKS" ||
  { echo "FAIL: the $THEN_DELIVERY sync is not bit-exact on the $RANKS engine ranks"; exit 1; }
"${ctl[@]}" timings | grep -q "^in full" ||
  { echo "FAIL: the first $THEN_DELIVERY sync was not sent in full: $("${ctl[@]}" timings)"; exit 1; }
echo "ok: a $THEN_DELIVERY sync (in full: the first of its delivery), bit-exact on all $RANKS engine ranks (wsyncctl verify, the independent reference)"
"$T" --every-engine-as "an engine started from $CKPT_WHAT" "$CKPT" "$W" --quant-config "$Q"
THEN
T="$here/tests/integration/e2e_tokens.sh"
step="$here/tests/integration/train_step.sh"
WSYNC_BIN="$bin" W="$w" T="$T" Q="$w/block.json" THEN_DELIVERY=broadcast RANKS=3 CKPT="$w/ds-fp8" CKPT_WHAT="the FP8 checkpoint" \
  WANT_QUANT="fp8 e4m3 block 64x64, 3 ignore rules" "$here/tools/wsync-local" --source "$w/ds-src" \
  --quant-config "$w/block.json" --hf "$w/ds" --verify --syncs 2 --delta auto --between-syncs \
  "QUANT_OUT=$w/ds-fp8 QUANT_ARGS='--block 64,64' WSYNC_BIN=$bin $step $w/ds $w/ds-src 2 --tp 2 --pp 1 --ep 2 --dp 2" \
  --rollout-engines 2 --engine-tp 2,1 --engine-ep 2,1 \
  --delivery sharded --bucket-mib 1 --workdir "$w/run-ds" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "ok: DeepSeek-V3 in block FP8, sharded and broadcast"
WSYNC_BIN="$bin" W="$w" T="$T" Q="$w/channel.json" WANT_REUSE=1 THEN_DELIVERY=sharded RANKS=2 CKPT="$w/qw" CKPT_WHAT="the bf16 checkpoint" \
  WANT_QUANT="compressed-tensors float-quantized 8-bit channelwise symmetric, 1 ignore rule" "$here/tools/wsync-local" \
  --source "$w/qw-src" --quant-config "$w/channel.json" --hf "$w/qw" --verify --syncs 2 --delta auto \
  --between-syncs "WSYNC_BIN=$bin $step $w/qw $w/qw-src 2 --tp 2 --pp 1 --dp 2" --rollout-engines 1 --engine-tp 2 \
  --delivery broadcast --bucket-mib 1 --workdir "$w/run-qw" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "ok: Qwen3 in FP8 per channel, broadcast and sharded"
# 128 x 128 blocks at engine TP 2 (EP 1): the experts' I' = 128 / 2 = 64 rows split a block.
sed 's/\[64, 64\]/[128, 128]/' "$w/block.json" > "$w/block128.json"
if "$bin/wsync-ref-engine" --model "$w/ds" --checkpoint "$w/ds" --quant-config "$w/block128.json" --tp-size 2 --tp-rank 0 --tp-store 127.0.0.1:1 \
    --engine-id refused --listen 127.0.0.1:0 > "$w/refused.log" 2>&1; then
  echo "FAIL: an engine whose TP cut splits FP8 blocks started"; exit 1
fi
grep -q "is not divisible by weight quantization block_n = 128" "$w/refused.log" ||
  { echo "FAIL: the refusal does not name the block rule"; cat "$w/refused.log"; exit 1; }
echo "ok: a TP cut that splits FP8 blocks is refused: $(grep -o 'model[^;]*block_n = 128' "$w/refused.log" | head -1)"
echo "e2e_fp8: ok"
