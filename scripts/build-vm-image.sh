#!/usr/bin/env bash
# Builds the guest of the libvirt sandbox driver, locally, from Debian packages only:
#
#   <out>/vmlinuz          a small x86_64 kernel built from Debian's linux-source package
#                          (tinyconfig plus what a serial-console initramfs guest needs)
#   <out>/initramfs.cpio.gz  busybox-static and an /init that runs the sandbox command
#
# <out> is the first argument, else $GPUSHARE_VAR_DIR/vm, else ./var/vm. The driver reads
# VM_KERNEL / VM_INITRD, which default to those two files.
#
# The kernel build is cached under <out>/cache/<hash of the config, the source tarball and
# the kernel toolchain>, so a rerun only rebuilds the (seconds-long) initramfs. A cold
# build takes a few minutes on two cores (make -j2; set JOBS to change that).
#
# Needs: busybox-static, cpio, gzip and, for the kernel, linux-source build-essential bc
# bison flex libelf-dev (.ci/run installs them).
#
# The guest's /init (see below) mounts proc, sys and dev, prints "gpushare-guest: up" on
# the console, runs the command the driver put on the kernel command line (base64 in
# gpushare.run=) as the unprivileged user "sandbox" (uid 1000) or, with none, a shell on
# ttyS0 as that user, prints "gpushare-guest: exit <code>" and powers the VM off, so a finished command
# ends the domain. An ACPI power-button press (libvirt's shutdown) sends the command
# SIGTERM through busybox acpid; the driver destroys the domain after the grace period.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-${GPUSHARE_VAR_DIR:-$PWD/var}/vm}"
JOBS="${JOBS:-2}"
BUSYBOX="${BUSYBOX:-/bin/busybox}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
started=$(date +%s)
log() { printf '[build-vm-image] %s\n' "$*"; }

# --- kernel ------------------------------------------------------------------------------

# Options set on top of tinyconfig. Anything tinyconfig lacks that the guest needs:
# 64-bit, printk and a serial console, initramfs (gzip), ELF and #! binaries, proc, sys,
# devtmpfs, multi-user (the command runs as uid 1000), ACPI with the power button and
# evdev (libvirt's shutdown), SMP (vcpus = ceil(cpu_limit)), and virtiofs (FUSE over
# virtio) for the sandbox's storage, libvirt's <filesystem> served by virtiofsd.
KERNEL_OPTIONS=(
  64BIT PRINTK TTY SERIAL_8250 SERIAL_8250_CONSOLE BLK_DEV_INITRD RD_GZIP BINFMT_ELF
  BINFMT_SCRIPT PROC_FS SYSFS DEVTMPFS DEVTMPFS_MOUNT MULTIUSER FUTEX POSIX_TIMERS
  FILE_LOCKING SHMEM TMPFS UNIX98_PTYS SMP PCI ACPI ACPI_BUTTON INPUT INPUT_EVDEV
  VIRTIO_MENU VIRTIO VIRTIO_PCI FUSE_FS VIRTIO_FS
)

kernel_source() {
  ls /usr/src/linux-source-*.tar.xz 2>/dev/null | sort -V | tail -1
}

build_kernel() {
  local tarball key cache work src
  tarball="$(kernel_source)"
  if [[ -z "$tarball" ]]; then
    log "no /usr/src/linux-source-*.tar.xz: apt-get install linux-source" >&2
    return 1
  fi
  key="$( { printf '%s\n' "${KERNEL_OPTIONS[@]}"; basename "$tarball"; stat -c %s "$tarball";
            gcc --version | head -1; } | sha256sum | cut -c1-16)"
  cache="$OUT/cache/kernel-$key"
  if [[ -s "$cache/bzImage" ]]; then
    log "kernel: cached ($cache)"
  else
    work="$OUT/cache/build-$key"
    rm -rf "$work" && mkdir -p "$work"
    log "kernel: unpacking $(basename "$tarball")"
    tar -xJf "$tarball" -C "$work"
    src="$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)"
    log "kernel: configuring (tinyconfig + ${#KERNEL_OPTIONS[@]} options)"
    make -s -C "$src" ARCH=x86_64 tinyconfig
    local args=()
    for opt in "${KERNEL_OPTIONS[@]}"; do args+=(--enable "$opt"); done
    "$src/scripts/config" --file "$src/.config" "${args[@]}" --set-str INITRAMFS_SOURCE ""
    make -s -C "$src" ARCH=x86_64 olddefconfig
    for opt in "${KERNEL_OPTIONS[@]}"; do
      grep -q "^CONFIG_${opt}=y" "$src/.config" || log "kernel: warning: CONFIG_$opt did not stick"
    done
    log "kernel: building bzImage (make -j$JOBS)"
    make -s -C "$src" ARCH=x86_64 -j"$JOBS" bzImage
    mkdir -p "$cache"
    cp "$src/arch/x86/boot/bzImage" "$cache/bzImage.tmp"
    cp "$src/.config" "$cache/config"
    mv "$cache/bzImage.tmp" "$cache/bzImage"
    rm -rf "$work"
  fi
  install -m 0644 "$cache/bzImage" "$OUT/vmlinuz"
}

