#!/usr/bin/env bash
# The demo's and the soak's checks can fail: each run here breaks one premise and must FAIL, saying why.
#   1. tools/demo.sh --break verify: `wsyncctl verify` against a checkpoint the engines do not hold ->
#      the demo exits non-zero, the verify naming the params that differ;
#   2. tools/demo.sh --break generate: requests the engines refuse (a token id out of the vocabulary)
#      -> the demo exits non-zero, naming the failed requests;
#   3. `wsyncctl verify --independent` (the reference decoder) against a checkpoint the engines do
#      not hold, after a demo sync -> it exits non-zero naming the params that differ;
#   4. tools/soak.sh --self-test same-weights: the weights left unchanged before a verified sync ->
#      the soak says FAILED, naming the verify.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$(mktemp -d /tmp/wsync-checks-fail.XXXXXX)"
trap 'rm -rf "$out"' EXIT
fail() { echo "e2e_checks_fail: $*" >&2; exit 1; }
expect_failure() {  # expect_failure NAME PATTERN CMD...: CMD must exit non-zero and print PATTERN
  local name="$1" pattern="$2" rc=0
  shift 2
  "$@" > "$out/$name.log" 2>&1 || rc=$?
  [ "$rc" != 0 ] || { tail -n 30 "$out/$name.log" >&2; fail "$name: exit 0 although its premise was broken"; }
  grep -q -- "$pattern" "$out/$name.log" || { tail -n 30 "$out/$name.log" >&2; fail "$name: exit $rc without '$pattern'"; }
  echo "e2e_checks_fail: $name failed as it must (exit $rc): $(grep -m1 -- "$pattern" "$out/$name.log" | cut -c1-160)"
}
expect_failure demo-verify "differ" "$here/tools/demo.sh" --syncs 1 --break verify
expect_failure demo-generate "generation request" "$here/tools/demo.sh" --syncs 1 --break generate
# The independent verify (wsyncctl verify --independent) against a checkpoint the engines do not hold.
expect_failure independent-verify "independent: DIFFERS" "$here/tools/demo.sh" --syncs 1 --then \
  "${WSYNC_BIN:-$here/build/bin}/wsyncctl --coordinator \$WSYNC_COORDINATOR --token-file \$WSYNC_TOKEN_FILE verify \
   --independent --against \$(dirname \$WSYNC_WORKDIR)/engine-start"
expect_failure soak-same-weights "verify against checkpoint" "$here/tools/soak.sh" --syncs 2 --warm 1 --verify-every 2 \
  --self-test same-weights
echo "e2e_checks_fail: ok"
