#!/usr/bin/env bash
# Syncs to AWQ engines end to end (docs/spec/AWQ.md, docs/sync.md "Engine formats"): a Qwen3-MoE
# checkpoint cut for TP 2 x EP 2 x DP 2, trainer agents under mpirun quantizing to AWQ (zero points,
# AutoAWQ's fp16 arithmetic) because the engines' quantization_config says quant_method "awq", two
# reference engines serving AWQ-Marlin (TP 2 x EP 2, and TP 1). Two sharded syncs, each verified bit
# for bit against the HF checkpoint quantized independently (wsyncctl verify), then a broadcast one,
# verified too. Then an engine started from an AWQ checkpoint that `wsync-int4 quantize --format awq`
# made of the same HF weights must generate exactly what both synced engines generate.
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

# The AWQ checkpoint an AutoAWQ-style tool would write, from the same bf16 weights.
mkdir -p "$w/ckpt"
python3 - "$w/hf/config.json" "$w/awq.json" "$w/ckpt/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["quantization_config"] = json.load(open(sys.argv[2]))
json.dump(config, open(sys.argv[3], "w"), indent=1)
PY
for f in "$w"/hf/*.safetensors; do
  "$bin/wsync-int4" quantize --format awq --group-size 32 --in "$f" --out "$w/ckpt/$(basename "$f")" \
    --ignore lm_head --ignore '.*embed_tokens.*' --ignore '.*mlp\.gate$' > /dev/null
done

cat > "$w/then.sh" <<'THEN'
set -euo pipefail
ctl=("$WSYNC_BIN/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE")
"${ctl[@]}" sync --wait --delivery broadcast > /dev/null
"${ctl[@]}" verify --against "$WSYNC_HF" --quant-config "$W/awq.json" | grep -c ": bit-exact" | grep -qx 3 ||
  { echo "FAIL: the broadcast AWQ sync is not bit-exact on the 3 engine ranks"; exit 1; }
echo "ok: a broadcast sync to the AWQ engines, bit-exact on all 3 engine ranks"
# The engines of TP 2 x EP 2 and TP 1.
"$T" --every-engine-as "an engine started from the AWQ checkpoint" "$W/ckpt" "$W"
THEN
WSYNC_BIN="$bin" W="$w" T="$here/tests/integration/e2e_tokens.sh" "$here/tools/wsync-local" --source "$w/src" --quant-config "$w/awq.json" --hf "$w/hf" \
  --verify --syncs 2 --rollout-engines 2 --engine-tp 2,1 --engine-ep 2,1 --delivery sharded --bucket-mib 1 \
  --workdir "$w/run" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "e2e_awq: ok"
