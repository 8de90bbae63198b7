#!/usr/bin/env bash
# A bucket damaged on the wire: 4 trainer agents under mpirun with the failpoint bucket.corrupt
# armed for their first bucket (common/failpoint.h: the stage source flips one bit of the bucket's
# data after hashing it, as a bad link would), two reference engines (TP 1) serving a starting
# checkpoint (version 0) with their rollout agents. Sync 1 must fail within its timeout with
# DATA_LOSS naming the bucket's checksum and an engine; both engines keep serving version 0, bit-exact
# with the starting checkpoint (nothing of the damaged sync reached them). Sync 2 (the failpoint has
# fired) succeeds, bit-exact with the trainer's checkpoint on both engines.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"
e2e_start e2e_corrupt
timeout_s=20
"$bin/wsync-model-gen" --from-config default --seed 1 --out "$work/start" > /dev/null
e2e_trainer 2 -x WSYNC_FAILPOINTS=bucket.corrupt:1 -- --sync-timeout "$timeout_s" --bucket-mib 64
for e in 0 1; do
  "$bin/wsync-rollout-agent" --listen 127.0.0.1:0 --coordinator "$coord" --token-file "$token" \
    --heartbeat-ms 300 --address-file "$work/agent-$e" > "$work/logs/agent-$e.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/agent-$e" ] && break; sleep 0.1; done
  "$bin/wsync-ref-engine" --checkpoint "$work/start" --engine-id "engine-$e" --listen 127.0.0.1:0 \
    --address-file "$work/engine-$e" --agent-file "$work/agent-$e" --token-file "$token" \
    > "$work/logs/engine-$e.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 300); do [ -s "$work/engine-1" ] && [ "$(members "${ctl[@]}")" -ge 2 ] && break; sleep 0.1; done
[ "$(members "${ctl[@]}")" -ge 2 ] || fail "the rollout agents did not join"

rc=0
t0=$(date +%s)
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || rc=$?
took=$(( $(date +%s) - t0 ))
[ "$rc" != 0 ] || fail "the sync with a damaged bucket succeeded: $out"
[ "$took" -le $((timeout_s + 10)) ] || fail "the sync with a damaged bucket took $took s (timeout $timeout_s s)"
grep -q "checksum mismatch" <<<"$out" || fail "the failure does not name the checksum: $out"
grep -q "engine-[01]" <<<"$out" || fail "the failure does not name an engine: $out"
grep -q "failpoint bucket.corrupt fires (hit 1)" "$work/logs/trainer.log" || fail "the failpoint did not fire"
echo "e2e_corrupt: the sync with a damaged bucket failed in $took s:"
echo "   $(grep FAILED <<<"$out" | head -n1 | cut -c1-240)"
v=$("${ctl[@]}" verify --against "$work/start" 2>&1) || fail "the engines changed after the damaged sync: $v"
[ "$(grep -c "version 0: bit-exact" <<<"$v")" = 2 ] || fail "the engines are not on version 0, bit-exact: $v"
for e in 0 1; do
  gen=$("${ctl[@]}" generate --engine "$(cat "$work/engine-$e")" --prompt 1,2,3 --max-new-tokens 2 2>&1) ||
    fail "engine $e does not serve after the damaged sync: $gen"
  grep -q "^version 0:" <<<"$gen" || fail "engine $e serves another version: $gen"
done
echo "e2e_corrupt: both engines serve version 0, bit-exact with the starting checkpoint"
out=$("${ctl[@]}" sync --wait --min-agents 2 2>&1) || fail "the next sync failed: $out"
v=$("${ctl[@]}" verify --against "$work/hf" 2>&1) || fail "verify after the next sync: $v"
[ "$(grep -c ": bit-exact" <<<"$v")" = 2 ] || fail "the next sync is not bit-exact on both engines: $v"
echo "e2e_corrupt: the next sync published $(sed -n 's/.*\(version [0-9]*\) published.*/\1/p' <<<"$out" | tail -n1), bit-exact on both engines"
echo "e2e_corrupt: ok"
