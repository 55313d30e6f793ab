"""The sandbox driver seam: launch, stop and find sandboxes at one isolation level.

Tasks carry a ``SandboxSpec`` as plain JSON; the driver turns it into a container, a VM or
a confined process. Launch is idempotent, keyed by ``allocation_key``: a repeated message
finds the sandbox it already made. Everything a driver makes carries labels (or a name)
from which ``list_owned`` rebuilds the agent's picture after a restart.
"""

from __future__ import annotations

import os
import posixpath
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from wire.relay import Terminal
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers import tenant_paths
from workers.drivers.output import OutputChunk

# Host paths a sandbox must never get read-write, nor any directory holding one: the host's
# root and system trees, users' homes and the container engines' sockets.
PROTECTED_HOST_PATHS = (
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/proc", "/root", "/sbin", "/sys",
    "/usr", "/var/lib/docker", "/var/lib/libvirt", "/var/run/docker.sock", "/run/docker.sock",
    "/run/containerd", "/var/run/libvirt", "/run/libvirt",
)  # fmt: skip


def checked_pipe_dir(path: str) -> str:
    """The MPS pipe directory the drivers bind read-write, after making sure it is one: an
    absolute, normalised path that is neither a protected path, inside a system tree, nor an
    ancestor of one. The agent makes it (<mps_root>/<device key>/pipe); this is defence in depth
    against a forged or corrupted launch message."""
    if not path.startswith("/") or posixpath.normpath(path) != path or "\0" in path:
        raise DriverError(f"MPS pipe directory {path!r} is not an absolute, normalised path")
    for protected in PROTECTED_HOST_PATHS:
        inside_system = protected not in ("/", "/home") and path.startswith(protected + "/")
        if path == protected or protected.startswith(path.rstrip("/") + "/") or inside_system:
            raise DriverError(f"MPS pipe directory {path!r} would expose {protected} to the sandbox")
    return path


MPS_CONTROL_SOCKET = "control"  # the control daemon's socket in its pipe directory
MPS_SOCKET_WAIT_S = 5.0  # how long a launch waits for a just-started daemon's socket


def _grants(info: os.stat_result, uid: int, bits: int) -> bool:
    """Whether ``uid`` (whose only group is its own gid, as the drivers run it) has the
    permission ``bits`` (4 read, 2 write, 1 search) on a file with this ``stat``."""
    if uid == 0:
        return True
    if info.st_uid == uid:
        shift = 6
    elif info.st_gid == uid:
        shift = 3
    else:
        shift = 0
    return (info.st_mode >> shift) & bits == bits


