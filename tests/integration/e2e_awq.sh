#!/usr/bin/env bash
# Syncs to AWQ engines end to end (docs/spec/AWQ.md, docs/sync.md "Engine formats"): a Qwen3-MoE
# checkpoint cut for TP 2 x EP 2 x DP 2, trainer agents under mpirun quantizing to AWQ (zero points,
# AutoAWQ's fp16 arithmetic) because the engines' quantization_config says quant_method "awq", two
# reference engines serving AWQ-Marlin (TP 2 x EP 2, and TP 1), with --delta auto: before each
# sync after the first the checkpoint changes as an RL step changes it (train_step.sh). Two sharded
# syncs (in full, then as deltas), then two broadcast ones (in full, the first of its delivery; then
# as deltas, the stage sources quantizing only the 8 rows' groups whose inputs changed), each
# verified bit for bit against the HF checkpoint quantized independently (wsyncctl verify). Then an
# engine started from an AWQ checkpoint that `wsync-int4 quantize --format awq` made of the same HF
# weights must generate exactly what both synced engines generate.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
e2e_workdir e2e_awq

# transformers' AwqConfig spelling; lm_head, embeddings and the routers are never AWQ (config.h).
cat > "$w/awq.json" <<'JSON'
{"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": true, "version": "gemm",
 "modules_to_not_convert": null}
JSON
"$bin/wsync-model-gen" --arch qwen3-moe --preset tiny --seed 20261126 --out "$w/hf" > /dev/null
"$bin/wsync-shard" --hf "$w/hf" --out "$w/src" --tp 2 --pp 1 --ep 2 --dp 2 > /dev/null

# The AWQ checkpoint an AutoAWQ-style tool would write, from the same bf16 weights (again after
# the last training step, for the generation check).
cat > "$w/ckpt.sh" <<'CKPT'
set -euo pipefail
mkdir -p "$W/ckpt"
python3 - "$W/hf/config.json" "$W/awq.json" "$W/ckpt/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["quantization_config"] = json.load(open(sys.argv[2]))
json.dump(config, open(sys.argv[3], "w"), indent=1)
PY
for f in "$W"/hf/*.safetensors; do
  "$WSYNC_BIN/wsync-int4" quantize --format awq --group-size 32 --in "$f" --out "$W/ckpt/$(basename "$f")" \
    --ignore lm_head --ignore '.*embed_tokens.*' --ignore '.*mlp\.gate$' > /dev/null
done
CKPT

cat > "$w/then.sh" <<'THEN'
set -euo pipefail
ctl=("$WSYNC_BIN/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE")
delta=$("${ctl[@]}" timings | grep "^deltas from version ") ||
  { echo "FAIL: the second sharded sync was not sent as deltas: $("${ctl[@]}" timings)"; exit 1; }
echo "ok: the second sharded sync to the AWQ engines as $delta"
for kind in "in full" "deltas from version"; do
  [ "$kind" = "in full" ] || "$HERE/tests/integration/train_step.sh" "$WSYNC_HF" "$W/src" 3 --tp 2 --pp 1 --ep 2 --dp 2
  "${ctl[@]}" sync --wait --delivery broadcast > /dev/null
  "${ctl[@]}" verify --against "$WSYNC_HF" --quant-config "$W/awq.json" | grep -c ": bit-exact" | grep -qx 3 ||
    { echo "FAIL: the broadcast AWQ sync is not bit-exact on the 3 engine ranks"; exit 1; }
  line=$("${ctl[@]}" timings | grep "^$kind") ||
    { echo "FAIL: the broadcast sync was not sent $kind: $("${ctl[@]}" timings)"; exit 1; }
  if [ "$kind" != "in full" ]; then
    grep -q "; [1-9][0-9]* of [0-9]* quantization groups not quantized again" <<<"$line" ||
      { echo "FAIL: no AWQ group was reused: $line"; exit 1; }
  fi
  echo "ok: a broadcast sync to the AWQ engines, bit-exact on all 3 engine ranks: $line"
done
# The engines of TP 2 x EP 2 and TP 1, against the checkpoint of the last step's weights.
bash "$W/ckpt.sh"
"$T" --every-engine-as "an engine started from the AWQ checkpoint" "$W/ckpt" "$W"
THEN
WSYNC_BIN="$bin" W="$w" bash "$w/ckpt.sh"
WSYNC_BIN="$bin" W="$w" HERE="$here" T="$here/tests/integration/e2e_tokens.sh" "$here/tools/wsync-local" --source "$w/src" \
  --quant-config "$w/awq.json" --hf "$w/hf" --verify --syncs 2 --delta auto \
  --between-syncs "WSYNC_BIN=$bin $here/tests/integration/train_step.sh $w/hf $w/src 2 --tp 2 --pp 1 --ep 2 --dp 2" \
  --rollout-engines 2 --engine-tp 2,1 --engine-ep 2,1 --delivery sharded --bucket-mib 1 \
  --workdir "$w/run" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "e2e_awq: ok"
