#!/usr/bin/env bash
# End to end with live training processes (the shm: source): 4 trainer agents under
# mpirun with `--source shm:NAME`, 4 training processes (wsync-shm-trainer, under their own
# mpirun) that register their tensors through libwsync_trainer_client, and one reference engine
# of TP 2. The training processes take two steps with different weights (two generated models),
# writing them in place in shared memory, and request versions 10 and 11 themselves. After each
# sync, rank 0 checks with `wsyncctl verify` that the engine holds exactly that step's weights
# (bit-exact, INT4 experts), and that the published version is the one requested; the other
# ranks wait for the check (a barrier). Afterwards: one sync per version (the 4 requests
# coalesced), both versions recorded, and no shared memory left behind.
#
#   tests/integration/e2e_shm.sh [--cuda N] [--backend gloo|shm|cuda-ipc] [--tp1] [--dp N] [--engine-tp T]
#                                [--model default|PRESET] [--fresh-check] [--out DIR]
# --cuda N: the GPU form (run.sh of the device bundle): the training processes keep their tensors in
# CUDA memory on device N (the trainer agents read them by IPC handle) and the engine's parameters
# live there too (the rollout agents repack on the device).
# --backend shm: the colocated hand-off (trainer agents to rollout agents through shared memory);
# cuda-ipc (with --cuda): the same through a ring in one CUDA allocation, device to device, into
# device stagings, nothing recorded; with --tp1 no payload byte may cross between host and device
# (the rollout agents' "host<->device: 0 bytes down, 0 bytes up", the stage sources' "sent from the
# device").
# --tp1: the training job is TP 1 x DP 4 (no gathers) instead of TP 2 x EP 2 x DP 2; with --cuda the
# stage source then runs the device stages (CUDA INT4 kernels, buckets in device memory), checked
# in the trainer agents' log. --dp N (with --tp1): N training processes instead of 4.
# --engine-tp T: the engine's TP size (default 2; one rollout agent per rank).
# --model PRESET: the two steps are wsync-model-gen's Qwen3 of that preset in bf16 (bench8g: >= 8 GB)
# instead of the default model (INT4 experts).
# --fresh-check: after each sync, a fresh reference engine (same parameter memory) loads the step's
# checkpoint itself, and the synced engine's greedy tokens must equal its own.
# --out DIR: keeps, per version, `wsyncctl --json timings` (DIR/timings-vN.json) and the wsync
# processes' peak host memory (DIR/memory-vN.txt), and at the end the run's logs (DIR/logs).
set -euo pipefail
trainer_flags="" engine_flags=() agent_flags=() backend=gloo layout=(--tp 2 --ep 2 --dp 2) param_memory=""
model=default engine_tp=2 fresh=0 out="" dp=4
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) trainer_flags="--cuda-device $2"; param_memory="cuda:$2"; engine_flags=(--engine-flags "--param-memory cuda:$2"); shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    --tp1) layout=(--tp 1 --ep 1 --dp "$dp"); shift ;;
    --dp) dp="$2"; [ "${layout[1]}" = 1 ] || { echo "e2e_shm: --dp needs --tp1 before it" >&2; exit 2; }
          layout=(--tp 1 --ep 1 --dp "$dp"); shift 2 ;;
    --engine-tp) engine_tp="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --fresh-check) fresh=1; shift ;;
    --out) out="$2"; shift 2 ;;
    *) echo "e2e_shm: unknown argument $1" >&2; exit 2 ;;
  esac