def require_mps_pipe(path: str, uid: int, *, real_gpu: bool, socket_wait_s: float | None = None) -> None:
    """Refuse an MPS launch whose client could not reach the GPU's MPS daemon.

    A CUDA client that cannot connect to ``<pipe_dir>/control`` does not fail: it runs as if
    MPS did not exist (man nvidia-cuda-mps-control), with the whole GPU and no thread or
    memory limit. So the pipe directory must exist and be searchable by the sandbox's host
    ``uid``, and on a real GPU the daemon's control socket must be there and writable by it
    (connect() needs both); it is waited for (``MPS_SOCKET_WAIT_S``), since the agent
    counts a daemon as up once its pid file names it. A simulated host's daemon makes no socket."""
    where = f"MPS pipe directory {path}"
    try:
        info = os.stat(path)
    except OSError as exc:
        raise DriverError(
            f"{where} is missing ({exc.strerror}): the GPU's MPS daemon is not running; refusing "
            "to start a share that would run without MPS"
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise DriverError(f"{where} is not a directory")
    if not _grants(info, uid, 1):
        raise DriverError(
            f"{where} (mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}) cannot be entered by "
            f"the sandbox's uid {uid}: its CUDA would silently run without MPS"
        )
    if not real_gpu:
        return
    control = os.path.join(path, MPS_CONTROL_SOCKET)
    deadline = time.monotonic() + (MPS_SOCKET_WAIT_S if socket_wait_s is None else socket_wait_s)
    # Waited for until it is connectable, not only there: a daemon binds its socket, then
    # widens its mode, and a launch looking in between would be refused.
    while not _connectable(path, uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        sock = _control_socket(path)
    except FileNotFoundError as exc:
        raise DriverError(
            f"{control} is missing ({exc.strerror}): the GPU's MPS daemon is not running; refusing "
            "to start a share that would run without MPS"
        ) from exc
    except OSError as exc:  # a tenant of the GPU planted a link or its own socket there
        raise DriverError(
            f"{control} is not the MPS daemon's socket ({exc.strerror or exc}): its CUDA would "
            "silently run without MPS"
        ) from exc
    if not _connectable(path, uid, sock):
        raise DriverError(
            f"{control} is not a socket the sandbox's uid {uid} can connect to: its CUDA would "
            "silently run without MPS"
        )


def _control_socket(pipe_dir: str) -> os.stat_result:
    """The daemon's control socket in ``pipe_dir``, where its clients (tenants) write too:
    looked at without following a link, and only as the daemon makes it, a socket of the
    agent's own uid (root's daemon, or a non-root agent's)."""
    folder = tenant_paths.open_folder(pipe_dir)
    try:
        control = tenant_paths.open_beneath(folder, MPS_CONTROL_SOCKET, os.O_PATH | os.O_NOFOLLOW)
    finally:
        os.close(folder)
    try:
        return tenant_paths.require(control, MPS_CONTROL_SOCKET, stat.S_IFSOCK, owner=os.geteuid())
    finally:
        os.close(control)


def _connectable(pipe_dir: str, uid: int, info: os.stat_result | None = None) -> bool:
    """Whether the daemon's socket in ``pipe_dir`` is one ``uid`` may connect() to (write
    permission on it)."""
    if info is None:
        try:
            info = _control_socket(pipe_dir)
        except OSError:
            return False
    return _grants(info, uid, 2)


@dataclass(frozen=True)
class SandboxStatus:
    state: str  # "running" | "exited" | "missing" | "created" (made, never started)
    exit_code: int | None = None
    started_at_ms: int | None = None
    reason: str | None = None  # why it exited when the driver knows, e.g. "out of memory"
    # When it ended, by the engine's own clock, for an engine that keeps it (Slurm's end time,
    # which its accounting reports): the ledger then ends where that accounting does.
    ended_at_ms: int | None = None


class DriverError(RuntimeError):
    """The driver could not do what was asked (engine down, bad image...)."""


class SandboxDriver(Protocol):
    name: str

    @property
    def storage_dir(self) -> Path | None:
        """Where this host's persistent storage lives (workers/drivers/storage.py); None for a
        driver that mounts none (the state-only one of simulated hosts)."""
        ...

    def prepare(self, spec: SandboxSpec, report: Callable[[str], None]) -> None:
        """What a launch needs first and may take minutes (Docker: pulling an approved
        image), before the launch itself; ``report`` is given a line of progress now and
        then. Nothing, for drivers that need nothing."""
        ...

    def launch(self, spec: SandboxSpec) -> SandboxHandle: ...

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None: ...

    def warn(self, handle: SandboxHandle) -> str:
        """Tell a running sandbox it will be stopped soon, as a stop's first step does (SIGTERM
        to its command; a VM's ACPI power button) but without the stop. Returns what was done,
        for the owner's event log. A preemption's warning (portal/sandboxes/preemption.py)."""
        ...

    def status(self, handle: SandboxHandle) -> SandboxStatus: ...

    def list_owned(self) -> list[SandboxHandle]: ...

    def exec_terminal(self, handle: SandboxHandle) -> Terminal: ...

    def open_ssh(self, handle: SandboxHandle, authorized_keys: list[str]) -> Terminal:
        """A byte stream to an SSH server inside the sandbox, run as its user for this one
        connection, that lets in only ``authorized_keys`` (workers/drivers/sshd.py).
        DriverError where the sandbox cannot run one (a VM, a simulated or Slurm sandbox)."""
        ...

    def open_app(self, handle: SandboxHandle) -> Terminal:
        """A connection to the sandbox's web app, for the portal's proxy (a byte stream with
        the terminal's interface). DriverError when it has none or it is not listening."""
        ...

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        """At most ``limit`` bytes of the sandbox's stdout and stderr from ``offset`` (into
        all it wrote) on. The host keeps the last ``SANDBOX_OUTPUT_MAX_BYTES`` of it: a chunk
        starting beyond ``offset`` says the bytes in between were dropped."""
        ...


@runtime_checkable
class KeepsEndTimes(Protocol):
    """A driver whose engine keeps each sandbox's end time and accounts it (Slurm): a stop is
    reported at that time, not when the agent got to report it, so that gpushare's ledger and
    the engine's accounting agree (``portal.control.slurm_accounting``)."""

    def ended_at_ms(self, handle: SandboxHandle) -> int | None:
        """When the stopped sandbox ended, by the engine's clock; None when it does not know."""
        ...


@runtime_checkable
class ChecksGpuPath(Protocol):
    """A driver whose way of handing a sandbox its GPUs depends on how the host was set up
    (Docker: the NVIDIA toolkit's hook or a CDI spec), and which can tell at start that
    there is none."""

    def gpu_path_problem(self) -> tuple[str, str] | None:
        """(what is missing, how to fix it) when no GPU can be handed out; None otherwise."""
        ...
