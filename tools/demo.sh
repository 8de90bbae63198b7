#!/usr/bin/env bash
# The local sync demo (`./wsync demo`): the embedded default model (a Qwen3-MoE-style config with
# INT4 experts, src/common/default_model.h) with random weights, sharded for Megatron TP2 x EP2
# (4 trainer ranks), two reference engines of TP 2 serving it, and SYNCS syncs. Before every sync
# after the first, the "trainer" takes a step: new weights (another seed) are re-sharded into the
# source directory in place. Each sync is verified bit-exact on every engine rank, and each
# engine's greedy output is shown before and after, with the weight version that produced it.
# Exit status 0 only when every sync was done on every engine, every verify was bit-exact, every
# generation request succeeded and named the version just published (tools/wsync-local).
#
#   tools/demo.sh [--syncs N] [--keep] [wsync-local flags, e.g. --then CMD]   (WSYNC_BIN overrides build/bin)
#   tools/demo.sh --break verify|generate   the self-test: the demo must FAIL (exit non-zero): verify
#                  against a checkpoint the engines do not hold, or requests with a token id out of the
#                  vocabulary (the engines refuse them)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${WSYNC_BIN:-$here/build/bin}"
syncs=3 keep=() extra=() break_=""
while [ $# -gt 0 ]; do
  case "$1" in
    --syncs) syncs="$2"; shift 2 ;;
    --keep) keep=(--keep); shift ;;
    --break) break_="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) extra+=("$1"); shift ;;   # passed on to tools/wsync-local (e.g. --then CMD)
  esac
done
case "$break_" in ""|verify|generate) ;; *) echo "demo: --break verify|generate (not '$break_')" >&2; exit 2 ;; esac
work="$(mktemp -d /tmp/wsync-demo.XXXXXX)"
echo "== demo workspace: $work"
# The workspace (models, shards, recordings: a few hundred MB) goes when the demo ends, also on
# failure or Ctrl-C, unless --keep.
cleanup() { if [ ${#keep[@]} -gt 0 ]; then echo "== kept: $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
gen() {  # gen SEED DIR: the default model with seed SEED, as HF checkpoint DIR
  "$bin/wsync-model-gen" --from-config default --seed "$1" --out "$2" >/dev/null
}
gen 1 "$work/engine-start"                      # what the engines serve at start (version 0)
gen 2 "$work/hf"                                 # the trainer's weights for sync 1
"$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2
echo 2 > "$work/seed"
cat > "$work/train-step.sh" <<STEP
#!/usr/bin/env bash
# One "training step": new weights, re-sharded over the source directory (files renamed into place).
set -euo pipefail
seed=\$(( \$(cat "$work/seed") + 1 )); echo \$seed > "$work/seed"
rm -rf "$work/hf.next" "$work/megatron.next"
"$bin/wsync-model-gen" --from-config default --seed \$seed --out "$work/hf.next" >/dev/null
"$bin/wsync-shard" --hf "$work/hf.next" --out "$work/megatron.next" --tp 2 --ep 2 --dp 2 >/dev/null
for f in "$work/megatron.next"/rank-*.safetensors; do mv "\$f" "$work/megatron/\$(basename "\$f")"; done
rm -rf "$work/hf" && mv "$work/hf.next" "$work/hf"
echo "   trainer step: weights of seed \$seed"
STEP
chmod +x "$work/train-step.sh"
verify_against="$work/hf" prompt=11,22,33,44,55
if [ "$break_" = verify ]; then verify_against="$work/engine-start"; echo "== self-test: verify against a checkpoint the engines do not hold"; fi
if [ "$break_" = generate ]; then prompt=11,22,99999999; echo "== self-test: requests with a token id out of the vocabulary"; fi
"$here/tools/wsync-local" --source "$work/megatron" --rollout-engines 2 --engine-tp 2 --syncs "$syncs" \
  --engine-checkpoint "$work/engine-start" --between-syncs "$work/train-step.sh" --hf "$verify_against" --verify \
  --prompt "$prompt" --max-new-tokens 8 --load --record-dir "$work/record" --workdir "$work/run" "${keep[@]}" "${extra[@]}"
