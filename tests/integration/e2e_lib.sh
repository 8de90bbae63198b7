# Shared scaffolding of the e2e scripts that start wsync processes themselves (sourced, not run):
#   e2e_start NAME        sets here, bin (WSYNC_BIN or build/bin), work (a fresh /tmp dir with logs/),
#                         pids (append every background pid), token (a fresh bearer token file),
#                         and an EXIT trap: TERM then KILL every pid, the optional hook
#                         e2e_cleanup_extra, the last lines of every log on failure, rm -rf work
#   fail MSG...           "NAME: MSG" on stderr, exit 1
#   members CTL...        the coordinator's member count through `CTL --json status` (0 if unreachable)
#   e2e_trainer SEED [MPIRUN FLAGS] -- [AGENT FLAGS]
#                         the default model of SEED as $work/hf, sharded TP2 x EP2 x DP2 into
#                         $work/megatron, 4 trainer agents under mpirun on it (logs/trainer.log; extra
#                         mpirun flags before --, agent flags after; --delta $WSYNC_E2E_DELTA when
#                         set), waits for the coordinator; sets coord (its address) and ctl (wsyncctl
#                         with the token)
#   e2e_fixed_port        a free port below the ephemeral range (ip_local_port_range), for a server
#                         restarted on the same port: no bind(0) or outgoing connection of another
#                         process (mpirun's own TCP ports) can take it between starts
#   e2e_start_agent I [FAILPOINTS]
#                         a rollout agent (--coordinator $coord, 300 ms heartbeats) on a new port,
#                         its address in $work/agent-I (log appended to logs/agent-I.log), armed with
#                         WSYNC_FAILPOINTS; sets agent_pid[I]
#   e2e_start_engine E [FAILPOINTS]
#                         reference engine "engine-E" (TP 1, no checkpoint: NO_WEIGHTS until its agent
#                         commits) following agent E through its address file; its address in
#                         $work/engine-E; sets engine_pid[E]
#   e2e_rank_pid R        the pid of trainer agent rank R of the running job (on $work/megatron)
#   e2e_sync_verified WHAT N
#                         a sync with N agents, retried (up to 60 times, 0.5 s apart) while a restarted
#                         member registers, then `verify --against $work/hf` bit-exact on N engine
#                         ranks; prints the published version; fails naming WHAT otherwise
# For the scripts that run `tools/wsync-local` (e2e_start not needed):
#   e2e_workdir NAME      sets bin (WSYNC_BIN or build/bin; $here set by the caller) and w (a fresh
#                         /tmp dir), removed by an EXIT trap on success and kept, named, on failure
#   e2e_int4_quant FILE   writes FILE: compressed-tensors INT4, group 64, attention, embeddings, lm_head
#                         and routers left in bf16
#   e2e_then FILE         writes FILE, a `wsync-local --then "bash FILE"` script that runs $THEN_FIRST (a
#                         script, if set), checks every engine generates as one started from the
#                         checkpoint ($THEN_AS names it), syncs with --delivery $THEN_DELIVERY, checks
#                         `wsyncctl verify` bit-exact on $RANKS engine ranks, and the tokens again.
#                         Its environment: WSYNC_BIN, T (tests/integration/e2e_tokens.sh), W (the work dir)
e2e_fixed_port() {
  python3 - <<'PY'
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(500):
    port = random.randint(10000, max(10001, low - 1))
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        print(port)
        break
    except OSError:
        continue
    finally:
        s.close()
else:
    raise SystemExit("e2e_fixed_port: no free port below " + str(low))
PY
}
e2e_start() {
  e2e_name="$1"
  here="$(cd "$(dirname "${BASH_SOURCE[1]}")/../.." && pwd)"
  bin="${WSYNC_BIN:-$here/build/bin}"
  work="$(mktemp -d "/tmp/wsync-$e2e_name.XXXXXX")"
  mkdir -p "$work/logs"
  pids=()
  agent_pid=()
  engine_pid=()
  token="$work/token"
  ( umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$token" )
  trap e2e_cleanup EXIT
  trap 'exit 130' INT TERM
}

e2e_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  if declare -F e2e_cleanup_extra >/dev/null; then e2e_cleanup_extra; fi
  if [ "$rc" != 0 ]; then
    echo "$e2e_name: FAILED (exit $rc); the logs:" >&2
    for f in "$work"/logs/*.log; do [ -f "$f" ] && { echo "---- $f" >&2; tail -n 25 "$f" >&2; }; done
  fi
  rm -rf "$work"
  exit "$rc"
}

fail() { echo "$e2e_name: $*" >&2; exit 1; }

members() {
  "$@" --json status 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["members"])' 2>/dev/null ||
    echo 0
}

e2e_trainer() {
  local seed="$1"; shift
  local -a mpi=() agent=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do mpi+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  agent=("$@")
  "$bin/wsync-model-gen" --from-config default --seed "$seed" --out "$work/hf" > /dev/null
  "$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2 > /dev/null
  mpirun --allow-run-as-root --oversubscribe -np 4 "${mpi[@]}" "$bin/wsync-trainer-agent" --source "dir:$work/megatron" \
    --coordinator 127.0.0.1:0 --address-file "$work/coordinator" --token-file "$token" --state-dir "$work/state" \
    ${WSYNC_E2E_DELTA:+--delta "$WSYNC_E2E_DELTA"} "${agent[@]}" \
    > "$work/logs/trainer.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/coordinator" ] && break; sleep 0.1; done
  [ -s "$work/coordinator" ] || fail "the coordinator did not start"
  coord=$(cat "$work/coordinator")
  ctl=("$bin/wsyncctl" --coordinator "$coord" --token-file "$token")
}

e2e_sync_verified() {
  local what="$1" n="$2" out="" v
  for _ in $(seq 60); do
    out=$("${ctl[@]}" sync --wait --min-agents "$n" 2>&1) && break
    sleep 0.5
  done
  v=$(sed -n 's/.*version \([0-9]*\) published.*/\1/p' <<<"$out" | tail -n1)
  [ -n "$v" ] || fail "$what: no sync succeeded: $out"
  "${ctl[@]}" verify --against "$work/hf" | grep -c "version $v: bit-exact" | grep -qx "$n" ||
    fail "$what: version $v is not bit-exact on all $n engine ranks"
  echo "$v"
}

