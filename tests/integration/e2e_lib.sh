# Shared scaffolding of the e2e scripts that start wsync processes themselves (sourced, not run):
#   e2e_start NAME        sets here, bin (WSYNC_BIN or build/bin), work (a fresh /tmp dir with logs/),
#                         pids (append every background pid), token (a fresh bearer token file),
#                         and an EXIT trap: TERM then KILL every pid, the optional hook
#                         e2e_cleanup_extra, the last lines of every log on failure, rm -rf work
#   fail MSG...           "NAME: MSG" on stderr, exit 1
#   members CTL...        the coordinator's member count through `CTL --json status` (0 if unreachable)
e2e_start() {
  e2e_name="$1"
  here="$(cd "$(dirname "${BASH_SOURCE[1]}")/../.." && pwd)"
  bin="${WSYNC_BIN:-$here/build/bin}"
  work="$(mktemp -d "/tmp/wsync-$e2e_name.XXXXXX")"
  mkdir -p "$work/logs"
  pids=()
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
