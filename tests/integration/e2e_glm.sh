#!/usr/bin/env bash
# GLM-4.5 (Glm4MoeForCausalLM) end to end: q/k/v bias without an o_proj bias, QK norm, RoPE on half
# of each head, a dense first layer, DeepSeek-V3's MoE routing with the correction bias and a shared
# expert (MEGATRON_TO_HF.md §5.6, ENGINE_LAYOUT.md §2.7).
#   1. The reference engine's GLM-4.5 forward against transformers' own (Glm4MoeForCausalLM,
#      tests/python/hf_oracle.py, no wsync code) on the bf16 checkpoint, both computing in float32:
#      the same greedy tokens (in bf16 transformers' rounding alone changes them on this random
#      model). Skipped, saying so, where build/venv-torch (transformers) is absent.
#   2. An INT4 checkpoint (experts and dense MLPs in INT4) cut for TP 2 x EP 2 x PP 2 x VPP 2 (expert
#      TP 1); trainer agents under mpirun, two engines (TP 2 x EP 2 and TP 1); two sharded syncs and a
#      broadcast one, each bit-exact under `wsyncctl verify` (the independent reference), the synced
#      engines generating as an engine started from the checkpoint.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/tests/integration/e2e_lib.sh"
e2e_workdir e2e_glm

e2e_int4_quant "$w/quant.json"
"$bin/wsync-model-gen" --arch glm4-moe --preset tiny --layers 4 --seed 20261203 --out "$w/bf16" > /dev/null
"$bin/wsync-model-gen" --arch glm4-moe --preset tiny --layers 4 --seed 20261203 --out "$w/glm" \
  --quant-config "$w/quant.json" > /dev/null
"$bin/wsync-shard" --hf "$w/glm" --out "$w/src" --tp 2 --pp 2 --vpp 2 --ep 2 --etp 1 --dp 1 --verify |
  grep -q "bit-exact" || { echo "FAIL: the TP 2 x PP 2 x VPP 2 x EP 2 cut is not the checkpoint"; exit 1; }
echo "ok: GLM-4.5 cut for TP 2 x PP 2 x VPP 2 x EP 2 (wsync-shard --verify)"

cat > "$w/first.sh" <<'FIRST'
set -euo pipefail
py="$HERE/build/venv-torch/bin/python"
if [ -x "$py" ] && "$py" -c "import transformers.models.glm4_moe" 2> /dev/null; then
  mine=$("$T" --checkpoint "$W/bf16" "$W" --quant-config none)
  theirs=$("$py" "$HERE/tests/python/hf_oracle.py" --hf "$W/bf16" --float32 --prompt 3,14,15,92 --max-new-tokens 8 |
    python3 -c 'import json,sys; print([json.loads(l) for l in sys.stdin if l.startswith("{")][-1]["tokens"])')
  echo "reference engine: $mine; transformers Glm4MoeForCausalLM: $theirs"
  [ "$mine" = "$theirs" ] || { echo "FAIL: the reference engine's GLM-4.5 forward is not transformers'"; exit 1; }
  echo "ok: the reference engine generates as transformers' Glm4MoeForCausalLM on the bf16 checkpoint"
else
  echo "skipped: no transformers with Glm4MoeForCausalLM (build/venv-torch): the reference engine is not compared with it"
fi
FIRST
e2e_then "$w/then.sh"
WSYNC_BIN="$bin" W="$w" HERE="$here" T="$here/tests/integration/e2e_tokens.sh" THEN_FIRST="$w/first.sh" \
  THEN_DELIVERY=broadcast RANKS=3 "$here/tools/wsync-local" \
  --source "$w/src" --hf "$w/glm" --verify --syncs 2 --rollout-engines 2 --engine-tp 2,1 --engine-ep 2,1 \
  --delivery sharded --bucket-mib 1 --workdir "$w/run" --prompt 3,14,15,92 --max-new-tokens 8 --then "bash $w/then.sh"
echo "e2e_glm: ok"
