#!/usr/bin/env bash
# What the whole test suite needs on this machine, set up idempotently: `make test` runs it
# first (and so does .ci/run, through `make test`). A second run only checks and returns.
#
#   - Debian packages: Docker, busybox, debootstrap, bubblewrap, OpenSSH, Chromium, nginx/openssl/systemd (the
#     deployment test), OpenLDAP (slapd and its headers), libvirt + QEMU + the libvirt headers, what the VM guest's kernel
#     build needs, and Slurm with munge and MariaDB. Installed with apt-get when we are root; otherwise the exact command is
#     printed and the script fails.
#   - PostgreSQL and Redis on 127.0.0.1 started if they are installed but stopped.
#   - A Docker engine (leaving the host's network alone) and libvirtd, started if not running.
#   - The sandbox base image and the VM guest (kernel cached by its config hash).
#
# The Python environment (with the libvirt extra) and the browser bundle are the Makefile's.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
step() { printf '\n==> %s\n' "$*"; }
die() { printf 'setup-test-env: %s\n' "$*" >&2; exit 1; }

VM_KERNEL="${VM_KERNEL:-/var/lib/libvirt/images/gpushare/vmlinuz}"

step "Debian packages"
packages=(docker.io busybox-static bubblewrap chromium fonts-dejavu-core
  # the sandbox image: a Debian minbase rootfs (scripts/build-sandbox-image.sh).
  debootstrap
  # SSH into sandboxes (tests/workers/test_sshd.py, tests/cli/test_ssh*.py): the real client,
  # and the server's binary that process sandboxes run per connection (its daemon need not run).
  openssh-client openssh-server
  # approved-registry pulls (tests/workers/test_image_pull.py): a registry on loopback.
  docker-registry
  # single sign-on (tests/identity): OpenLDAP's server and tools, its headers for python-ldap.
  slapd ldap-utils libldap2-dev libsasl2-dev
  # deployment test (tests/e2e/test_deployment.py): the reverse proxy, TLS, systemd-analyze.
  nginx openssl systemd
  # libvirt driver: the daemon, QEMU (TCG when there is no usable KVM), headers for
  # libvirt-python, and what scripts/build-vm-image.sh needs to build the guest kernel.
  libvirt-daemon-system qemu-system-x86 libvirt-dev pkg-config
  linux-source build-essential bc bison flex libelf-dev cpio
  # Slurm (tests/slurm): its daemons, REST API and accounting, munge, and the MariaDB that
  # slurmdbd stores in; the tests start private instances of each on loopback.
  # auth/jwt (slurmrestd's tokens) is its own package, only recommended by slurmrestd.
  slurm-wlm slurmctld slurmd slurmrestd slurm-wlm-jwt-plugin slurmdbd slurm-client munge mariadb-server)
missing=()
for p in "${packages[@]}"; do
  [[ "$(dpkg-query -W -f '${Status}' "$p" 2>/dev/null)" == "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    die "missing packages; install them first:
    sudo apt-get install -y --no-install-recommends ${missing[*]}"
  fi
  echo "installing: ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "all present"
fi

step "PostgreSQL and Redis"
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  [[ -d /etc/postgresql ]] || die "PostgreSQL is not installed or not on 127.0.0.1:5432 (set DATABASE_URL)"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start
fi
if ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  command -v redis-server >/dev/null || die "Redis is not installed or not on 127.0.0.1:6379 (set REDIS_URL)"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
for _ in $(seq 30); do
  pg_isready -q -h 127.0.0.1 && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && break
  sleep 1
done
pg_isready -q -h 127.0.0.1 || die "PostgreSQL did not answer on 127.0.0.1:5432"
echo "both answer"

step "Docker engine"
if ! docker info >/dev/null 2>&1; then
  mkdir -p /tmp/gpushare-docker
  # Leave the host's network alone: no iptables rules, no forwarding, no default bridge.
  nohup dockerd --iptables=false --ip-forward=false --bridge=none \
    --data-root /tmp/gpushare-docker >/tmp/gpushare-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 /tmp/gpushare-dockerd.log; die "dockerd did not start"; }
fi
echo "running"

step "libvirt"
# Debian's udev gives /dev/kvm root:kvm 0660; containers often leave it root-only 0600. Then
# libvirt's QEMU capability cache never validates (probed as one user, checked as another)
# and every domain definition re-probes QEMU: ~40 s. The usual mode makes it ~30 ms. KVM
# itself cannot run guests on these machines (nested CPU), so the VMs run under TCG.
if [[ -c /dev/kvm ]] && getent group kvm >/dev/null && [[ "$(stat -c %a /dev/kvm)" == 600 ]]; then
  chgrp kvm /dev/kvm && chmod 660 /dev/kvm
fi
if ! virsh -c qemu:///system version >/dev/null 2>&1; then
  pgrep -x virtlogd >/dev/null || virtlogd -d
  pgrep -x libvirtd >/dev/null || libvirtd -d
  for _ in $(seq 30); do virsh -c qemu:///system version >/dev/null 2>&1 && break; sleep 1; done
  virsh -c qemu:///system version >/dev/null 2>&1 || die "libvirtd did not start"
fi
echo "running"

step "sandbox base image"
bash scripts/build-sandbox-image.sh

step "VM guest image (kernel cached by its config hash)"
# Under libvirt's images folder: QEMU runs as libvirt's unprivileged user and must reach it.
bash scripts/build-vm-image.sh "$(dirname "$VM_KERNEL")"
