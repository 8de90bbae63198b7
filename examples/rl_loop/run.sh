#!/usr/bin/env bash
# The example RL loop (README.md beside this file): a tiny Qwen3 trained by REINFORCE with real
# megatron-core (2 training processes, TP 2, CPU) from the generations of two vLLM engines (or two
# transformers engines), a wsync sync after every optimizer step, every reply tagged with the weight
# version that produced it.
#
#   examples/rl_loop/run.sh [--steps N] [--engine vllm|transformers] [--workdir DIR]
#
# Needs a built checkout with its Python environments (tools/setup.sh --torch): build/venv-torch, with
# megatron-core for the trainers, transformers and vLLM for the engines ($WSYNC_MEGATRON_PYTHON and
# $WSYNC_VLLM_PYTHON override it for each side).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
export WSYNC_BIN="${WSYNC_BIN:-$root/build/bin}"
train_py="${WSYNC_MEGATRON_PYTHON:-$root/build/venv-torch/bin/python}"
steps=5 engine=vllm work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    --workdir) work="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
case "$engine" in
  vllm) engine_py="${WSYNC_VLLM_PYTHON:-$root/build/venv-torch/bin/python}" ;;
  transformers) engine_py="$train_py" ;;
  *) echo "run.sh: --engine vllm|transformers" >&2; exit 2 ;;
esac
for py in "$train_py" "$engine_py"; do
  [ -x "$py" ] || { echo "run.sh: $py not found (run tools/setup.sh --torch)" >&2; exit 2; }
done
work="${work:-$(mktemp -d /tmp/wsync-rl.XXXXXX)}"
mkdir -p "$work"
rm -rf "$work/hf" "$work/init"
"$WSYNC_BIN/wsync-model-gen" --arch qwen3 --preset tiny --seed 7 --out "$work/hf" > /dev/null
"$WSYNC_BIN/wsync-shard" --hf "$work/hf" --out "$work/init" --tp 2 > /dev/null
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec "$root/tools/wsync-local" --source "$work/init" --rollout-engines 2 --workdir "$work/run" \
  --engine-cmd "$engine_py -m wsync --adapter $engine" \
  --trainer "$train_py $here/train.py --init $work/init --tp 2 --steps $steps --port $port"