e2e_start_agent() {
  rm -f "$work/agent-$1"
  WSYNC_FAILPOINTS="${2:-}" "$bin/wsync-rollout-agent" --listen 127.0.0.1:0 --coordinator "$coord" \
    --token-file "$token" --heartbeat-ms 300 --address-file "$work/agent-$1" >> "$work/logs/agent-$1.log" 2>&1 &
  agent_pid[$1]=$!
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/agent-$1" ] && return 0; sleep 0.1; done
  fail "rollout agent $1 did not start"
}

e2e_start_engine() {
  rm -f "$work/engine-$1"
  WSYNC_FAILPOINTS="${2:-}" "$bin/wsync-ref-engine" --model "$work/hf" --engine-id "engine-$1" --listen 127.0.0.1:0 \
    --address-file "$work/engine-$1" --agent-file "$work/agent-$1" --agent-poll-ms 300 --token-file "$token" \
    >> "$work/logs/engine-$1.log" 2>&1 &
  engine_pid[$1]=$!
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/engine-$1" ] && return 0; sleep 0.1; done
  fail "engine $1 did not start"
}

e2e_rank_pid() {
  local p
  for p in $(pgrep -f "wsync-trainer-agent --source dir:$work/megatron"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && { echo "$p"; return 0; }
  done
  return 1
}

e2e_int4_quant() {
  cat > "$1" <<'JSON'
{"quant_method": "compressed-tensors", "format": "pack-quantized",
 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
   "strategy": "group", "group_size": 64, "symmetric": true, "actorder": null}}},
 "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*self_attn.*", "re:.*mlp\\.gate$"]}
JSON
}

e2e_workdir() {
  e2e_name="$1"
  bin="${WSYNC_BIN:-$here/build/bin}"
  w="$(mktemp -d "/tmp/wsync-$e2e_name.XXXXXX")"
  trap 'rc=$?; if [ "$rc" = 0 ]; then rm -rf "$w"; else echo "$e2e_name: FAILED; files in $w" >&2; fi' EXIT
}

e2e_then() {
  cat > "$1" <<'THEN'
set -euo pipefail
ctl=("$WSYNC_BIN/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE")
as="${THEN_AS:-an engine started from the checkpoint}"
[ -z "${THEN_FIRST:-}" ] || bash "$THEN_FIRST"
"$T" --every-engine-as "$as" "$WSYNC_HF" "$W"
"${ctl[@]}" sync --wait --delivery "$THEN_DELIVERY" > /dev/null
"${ctl[@]}" verify --against "$WSYNC_HF" | grep -c ": bit-exact" | grep -qx "$RANKS" ||
  { echo "FAIL: the $THEN_DELIVERY sync is not bit-exact on the $RANKS engine ranks"; exit 1; }
echo "ok: a $THEN_DELIVERY sync, bit-exact on all $RANKS engine ranks (wsyncctl verify, the independent reference)"
"$T" --every-engine-as "$as" "$WSYNC_HF" "$W"
THEN
}
