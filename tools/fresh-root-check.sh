#!/usr/bin/env bash
# Checks that a clone of this repository's committed HEAD sets itself up and runs on a fresh, minimal
# Debian 12 root: debootstraps `--variant=minbase bookworm` (plus git) into a directory, bind-mounts the
# host's CUDA toolkit read-only at /usr/local/cuda when the host has one, clones HEAD to /root/wsync in
# the root and runs the README's two commands there in a chroot: `./wsync demo`, then `./wsync test`.
# Uncommitted changes are not part of the check. Mounts are undone on every exit; the root is removed
# unless --keep. Needs root, network access to the Debian mirror, and debootstrap (installed if missing).
#
#   tools/fresh-root-check.sh                    # both commands, in /tmp/wsync-fresh-root, removed after
#   tools/fresh-root-check.sh --only test        # only `./wsync test` (or --only demo)
#   tools/fresh-root-check.sh --configure-only   # only `tools/setup.sh --deps-only` and the CMake configure
#   tools/fresh-root-check.sh --root DIR --keep  # root in DIR (must not exist yet), kept afterwards
#
# Options: --mirror URL (default: the host apt's Debian mirror), --no-cuda (no toolkit in the root).
# Exit status: 0 when every command that ran succeeded.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root=/tmp/wsync-fresh-root
only=""
keep=0
configure_only=0
mirror=""
cuda_dir=/usr/local/cuda

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
die() { echo "fresh-root-check: $*" >&2; exit 2; }

while (($#)); do
  case "$1" in
    --root) [ $# -ge 2 ] || die "--root needs a directory"; root="$2"; shift ;;
    --root=*) root="${1#*=}" ;;
    --only) [ $# -ge 2 ] || die "--only needs demo or test"; only="$2"; shift ;;
    --only=*) only="${1#*=}" ;;
    --keep) keep=1 ;;
    --configure-only) configure_only=1 ;;
    --mirror) [ $# -ge 2 ] || die "--mirror needs a URL"; mirror="$2"; shift ;;
    --mirror=*) mirror="${1#*=}" ;;
    --no-cuda) cuda_dir="" ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
case "$only" in ""|demo|test) ;; *) die "--only takes demo or test, not '$only'" ;; esac
if ((configure_only)) && [ -n "$only" ]; then die "--configure-only and --only exclude each other"; fi
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, mount, chroot)"
command -v git >/dev/null || die "needs git on the host to clone the repository"
[ -n "$root" ] || die "--root needs a directory"
root="$(realpath -m "$root")"
if [ "$root" = / ]; then die "--root must name a directory other than /"; fi
if [ -e "$root" ]; then die "$root already exists: remove it or choose another --root"; fi

log() { echo "=== [fresh-root-check] $*"; }

# The Debian mirror the host's apt uses (deb822 .sources or one-line sources.list), unless --mirror.
if [ -z "$mirror" ]; then
  mirror="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
              awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' | grep -E '/debian/?$' | head -n1 || true)"
fi
if [ -z "$mirror" ]; then
  mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
              awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }' |
              grep -E '/debian/?$' | head -n1 || true)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap on the host"
  apt-get install -y -qq debootstrap >/dev/null
fi

# --- cleanup: runs on every exit, success or not ---------------------------------------------------
mounts=()        # mount points made by this script, in the order they were made
created_root=0
bootstrap_log="$(mktemp /tmp/fresh-root-check.debootstrap.XXXXXX)"

mounted_under_root() { awk -v r="$root" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo; }

cleanup() {
  local rc=$? pid m i killed=0
  trap - EXIT INT TERM
  set +e
  # Processes still running inside the root (left by a failed or interrupted run) keep its mounts
  # busy: end them, by id.
  for pid in /proc/[0-9]*; do
    pid="${pid#/proc/}"
    if [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$root" ]; then
      kill -KILL "$pid" 2>/dev/null && killed=1
    fi
  done
  ((killed)) && sleep 1
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    m="${mounts[i]}"
    umount -R "$m" 2>/dev/null || umount -R -l "$m" 2>/dev/null || echo "fresh-root-check: could not unmount $m" >&2
  done
  # Whatever else is mounted in the root (a debootstrap that failed midway leaves its own), deepest first.
  for m in $(mounted_under_root | sort -r); do
    umount -l "$m" 2>/dev/null
  done
  if [ -n "$(mounted_under_root)" ]; then
    echo "fresh-root-check: still mounted under $root, so it is left in place:" >&2
    mounted_under_root >&2
    rc=1
  elif ((created_root)) && ((keep)); then
    log "root kept in $root (chroot $root /bin/bash; mounts are undone)"
  elif ((created_root)); then
    rm -rf --one-file-system "$root"
  fi
  rm -f "$bootstrap_log"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the root ---------------------------------------------------------------------------------------
start=$(date +%s)
log "debootstrap --variant=minbase bookworm $root $mirror"
mkdir -p "$root"
created_root=1
if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$bootstrap_log" 2>&1; then
  tail -n 30 "$bootstrap_log" >&2
  die "debootstrap failed"
fi

mount_at() {  # mount_at TARGET MOUNT-ARGS...: mount, remembering TARGET for the cleanup
  local target="$1"; shift
  mkdir -p "$target"
  mount "$@" "$target"
  mounts+=("$target")
}
mount_at "$root/proc" -t proc proc
mount_at "$root/sys" --rbind /sys
mount --make-rslave "$root/sys"
mount_at "$root/dev" --rbind /dev
mount --make-rslave "$root/dev"
if [ -n "$cuda_dir" ] && [ -d "$cuda_dir" ]; then
  mount_at "$root/usr/local/cuda" --bind "$(realpath "$cuda_dir")"
  mount -o remount,bind,ro "$root/usr/local/cuda"
  log "CUDA toolkit: $(realpath "$cuda_dir") read-only at /usr/local/cuda"
else
  log "no CUDA toolkit in the root"
fi

in_root() {  # in_root COMMAND: runs COMMAND with bash inside the root, in a clean environment
  chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" DEBIAN_FRONTEND=noninteractive /bin/bash -c "$1"
}

log "apt-get install git (in the root)"
in_root 'apt-get update -qq && apt-get install -y -qq git >/dev/null'

head_commit="$(git -C "$repo" rev-parse HEAD)"
if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]; then
  log "note: the working tree has uncommitted changes; the check uses the committed HEAD only"
fi
log "cloning $repo at $head_commit into /root/wsync"
git clone -q --no-hardlinks "$repo" "$root/root/wsync"
git -C "$root/root/wsync" checkout -q --detach "$head_commit"

# --- the commands -----------------------------------------------------------------------------------
if ((configure_only)); then
  names=(configure)
  declare -A cmds=([configure]='tools/setup.sh --deps-only && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo')
else
  names=(demo test)
  [ -z "$only" ] || names=("$only")
  declare -A cmds=([demo]='./wsync demo' [test]='./wsync test')
fi
failed=()
for name in "${names[@]}"; do
  log "$name: ${cmds[$name]}"
  t0=$(date +%s)
  if in_root "cd /root/wsync && ${cmds[$name]}"; then
    log "$name: passed in $(( $(date +%s) - t0 )) s"
  else
    log "$name: FAILED (exit $?) after $(( $(date +%s) - t0 )) s"
    failed+=("$name")
  fi
done

log "done in $(( $(date +%s) - start )) s: ${#failed[@]} of ${#names[@]} failed${failed:+ (${failed[*]})}"
((${#failed[@]} == 0))
