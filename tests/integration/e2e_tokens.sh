#!/usr/bin/env bash
# Greedy tokens of a reference engine, for the e2e scripts' generation checks (run from a
# `wsync-local --then` script: WSYNC_BIN, WSYNC_COORDINATOR, WSYNC_TOKEN_FILE and WSYNC_ENGINES are set).
#   e2e_tokens.sh ADDRESS                         the engine at ADDRESS
#   e2e_tokens.sh --checkpoint DIR WORK [FLAGS]   an engine started from the HF checkpoint DIR
#                                                 (wsync-ref-engine --model DIR --checkpoint DIR FLAGS,
#                                                 its address file and log in WORK), stopped after
#   e2e_tokens.sh --every-engine-as WHAT DIR WORK [FLAGS]
#                                                 every engine of WSYNC_ENGINES against such a checkpoint
#                                                 engine (WHAT names it): prints each one's tokens, then
#                                                 "ok: ..." or "FAIL: ..." (exit 1) when one differs
# Tokens are those of prompt 3,14,15,92 with 8 new tokens, as a Python list.
set -euo pipefail
tokens() {
  "$WSYNC_BIN/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE" --json generate \
    --engine "$1" --prompt 3,14,15,92 --max-new-tokens 8 | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])'
}
checkpoint_tokens() {  # DIR WORK [FLAGS]
  local dir="$1" work="$2" pid
  shift 2
  rm -f "$work/ckpt-engine"
  "$WSYNC_BIN/wsync-ref-engine" --model "$dir" --checkpoint "$dir" --engine-id from-checkpoint --listen 127.0.0.1:0 \
    --address-file "$work/ckpt-engine" --token-file "$WSYNC_TOKEN_FILE" "$@" > "$work/ckpt-engine.log" 2>&1 &
  pid=$!
  # The pid now, not when the trap runs (pid is local): a failure on the way still stops the engine.
  # shellcheck disable=SC2064
  trap "kill $pid 2>/dev/null || true" EXIT
  for _ in $(seq 300); do [ -s "$work/ckpt-engine" ] && break; sleep 0.1; done
  [ -s "$work/ckpt-engine" ] || { echo "e2e_tokens: the checkpoint engine did not start (see $work/ckpt-engine.log)" >&2; exit 1; }
  tokens "$(cat "$work/ckpt-engine")"
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  trap - EXIT
}
case "${1:-}" in
  --checkpoint)
    shift
    checkpoint_tokens "$@"
    ;;
  --every-engine-as)
    what="$2"
    shift 2
    want=$(checkpoint_tokens "$@")
    echo "$what: $want"
    read -r -a engines <<< "$WSYNC_ENGINES"
    same=1
    for e in "${engines[@]}"; do
      got=$(tokens "$e")
      echo "synced engine $e: $got"
      [ "$got" = "$want" ] || same=0
    done
    ((same)) || { echo "FAIL: a synced engine generates differently from $what"; exit 1; }
    echo "ok: every synced engine (${#engines[@]}) generates as $what"
    ;;
  *) tokens "$1" ;;
esac