# --- initramfs ---------------------------------------------------------------------------

build_initramfs() {
  local root
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' RETURN
  chmod 0755 "$root"  # mktemp's 0700 would become the guest's / and lock the sandbox user out
  mkdir -p "$root"/{bin,sbin,etc/acpi/PWRF,proc,sys,dev,run,tmp,var/log,home/sandbox,root}
  ln -s /run "$root/var/run"
  install -m 0755 "$BUSYBOX" "$root/bin/busybox"
  for applet in $("$BUSYBOX" --list); do
    [[ "$applet" == busybox ]] || ln -sf busybox "$root/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh\n' \
    >"$root/etc/passwd"
  printf 'root:x:0:\nsandbox:x:1000:\n' >"$root/etc/group"
  printf '/bin/sh\n' >"$root/etc/shells"
  chown 1000:1000 "$root/home/sandbox"
  chmod 1777 "$root/tmp"

  # libvirt's shutdown presses the ACPI power button: ask the command to finish.
  cat >"$root/etc/acpi/PWRF/00000080" <<'EOF'
#!/bin/sh
echo "gpushare-guest: power button, stopping the command" >/dev/console
pid="$(cat /run/command.pid 2>/dev/null)"
[ -n "$pid" ] || exit 0
# HUP for the interactive shell (it ignores TERM), TERM for a command.
if [ -e /run/command.shell ]; then sig=HUP; else sig=TERM; fi
kill -"$sig" -"$pid" 2>/dev/null || kill -"$sig" "$pid" 2>/dev/null
exit 0
EOF
  chmod 0755 "$root/etc/acpi/PWRF/00000080"

  cat >"$root/init" <<'EOF'
#!/bin/sh
# gpushare guest init: see scripts/build-vm-image.sh.
export PATH=/bin:/sbin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mount -t tmpfs -o mode=0755 tmpfs /run
exec 0</dev/console 1>/dev/console 2>&1
acpid -c /etc/acpi -l /run/acpid.log -p /run/acpid.pid || echo "gpushare-guest: no acpid, shutdown will be forced"
echo "gpushare-guest: up"
run="" uid=1000 gid=1000 mounts=""
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    gpushare.run=*) run="${arg#gpushare.run=}" ;;
    gpushare.uid=*) uid="${arg#gpushare.uid=}" ;;
    gpushare.gid=*) gid="${arg#gpushare.gid=}" ;;
    gpushare.mounts=*) mounts="${arg#gpushare.mounts=}" ;;
  esac
done
if [ "$uid" != 1000 ] || [ "$gid" != 1000 ]; then
  # The sandbox user takes the host uid and group its storage's files have on the host.
  printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:%s:%s:sandbox:/home/sandbox:/bin/sh\n' "$uid" "$gid" >/etc/passwd
  printf 'root:x:0:\nsandbox:x:%s:\n' "$gid" >/etc/group
  chown "$uid:$gid" /home/sandbox
fi
# Storage: lines "<virtiofs tag> <ro|rw> <mount point>", base64 on the command line. A mount
# that fails ends the sandbox: its work would otherwise vanish with the VM.
if [ -n "$mounts" ] && ! echo "$mounts" | base64 -d | while read -r tag mode target; do
  mkdir -p "$target" && mount -t virtiofs -o "$mode" "$tag" "$target" \
    || { echo "gpushare-guest: cannot mount storage $tag at $target"; exit 1; }
done; then
  echo "gpushare-guest: exit 125"
  poweroff -f
fi
umask 0007  # the storage is shared with the owner's next sandboxes through its group
cd /home/sandbox
if [ -n "$run" ]; then
  echo "$run" | base64 -d >/run/command.sh
  chmod 0755 /run/command.sh
  # setsid: a session (and process group) of its own, which the power button signals.
  setsid su -s /bin/sh sandbox -c /run/command.sh </dev/console &
else
  touch /run/command.shell
  setsid cttyhack su -l -s /bin/sh sandbox &
fi
echo $! >/run/command.pid
wait $!
code=$?
echo "gpushare-guest: exit $code"
sync
poweroff -f
EOF
  chmod 0755 "$root/init"
  # Run as root so that the archive keeps root's and the sandbox user's ownership.
  (cd "$root" && find . -print0 | sort -z | cpio --null -o -H newc --quiet) | gzip -9 >"$OUT/initramfs.cpio.gz.tmp"
  mv "$OUT/initramfs.cpio.gz.tmp" "$OUT/initramfs.cpio.gz"
}

[[ -x "$BUSYBOX" ]] || { log "$BUSYBOX missing: apt-get install busybox-static" >&2; exit 1; }
build_kernel
build_initramfs
# The qemu process runs as libvirt's unprivileged user: it must be able to read both.
chmod 0755 "$OUT"
chmod 0644 "$OUT/vmlinuz" "$OUT/initramfs.cpio.gz"
log "built $OUT/vmlinuz and $OUT/initramfs.cpio.gz in $(($(date +%s) - started)) s"
