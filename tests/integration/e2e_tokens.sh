#!/usr/bin/env bash
# Greedy tokens of a reference engine, for the e2e scripts' generation checks (run from a
# `wsync-local --then` script: WSYNC_BIN, WSYNC_COORDINATOR and WSYNC_TOKEN_FILE are set).
#   e2e_tokens.sh ADDRESS                         the engine at ADDRESS
#   e2e_tokens.sh --checkpoint DIR WORK [FLAGS]   an engine started from the HF checkpoint DIR
#                                                 (wsync-ref-engine --model DIR --checkpoint DIR FLAGS,
#                                                 its address file and log in WORK), stopped after
# Prints the tokens of prompt 3,14,15,92 with 8 new tokens, as a Python list.
set -euo pipefail
tokens() {
  "$WSYNC_BIN/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE" --json generate \
    --engine "$1" --prompt 3,14,15,92 --max-new-tokens 8 | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])'
}
if [ "${1:-}" != --checkpoint ]; then
  tokens "$1"
  exit 0
fi
dir="$2" work="$3"
shift 3
rm -f "$work/ckpt-engine"
"$WSYNC_BIN/wsync-ref-engine" --model "$dir" --checkpoint "$dir" --engine-id from-checkpoint --listen 127.0.0.1:0 \
  --address-file "$work/ckpt-engine" --token-file "$WSYNC_TOKEN_FILE" "$@" > "$work/ckpt-engine.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do [ -s "$work/ckpt-engine" ] && break; sleep 0.1; done
[ -s "$work/ckpt-engine" ] || { echo "e2e_tokens: the checkpoint engine did not start (see $work/ckpt-engine.log)" >&2; exit 1; }
tokens "$(cat "$work/ckpt-engine")"
