#!/usr/bin/env bash
# Build the local sandbox base image (gpushare/sandbox-base:1) without a registry.
#
# A Debian minbase rootfs (debootstrap --variant=minbase of the host's own release, from the
# host's apt mirror) imported with `docker import`: sandbox hosts often have no registry
# access, and a GPU sandbox needs glibc, because the NVIDIA container toolkit injects the
# host's glibc-linked nvidia-smi and libcuda.so into the container (a static busybox rootfs
# could run neither). The rootfs has a `sandbox` user; the docker driver runs each container
# as its own uid from SANDBOX_UID_BASE up (wire/uids.py), HOME=/home/sandbox.
# OpenSSH's server is in it for `gpushare ssh` (workers/drivers/sshd.py): never started as a
# daemon, run per connection by the agent as the sandbox's uid, stdin and stdout its only
# channel; nss_wrapper gives that uid, which no passwd file of the image names, a name for
# sshd; rsync for `rsync -e ssh`. No host key is baked in: each sandbox makes its own.
# About 45 s with a nearby mirror (measured on the CI machines), once per host.
#
# Usage: scripts/build-sandbox-image.sh [--force] [--image NAME:TAG]
# Environment: SANDBOX_MIRROR (default: the host's first deb.debian.org-style apt source),
#              SANDBOX_SUITE (default: the host's VERSION_CODENAME).
# Idempotent: does nothing when the image already exists in this version, unless --force.
set -euo pipefail

image="gpushare/sandbox-base:1"
version="3"  # 1: static busybox; 2: Debian minbase (glibc); 3: with OpenSSH. An older image is rebuilt.
force=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) force=1; shift ;;
        --image) image="${2:?--image needs a value}"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "build-sandbox-image: unknown argument: $1" >&2; exit 2 ;;
    esac
done

die() { echo "build-sandbox-image: $*" >&2; exit 1; }

command -v docker >/dev/null 2>&1 || die "docker CLI not found (install docker.io)"
docker info >/dev/null 2>&1 || die "cannot reach the Docker engine (is dockerd running?)"

label="io.gpushare.sandbox-image"
if [[ $force -eq 0 ]] \
    && [[ "$(docker image inspect -f "{{index .Config.Labels \"$label\"}}" "$image" 2>/dev/null)" == "$version" ]]; then
    echo "build-sandbox-image: $image already exists (use --force to rebuild)"
    exit 0
fi

command -v debootstrap >/dev/null 2>&1 || die "debootstrap not found (apt-get install debootstrap)"
[[ $(id -u) -eq 0 ]] || die "debootstrap needs root (run with sudo)"
# shellcheck disable=SC1091
suite="${SANDBOX_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}"
[[ -n "$suite" ]] || die "cannot tell the host's Debian release; set SANDBOX_SUITE (e.g. bookworm)"
mirror="${SANDBOX_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    # The host's own apt mirror for its main archive (deb822 or one-line sources).
    mirror="$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list | grep -v -- '-security' | grep -oE '(https?|file)://[^ ]+' | head -1 || true)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

rootfs="$(mktemp -d /tmp/gpushare-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

started=$(date +%s)
# The server of `gpushare ssh` (sftp-server comes with it: scp and VS Code use SFTP).
packages="openssh-server,libnss-wrapper,rsync"
echo "build-sandbox-image: debootstrap --variant=minbase --include=$packages $suite from $mirror"
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1; then
    tail -20 "$rootfs.log" >&2
    rm -f "$rootfs.log"
    die "debootstrap failed (see above); set SANDBOX_MIRROR to a reachable Debian mirror"
fi
rm -f "$rootfs.log"

# Nothing of the build's downloads, docs or translations in the image.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/* \
    "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
# The host keys openssh-server's install made would be every sandbox's: each makes its own.
rm -f "$rootfs"/etc/ssh/ssh_host_*
chroot "$rootfs" /usr/sbin/groupadd --gid 1000 sandbox
chroot "$rootfs" /usr/sbin/useradd --uid 1000 --gid 1000 --home-dir /home/sandbox --create-home \
    --shell /bin/bash sandbox
chmod 1777 "$rootfs/tmp"

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'WORKDIR /home/sandbox' \
    --change 'CMD ["/bin/sh"]' \
    --change "LABEL $label=$version" \
    --message "gpushare sandbox base (Debian $suite minbase)" \
    - "$image" >/dev/null
echo "build-sandbox-image: built $image (Debian $suite minbase) in $(($(date +%s) - started)) s"
