"""The seccomp filter of process sandboxes: what Docker's default profile refuses a container
without added capabilities, refused here too.

Built with libseccomp (through pyseccomp, its ctypes binding; libseccomp2 is on every Debian,
apt depends on it). A deny list rather than Docker's allow list: the kernel calls Docker
denies are those that reach beyond the container (the kernel's keyring, modules, clocks,
mounts, namespaces, BPF, tracing other processes) and nothing a batch job needs; an allow
list of several hundred names would break the next program that uses a new call. Denied
calls fail with EPERM (``clone3`` with ENOSYS, so that C libraries fall back to ``clone``,
whose namespace flags are checked). Calls in any other ABI than the host's (i386's int 0x80,
x32) kill the thread: libseccomp's answer to a foreign architecture.

The batch gets the filter through bwrap's ``--seccomp`` (the compiled BPF, ``bpf_program``);
the web terminal's shell loads the same rules itself (``load``), after entering the sandbox.
"""

from __future__ import annotations

import errno
import functools
import logging
import tempfile
from typing import Any

log = logging.getLogger(__name__)

# Docker's default profile, "Significant syscalls blocked" (docs.docker.com/engine/security/
# seccomp/) plus what newer moby blocks: the new mount API and io_uring.
DENIED = (
    # the kernel keyring
    "add_key", "keyctl", "request_key",
    # kernel modules, kexec, reboot, swap, accounting, quotas
    "create_module", "init_module", "finit_module", "delete_module", "get_kernel_syms",
    "query_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct",
    "quotactl", "quotactl_fd", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl",
    # clocks and the host's identity
    "clock_adjtime", "clock_settime", "settimeofday", "stime", "adjtimex", "sethostname",
    "setdomainname", "syslog",
    # mounts and namespaces (a new user namespace is the usual first step of an escape)
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsconfig",
    "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    # eBPF, performance counters, userfaultfd, io_uring
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # other processes' memory, handles into the host's filesystems, raw I/O, NUMA policy
    "process_vm_readv", "process_vm_writev", "kcmp", "name_to_handle_at", "open_by_handle_at",
    "lookup_dcookie", "iopl", "ioperm", "vm86", "vm86old", "get_mempolicy", "set_mempolicy",
    "mbind", "move_pages", "vhangup",
)  # fmt: skip
# clone(2) flags that make namespaces (CLONE_NEWNS ... CLONE_NEWNET, CLONE_NEWTIME).
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)


def _filter() -> Any:
    import pyseccomp

    rules = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    for name in DENIED:
        try:
            rules.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):  # no such call on this architecture
            log.debug("seccomp: %s does not exist here", name)
    for flag in NAMESPACE_FLAGS:
        with_flag = pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag)
        rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone", with_flag)
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    return rules


@functools.cache
def bpf_program() -> bytes:
    """The filter compiled to classic BPF, as bwrap's ``--seccomp FD`` reads it."""
    with tempfile.TemporaryFile() as out:
        _filter().export_bpf(out)
        out.flush()
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise OSError(f"libseccomp exported {len(program)} bytes: not a BPF program")
    return program


def load() -> None:
    """Load the filter into this process (and so everything it executes from now on).
    Needs NO_NEW_PRIVS set first unless the caller has CAP_SYS_ADMIN."""
    _filter().load()
