#!/usr/bin/env bash
# Build the local sandbox base image (gpushare/sandbox-base:1) without a registry.
#
# The image is a busybox-static rootfs imported with `docker import`: sandbox hosts often
# have no registry access, and the docker driver only needs a shell, coreutils and a
# `sandbox` user for images run by hand. The driver runs each container as its own uid from
# SANDBOX_UID_BASE up (workers/drivers/uids.py), with HOME=/home/sandbox on a tmpfs it owns.
#
# Usage: scripts/build-sandbox-image.sh [--force] [--image NAME:TAG]
# Idempotent: does nothing when the image already exists, unless --force.
set -euo pipefail

image="gpushare/sandbox-base:1"
force=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) force=1; shift ;;
        --image) image="${2:?--image needs a value}"; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "build-sandbox-image: unknown argument: $1" >&2; exit 2 ;;
    esac
done

die() { echo "build-sandbox-image: $*" >&2; exit 1; }

command -v docker >/dev/null 2>&1 || die "docker CLI not found (install docker.io)"
docker info >/dev/null 2>&1 || die "cannot reach the Docker engine (is dockerd running?)"

# Only a statically linked busybox works in an otherwise empty rootfs; Debian's
# busybox-static ships it at /bin/busybox.
busybox="${BUSYBOX:-/bin/busybox}"
[[ -x "$busybox" ]] || die "$busybox not found (install busybox-static)"
if command -v file >/dev/null 2>&1 && ! file -L "$busybox" | grep -q "statically linked"; then
    die "$busybox is dynamically linked; install busybox-static"
fi

if [[ $force -eq 0 ]] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "build-sandbox-image: $image already exists (use --force to rebuild)"
    exit 0
fi

rootfs="$(mktemp -d /tmp/gpushare-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

mkdir -p "$rootfs"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,home/sandbox,tmp,root}
install -m 0755 "$busybox" "$rootfs/bin/busybox"
# One symlink per applet at the path busybox itself lists, so /bin/sh, /bin/sleep,
# /usr/bin/env... all resolve inside the image.
while read -r applet; do
    [[ "$applet" == "bin/busybox" || -e "$rootfs/$applet" ]] && continue
    mkdir -p "$rootfs/$(dirname "$applet")"
    ln -s /bin/busybox "$rootfs/$applet"
done < <("$busybox" --list-full)

cat > "$rootfs/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/bin/sh
sandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
PASSWD
cat > "$rootfs/etc/group" <<'GROUP'
root:x:0:
sandbox:x:1000:
nogroup:x:65534:
GROUP
chmod 1777 "$rootfs/tmp"
chmod 0700 "$rootfs/root"
chown 1000:1000 "$rootfs/home/sandbox"

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'WORKDIR /home/sandbox' \
    --change 'CMD ["/bin/sh"]' \
    --message "gpushare sandbox base (busybox $("$busybox" | head -1 | awk '{print $2}'))" \
    - "$image" >/dev/null
echo "build-sandbox-image: built $image"
