#!/usr/bin/env bash
# The container tier's machine: a Docker engine answering, and Polar's base image built locally.
#
#   bash scripts/setup_docker.sh
#
# 1. installs Debian's docker.io and debootstrap when the docker client or debootstrap is missing
#    (apt-get; needs root);
# 2. starts dockerd in the background when no engine answers (its log: $POLAR_DOCKERD_LOG, default
#    dockerd.log in the system's temporary folder), and waits for it;
# 3. builds the base image, polar-base:bookworm, unless an image of that tag already carries this
#    recipe's fingerprint (label polar.base.recipe): a Debian bookworm root file system made by
#    `debootstrap --variant=minbase` with the packages below, imported with `docker import`. No
#    image registry is needed; the Debian mirror is the one apt already uses here (the first URI of
#    its sources), or $POLAR_DEBIAN_MIRROR.
#
# Idempotent: a second run with everything in place returns in a second or two. The task images
# (examples/swe-mini, Harbor tasks) are built FROM this one by Polar when first needed.
set -euo pipefail

BASE_IMAGE=${POLAR_BASE_IMAGE:-polar-base:bookworm}
SUITE=bookworm
# What every task image may count on: python3 (also as `python`) with pytest (grading runs it;
# pip inside `docker build` sees none of the host's package settings), git (the graders diff and
# apply patches with it; any owner's repository is trusted, since a node that is not root owns
# the workspaces the container's root works in), and the certificates a task's tools may need.
PACKAGES=python3,python-is-python3,python3-pytest,git,ca-certificates,procps
RECIPE=$(printf '%s\n' "$SUITE" "$PACKAGES" "minbase v2 safe.directory" | sha256sum | cut -c1-16)
LOG=${POLAR_DOCKERD_LOG:-${TMPDIR:-/tmp}/dockerd.log}

say() { echo "setup_docker: $*"; }

engine_answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

need_root() {
  if [[ $(id -u) -ne 0 ]]; then
    say "$1 needs root; run this script as root (or do it yourself and run it again)" >&2
    exit 1
  fi
}

if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  need_root "installing docker.io and debootstrap"
  say "installing docker.io and debootstrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq -o DPkg::Lock::Timeout=600 docker.io debootstrap >/dev/null
fi

if ! engine_answers; then
  need_root "starting dockerd"
  say "starting dockerd (log: $LOG)"
  # At normal priority even when this setup runs at a lower one (CI's does): the containers of the
  # container tier are the engine's children and would inherit its.
  setsid nohup nice -n "$((-$(nice)))" dockerd >"$LOG" 2>&1 </dev/null &
  for _ in $(seq 1 120); do
    engine_answers && break
    sleep 0.5
  done
  if ! engine_answers; then
    say "dockerd did not answer within 60 s; its log ends:" >&2
    tail -n 20 "$LOG" >&2 || true
    exit 1
  fi
fi
say "engine $(docker version --format '{{.Server.Version}}') answers"

current=$(docker image inspect --format '{{index .Config.Labels "polar.base.recipe"}}' "$BASE_IMAGE" 2>/dev/null || true)
if [[ $current == "$RECIPE" ]]; then
  say "$BASE_IMAGE is built (recipe $RECIPE)"
  exit 0
fi

need_root "debootstrap"
mirror=${POLAR_DEBIAN_MIRROR:-}
if [[ -z $mirror ]]; then
  mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2; exit}')
fi
if [[ -z $mirror ]]; then
  mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
fi
if [[ -z $mirror ]]; then
  say "no Debian mirror found in apt's sources: set POLAR_DEBIAN_MIRROR" >&2
  exit 1
fi

rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
say "debootstrap $SUITE ($PACKAGES) from $mirror: a few minutes"
start=$SECONDS
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$mirror" >"$rootfs.log" 2>&1; then
  say "debootstrap failed; its log ends:" >&2
  tail -n 30 "$rootfs.log" >&2
  rm -f "$rootfs.log"
  exit 1
fi
rm -f "$rootfs.log"
chroot "$rootfs" git config --system --add safe.directory '*'
# What an image's build never needs at run time: package lists and caches.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL polar.base.recipe=$RECIPE" \
  --change 'CMD ["/bin/bash"]' \
  - "$BASE_IMAGE" >/dev/null
say "$BASE_IMAGE built in $((SECONDS - start)) s"
