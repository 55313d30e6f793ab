"""Run a command inside a process sandbox with the confinement its batch has: the web
terminal's shell.

``nsenter --all`` gave the shell the sandbox's namespaces but not its confinement: entering
a user namespace hands the caller a full bounding set (the kernel's ``set_cred_user_ns``),
and nsenter sets neither NO_NEW_PRIVS nor a seccomp filter. This helper does what bwrap
does for the batch, in the same order: join the sandbox's cgroups, enter its namespaces
(its own user namespace last), drop every capability from the bounding set while it
still holds them there, become the sandbox's user, go to its home, set NO_NEW_PRIVS, load
the seccomp filter (workers/drivers/seccomp.py), and fork into the sandbox's pid namespace to exec the
command on the pty it was given (a session leader with it as controlling terminal).

Usage (the agent, as root): ``python -I enter_sandbox.py PID UID GID GROUPS CWD PROCS... -- CMD...``
(GROUPS: the host gids of its storage volumes, comma-separated, or "-" to keep the caller's).
Run by path, not as a module: it must not import the agent's package (Celery's app).
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib.util
import os
import sys
import termios
from pathlib import Path

# The user namespace last: the agent (root) may enter the others from the host, and bwrap
# makes the mount namespace in an outer user namespace than the command's (--disable-userns
# nests one), where the command's own user namespace would give no right to enter it.
NAMESPACES = ("mnt", "uts", "ipc", "net", "cgroup", "pid", "user")
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _seccomp_module() -> object:
    # By file: importing ``workers.drivers.seccomp`` would import ``workers`` (Celery's app).
    path = Path(__file__).with_name("seccomp.py")
    spec = importlib.util.spec_from_file_location("gpushare_sandbox_seccomp", path)
    assert spec is not None and spec.loader is not None  # noqa: S101 - our own file
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def enter(
    pid: int, uid: int, gid: int, groups: list[int] | None, cwd: str, procs_files: list[str], argv: list[str]
) -> int:
    seccomp = _seccomp_module()
    seccomp._filter()  # type: ignore[attr-defined]  # libseccomp loaded before the mounts change
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for procs in procs_files:  # the sandbox's limits cover its terminal too
        Path(procs).write_text(str(os.getpid()))
    # Only the storage volumes' groups, as the batch has them (root's would stay otherwise): set
    # here, on the host, because bwrap denies setgroups(2) inside the sandbox's user namespace.
    if groups is not None:
        os.setgroups(groups)
    fds = [os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in NAMESPACES]
    for name, fd in zip(NAMESPACES, fds, strict=True):
        _check(_libc.setns(fd, 0), f"entering the sandbox's {name} namespace")
        os.close(fd)
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # every capability goes with root
    # As the sandbox's user, not root: the tenant may have made its home a symlink to a
    # root-only folder of its view (the host's /etc/ssl/private), which root's uid would
    # enter by its owner bits and hand to the shell as its working directory.
    try:
        os.chdir(cwd)
    except OSError:
        os.chdir("/")  # the sandbox's root, where setns left us
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")
    seccomp.load()  # type: ignore[attr-defined]
    child = os.fork()  # the child is the first of ours inside the sandbox's pid namespace
    if child == 0:
        os.setsid()
        if os.isatty(0):  # the pty becomes the shell's controlling terminal (job control, ^C)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        os.execvp(argv[0], argv)  # noqa: S606 - the argv the agent built, no shell in between
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def main(args: list[str]) -> int:
    split = args.index("--")
    pid, uid, gid, groups, cwd, *procs_files = args[:split]
    supplementary = None if groups == "-" else [int(g) for g in groups.split(",") if g]
    return enter(int(pid), int(uid), int(gid), supplementary, cwd, procs_files, args[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