done
world=$(( layout[1] * layout[5] ))
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="${WSYNC_BIN:-$here/build/bin}"
work="$(mktemp -d /tmp/wsync-e2e-shm.XXXXXX)"
trap 'rm -rf "$work"' EXIT
# The device ring: the rollout agents stage on the GPU, and nothing is recorded (a recording copies
# every bucket down), so that the payload can stay on the device end to end.
record=(--record-dir "$work/record")
if [ "$backend" = cuda-ipc ]; then agent_flags=(--agent-flags "--staging device"); record=(); fi
gen=(--from-config default)
[ "$model" = default ] || gen=(--arch qwen3 --preset "$model")
for step in 1 2; do
  "$bin/wsync-model-gen" "${gen[@]}" --seed $((40 + step)) --out "$work/s$step/hf" > /dev/null
  "$bin/wsync-shard" --hf "$work/s$step/hf" --out "$work/s$step/megatron" "${layout[@]}" > /dev/null
done
cat > "$work/after.sh" <<'AFTER'
#!/usr/bin/env bash
set -euo pipefail
ctl=("$WSYNC_BIN/wsyncctl" --coordinator "$(cat "$WSYNC_COORDINATOR_FILE")" --token-file "$WSYNC_TOKEN_FILE")
"${ctl[@]}" verify --against "${WSYNC_FROM%/megatron}/hf"
"${ctl[@]}" verify --independent --against "${WSYNC_FROM%/megatron}/hf"
published=$("${ctl[@]}" --json status | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])')
[ "$published" = "$WSYNC_VERSION" ] || { echo "published version $published, expected $WSYNC_VERSION" >&2; exit 1; }
echo "   version $WSYNC_VERSION verified bit-exact against ${WSYNC_FROM%/megatron}/hf"
if [ -n "$E2E_OUT" ]; then
  "${ctl[@]}" --json timings > "$E2E_OUT/timings-v$WSYNC_VERSION.json"
  for pid in $(pgrep -f "$E2E_WORK" || true); do  # this run's wsync processes: name, peak kB, pid
    name=$( (tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline" || true) | awk '{print $1}' | xargs -r basename)
    kb=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    case "$name" in wsync-*) [ -z "$kb" ] || printf "%s %s %s\n" "$name" "$kb" "$pid" ;; esac
  done > "$E2E_OUT/memory-v$WSYNC_VERSION.txt"
fi
if [ "$E2E_FRESH" = 1 ]; then  # a fresh engine loads this step itself; greedy tokens must agree
  fresh="$E2E_WORK/fresh-v$WSYNC_VERSION"
  mkdir -p "$fresh"
  "$WSYNC_BIN/wsync-ref-engine" --checkpoint "${WSYNC_FROM%/megatron}/hf" --engine-id fresh --listen 127.0.0.1:0 \
    --address-file "$fresh/address" --token-file "$WSYNC_TOKEN_FILE" ${E2E_PARAM_MEMORY:+--param-memory $E2E_PARAM_MEMORY} \
    > "$fresh/engine.log" 2>&1 &
  engine=$!
  for _ in $(seq 1200); do [ -s "$fresh/address" ] && break; kill -0 $engine 2>/dev/null || break; sleep 0.1; done
  [ -s "$fresh/address" ] || { cat "$fresh/engine.log" >&2; echo "the fresh engine did not start" >&2; exit 1; }
  want=$("$WSYNC_BIN/wsyncctl" --token-file "$WSYNC_TOKEN_FILE" generate --engine "$(cat "$fresh/address")" \
    --prompt 11,22,33,44,55 --max-new-tokens 6)
  kill $engine; wait $engine || true
  for addr in $(cat "$WSYNC_ENGINES_FILE"); do
    got=$("${ctl[@]}" generate --engine "$addr" --prompt 11,22,33,44,55 --max-new-tokens 6)
    [ "${got%%:*}" = "version $WSYNC_VERSION" ] || { echo "synced engine $addr answered '$got'" >&2; exit 1; }
    [ "${got#*: }" = "${want#*: }" ] || { echo "greedy tokens after the sync ${got#*: }, a fresh load ${want#*: }" >&2; exit 1; }
  done
  echo "   version $WSYNC_VERSION: greedy tokens ${want#*: } equal to a fresh load's"
fi
AFTER
chmod +x "$work/after.sh"
export WSYNC_BIN="$bin" E2E_OUT="$out" E2E_FRESH="$fresh" E2E_WORK="$work" E2E_PARAM_MEMORY="$param_memory"
[ -z "$out" ] || mkdir -p "$out"
before=$(ls /dev/shm | grep -c '^wsync\.' || true)
"$here/tools/wsync-local" --source "$work/s1/megatron" --rollout-engines 1 --engine-tp "$engine_tp" \
  "${record[@]}" --workdir "$work/run" \
  "${engine_flags[@]}" "${agent_flags[@]}" --backend "$backend" \
  --trainer "$bin/wsync-shm-trainer $trainer_flags --from $work/s1/megatron --from $work/s2/megatron --first-version 10 --after-sync $work/after.sh" \
  | tee "$work/out.txt"
grep -q "version 10 verified bit-exact" "$work/out.txt"
grep -q "version 11 verified bit-exact" "$work/out.txt"
for v in 10 11; do
  n=$(grep -c "version $v synced" "$work/out.txt")
  first=$(grep "version $v synced" "$work/out.txt" | grep -vc "requested by another rank first" || true)
  [ "$n" = "$world" ] || { echo "e2e_shm: $n of $world ranks saw version $v synced" >&2; exit 1; }
  [ "$first" = 1 ] || { echo "e2e_shm: version $v was started by $first ranks, want 1 (coalesced)" >&2; exit 1; }
  [ "$backend" = cuda-ipc ] || [ -d "$work/record/v$v" ] || { echo "e2e_shm: version $v was not recorded" >&2; exit 1; }
done
if [ -n "$trainer_flags" ]; then  # the GPU form really read device tensors and wrote device params
  n=$(grep -c "on CUDA devices" "$work/run/logs/trainer.log" || true)
  [ "$n" -ge "$world" ] || { echo "e2e_shm: $n of $world trainer agents registered CUDA tensors" >&2; exit 1; }
  n=$(cat "$work"/run/logs/agent-*.log | grep -c " [1-9][0-9]* on a CUDA device" || true)
  [ "$n" -ge "$engine_tp" ] || { echo "e2e_shm: $n of $engine_tp rollout agents saw engine params on a CUDA device" >&2; exit 1; }
  echo "   the training processes' tensors and the engine's parameters were on CUDA device ${trainer_flags##* }"
  if [ "${layout[1]}" = 1 ]; then
    n=$(grep -c "stage source on cuda:" "$work/run/logs/trainer.log" || true)
    [ "$n" -ge 2 ] || { echo "e2e_shm: $n of 2 syncs ran the device stages" >&2; exit 1; }
    grep "stage source on cuda:" "$work/run/logs/trainer.log" | sed 's/^/   /'
  fi
fi
if [ "$backend" = cuda-ipc ] && [ "${layout[1]}" = 1 ]; then  # no payload byte through the host
  n=$(cat "$work"/run/logs/agent-*.log | grep -c "host<->device: 0 bytes down, 0 bytes up" || true)
  [ "$n" -ge $((2 * engine_tp)) ] ||
    { echo "e2e_shm: $n of $((2 * engine_tp)) prepared syncs of the rollout agents kept the payload on the GPU" >&2; exit 1; }
  n=$(grep -c "bucket bytes, sent from the device" "$work/run/logs/trainer.log" || true)
  [ "$n" -ge 2 ] || { echo "e2e_shm: $n of 2 syncs sent their buckets from the device" >&2; exit 1; }
  echo "   no payload byte crossed between host and device (trainer and rollout agents)"
fi
[ -z "$out" ] || cp -r "$work/run/logs" "$out/"
after=$(ls /dev/shm | grep -c '^wsync\.' || true)
[ "$after" -le "$before" ] || { echo "e2e_shm: shared memory left behind: $(ls /dev/shm | grep '^wsync\.')" >&2; exit 1; }
echo "e2e_shm: ok"
