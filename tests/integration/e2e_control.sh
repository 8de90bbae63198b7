#!/usr/bin/env bash
# Control-plane checks on a live local deployment, run by the e2e test through
# `tools/demo.sh --then` (which exports WSYNC_COORDINATOR, WSYNC_TOKEN_FILE, WSYNC_ENGINES, WSYNC_HF):
#   1. a wrong or missing token is refused (exit 4) and changes nothing;
#   2. a second trigger while a sync runs is refused (exit 5); with --wait-if-busy it queues;
#   3. engines keep serving, and every engine rank is still bit-exact with the trainer's weights.
set -euo pipefail
bin="${WSYNC_BIN:-$(cd "$(dirname "$0")/../.." && pwd)/build/bin}"
ctl=("$bin/wsyncctl" --coordinator "$WSYNC_COORDINATOR")
good=(--token-file "$WSYNC_TOKEN_FILE")
count_versions() { "${ctl[@]}" "${good[@]}" --json versions | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))'; }
expect_rc() {  # expect_rc CODE WHAT CMD...
  local want="$1" what="$2"; shift 2
  set +e; "$@" >/tmp/e2e-out.$$ 2>&1; local rc=$?; set -e
  if [ "$rc" != "$want" ]; then echo "FAIL: $what: exit $rc, expected $want"; cat /tmp/e2e-out.$$; exit 1; fi
  echo "ok: $what (exit $rc)"
}

before=$(count_versions)
wrong=$(mktemp); echo "not-the-token" > "$wrong"
expect_rc 4 "a wrong token is refused" "${ctl[@]}" --token-file "$wrong" sync
( unset WSYNC_TOKEN; expect_rc 4 "a missing token is refused" env -u WSYNC_TOKEN "${ctl[@]}" sync )
rm -f "$wrong"
[ "$(count_versions)" = "$before" ] || { echo "FAIL: a refused trigger changed the versions"; exit 1; }
echo "ok: refused triggers changed nothing ($before versions)"

# A trigger while a sync runs: refused, unless it may wait.
busy=0
for attempt in 1 2 3 4 5; do
  "${ctl[@]}" "${good[@]}" sync >/dev/null
  set +e; "${ctl[@]}" "${good[@]}" sync >/tmp/e2e-out.$$ 2>&1; rc=$?; set -e
  if [ "$rc" = 5 ]; then busy=1; break; fi
  [ "$rc" = 0 ] || { echo "FAIL: second trigger exit $rc"; cat /tmp/e2e-out.$$; exit 1; }
done
[ "$busy" = 1 ] || { echo "FAIL: a trigger during a sync was never refused as busy"; exit 1; }
echo "ok: a trigger during a sync is refused as busy (exit 5)"
"${ctl[@]}" "${good[@]}" sync --wait --wait-if-busy >/dev/null &
w1=$!
"${ctl[@]}" "${good[@]}" sync --wait --wait-if-busy >/dev/null
wait "$w1"
echo "ok: two --wait-if-busy triggers queued and both succeeded"

for e in $WSYNC_ENGINES; do
  "${ctl[@]}" "${good[@]}" generate --engine "$e" --prompt 5,6,7 --max-new-tokens 4 >/dev/null
done
echo "ok: engines serve after the syncs"
"${ctl[@]}" "${good[@]}" verify --against "$WSYNC_HF"
"${ctl[@]}" "${good[@]}" status
rm -f /tmp/e2e-out.$$
