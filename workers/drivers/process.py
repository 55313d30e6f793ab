"""Process sandbox driver: the command confined by bubblewrap, limited by cgroups.

For hosts without a container engine. The sandbox is ``bwrap --unshare-all`` over a
read-only view of the host's /usr (and the few /etc files dynamic binaries need), with a
fresh /proc, a minimal /dev, tmpfs /tmp and home, no network (a spec asking for one is
refused: bwrap could only share the host's), a cleared environment and uid 1000 inside its
own user namespace, in which no further user namespace can be made (``--disable-userns``),
under a seccomp filter like Docker's default (workers/drivers/seccomp.py), with every
capability dropped from its bounding set and NO_NEW_PRIVS set (bwrap does both).

Process tree, and why each link is there::

    sh (wrapper, session leader, pid recorded)   joins the cgroup, then waits
     └ bwrap (outer; a host uid of its own when we are root)
        └ bwrap (pid 1 of the sandbox pid namespace)   child-pid in the status file
           └ the command

* The wrapper shell writes its own pid into the cgroups *before* anything forks, so
  nothing escapes the limits, and it stays as bwrap's parent: ``--die-with-parent`` ties
  bwrap to its parent *thread*, so if the agent (or the worker thread that launched) were
  the parent, an agent restart would kill every sandbox.
* When the agent runs as root, bwrap runs as an unprivileged host uid through
  ``setpriv``: otherwise the sandbox's uid 1000 maps to host root, and every root-owned
  file bound into the sandbox would count as the sandbox user's own. Each sandbox gets
  its own uid from a range no host account uses (wire/uids.py), so sandboxes
  cannot touch one another's processes or files and RLIMIT_NPROC counts one sandbox;
  except under MPS, whose server serves one uid at a time: a GPU's MPS clients share that
  GPU's uid, from the same range.
* bwrap's ``--json-status-fd`` gives the sandbox's pid namespace and, later, the exit
  code, in a file that outlives the agent.

Limits: cgroups, else rlimits (workers/drivers/cgroups.py); the log line says which applied.
The web terminal's shell enters the sandbox with the same confinement (enter_sandbox.py).

GPU isolation is by device node: the sandbox's /dev holds exactly its GPUs' nodes (for a MIG
device its parent's node and the capability nodes of its GPU and compute instance), found
by workers/drivers/gpu_nodes.py; a node that is missing fails the launch with the command
that creates it. Its /proc/driver/nvidia/gpus lists only those GPUs (the parent's, for MIG).
``CUDA_VISIBLE_DEVICES``, which the tenant can unset, is not what isolates.

Driver libraries reach the sandbox through the host's /usr, /lib* and ld.so.cache. A host
whose driver is found only through ``LD_LIBRARY_PATH`` (a containerised driver under
/run/nvidia/driver, an /opt install) gives the agent that variable: a GPU sandbox gets it
too, its directories bound read-only (only absolute, existing directories outside the
trees a sandbox must never see; see ``_driver_lib_dirs``).

MPS (measured on an H200, driver 580, with this driver and gpu-checks/mps_checks.sh step
6): a client in a private IPC namespace with a /dev/shm of its own reaches the host's MPS
server through the pipe directory alone and gets its thread and memory limits, so the
sandbox keeps private IPC and /dev/shm (NVIDIA's device plugin shares the daemon's shm with
its clients; this driver version does not need it). The pipe directory is bound read-write,
and a launch whose pipe directory (or, on a real GPU, control socket) the sandbox's uid
cannot reach is refused: CUDA would otherwise run silently without MPS.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wire import uids
from wire.config import apps_root, storage_root
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers import app_socket, output, procfs, seccomp, sshd, storage
from workers.drivers.base import (
    PROTECTED_HOST_PATHS,
    DriverError,
    SandboxStatus,
    checked_pipe_dir,
    require_mps_pipe,
)
from workers.drivers.cgroups import Limits, make_cgroups, oom_kills, remove_cgroups, rlimits
from workers.drivers.gpu_nodes import GpuNodes, Node
from workers.drivers.process_terminal import ProcessTerminal
from workers.drivers.unavailable import DriverUnavailable, install_command

log = logging.getLogger(__name__)

SANDBOX_UID = 1000
SANDBOX_HOME = "/home/sandbox"
SANDBOX_TMP = "/tmp"  # noqa: S108 - the sandbox's own tmpfs, not the host's /tmp
SANDBOX_SHM = "/dev/shm"  # noqa: S108 - the sandbox's own tmpfs in its own /dev
NOBODY_UID = 65534
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_START_TIMEOUT_S = 10.0
_POLL_S = 0.05
_BASE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
# Host /etc files that dynamic binaries, TLS and name lookups need; never all of /etc.
_ETC_FILES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
    "ca-certificates.conf", "localtime", "nsswitch.conf", "host.conf", "hosts", "gai.conf",
    "protocols", "services", "mime.types",
)  # fmt: skip
_PASSWD = (
    f"root:x:0:0:root:/root:/bin/sh\n"
    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{SANDBOX_HOME}:/bin/sh\n"
    f"nobody:x:{NOBODY_UID}:{NOBODY_UID}:nobody:/nonexistent:/bin/false\n"
)
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:{NOBODY_UID}:\n"
# Joins every cgroup.procs file given before "--", then runs the rest, and stays as its
# parent (see the module docstring).
_JOIN_AND_WAIT = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; "$@"'
# Run by path with -I -S: the writer imports nothing of the project (nor celery's app).
_OUTPUT_WRITER = str(Path(output.__file__).resolve())
# The terminal's way into a sandbox, with the batch's confinement (run by path, -I).
_ENTER_SANDBOX = str(Path(__file__).with_name("enter_sandbox.py").resolve())


def _as_sandbox_uid(argv: list[str]) -> list[str]:
    """``argv`` run the way launches run bwrap: as root, through setpriv as an unprivileged
    host uid (a sandbox's own, from the range no account uses)."""
    if os.geteuid() != 0:
        return argv
    uid = str(uids.sandbox_uid(0))
    return ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--", *argv]


def bwrap_problem() -> str | None:
    """Why bwrap cannot make the sandbox's namespaces here (None when it can), probed the
    way launches run it: a root agent launches bwrap as an unprivileged uid, so a host that
    restricts unprivileged user namespaces (Ubuntu 24.04's AppArmor
    ``apparmor_restrict_unprivileged_userns``, ``kernel.unprivileged_userns_clone=0``) fails
    every launch while bwrap run as root would still work."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    probe = _as_sandbox_uid(
        [bwrap, "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--proc", "/proc", "true"]
    )
    try:
        probed = subprocess.run(  # noqa: S603 - argv built here
            probe, capture_output=True, timeout=10, check=False, cwd="/", env={"PATH": _BASE_PATH}
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not be run: {exc}"
    if probed.returncode == 0:
        return None
    said = probed.stderr.decode(errors="replace").strip() or f"exit code {probed.returncode}"
    who = f"as uid {probe[2]}" if probe[0] == "setpriv" else "as this user"
    return f"bwrap cannot create user namespaces {who}: {said}"


@dataclass(frozen=True)
class Bind:
    """A host folder bwrap binds into the sandbox (its storage, its app's socket folder)."""

    source: str
    target: str
    read_only: bool

    def args(self) -> list[str]:
        return ["--ro-bind" if self.read_only else "--bind", self.source, self.target]


def bwrap_available() -> bool:
    """True when bwrap is installed and can create the namespaces the sandbox needs."""
    return bwrap_problem() is None


def _gpu_device_nodes(uuids: tuple[str, ...], gpus_dir: Path) -> list[str]:
    """The sandbox paths of the nodes for ``uuids`` (for gpu-checks/procdriver_check.py)."""
    return [node.path for node in GpuNodes(proc_root=gpus_dir.parent).nodes(uuids)]


# The host trees every sandbox sees read-only (/usr first, then the top-level ones).
_BOUND_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Directories of LD_LIBRARY_PATH a GPU sandbox never gets bound, beyond the protected
# paths and their ancestors: the scratch roots themselves (the sandbox has its own /tmp),
# and anything inside homes, /etc, the kernel's trees and gpushare's state.
_NEVER_BIND_EXACT = ("/tmp", "/var/tmp")  # noqa: S108 - names refused, nothing written
_NEVER_BIND_UNDER = ("/home", "/root", "/etc", "/proc", "/sys", "/dev", "/run/user", "/run/gpushare",
                     "/var/lib/gpushare")  # fmt: skip


def _driver_lib_dirs(value: str) -> list[str]:
    """The directories of the agent's ``LD_LIBRARY_PATH`` a GPU sandbox may read: absolute,
    normalised, existing, and neither a protected host path (the drivers' list) or an
    ancestor of one, nor one of the names above. Others are dropped, silently: the
    variable is the host's, not the tenant's."""
    kept: list[str] = []
    for entry in value.split(":"):
        if not entry.startswith("/") or os.path.normpath(entry) != entry or not os.path.isdir(entry):
            continue
        protected = any(entry == p or p.startswith(entry.rstrip("/") + "/") for p in PROTECTED_HOST_PATHS)
        refused = entry in _NEVER_BIND_EXACT or any(entry.startswith(p + "/") for p in _NEVER_BIND_UNDER)
        if not protected and not refused and entry not in kept:
            kept.append(entry)
    return kept


# --- driver ------------------------------------------------------------------------------


class ProcessDriver:
    name = "process"

    def __init__(
        self,
        state_dir: Path,
        host: str = "",
        *,
        limits: str = "auto",
        gpu_nodes: GpuNodes | None = None,
        output_cap: int | None = None,
        storage_dir: Path | None = None,
        apps_dir: Path | None = None,
    ) -> None:
        if limits not in ("auto", "cgroup", "rlimit"):
            raise ValueError(f"limits must be auto, cgroup or rlimit, not {limits!r}")
        self.state_dir = Path(state_dir)
        self.host = host
        self.limits = limits
        if os.geteuid() == 0 and (problem := uids.check_range()):
            raise DriverUnavailable("process", problem, "set SANDBOX_UID_BASE for every agent of this host")
        self.gpu_nodes = gpu_nodes or GpuNodes()
        self.output_cap = output.cap_bytes() if output_cap is None else output_cap
        self.storage_dir = storage_root() if storage_dir is None else storage_dir
        self.apps_dir = apps_root() if apps_dir is None else apps_dir
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._thread_lock = threading.Lock()

    # -- state files --

    def _path(self, allocation_key: str, suffix: str) -> Path:
        if not _SAFE_ID.fullmatch(allocation_key):
            raise DriverError(f"allocation id {allocation_key!r} is not safe as a file name")
        return self.state_dir / f"{allocation_key}.{suffix}"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # One lock for the whole state dir, across threads (the mutex) and across agent
        # processes sharing the dir (flock on a fresh descriptor per holder).
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._thread_lock, open(self.state_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _output_dir(self, allocation_key: str) -> Path:
        return self._path(allocation_key, "output")

    @staticmethod
    def _output_text(output_dir: Path) -> str:
        """The first bytes the sandbox (or bwrap, failing) wrote, as text."""
        # The writer may not have flushed bwrap's last words yet when the wrapper is gone.
        deadline = time.monotonic() + 1.0
        while not output.read_segments(output_dir, 0, 1).data and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return output.read_segments(output_dir, 0, 65536).data.decode(errors="replace")

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> output.OutputChunk:
        """The sandbox's output from ``offset`` on (see workers/drivers/output.py)."""
        return output.read_segments(self._output_dir(handle.allocation_key), offset, limit)

    def _load(self, allocation_key: str) -> dict[str, Any] | None:
        try:
            state: dict[str, Any] = json.loads(self._path(allocation_key, "json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise DriverError(f"unreadable state for sandbox {allocation_key}: {exc}") from exc
        return state

    def _save(self, state: dict[str, Any]) -> None:
        path = self._path(state["allocation_key"], "json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)  # atomic: a crash never leaves half a state file

    def _status_lines(self, allocation_key: str) -> list[dict[str, Any]]:
        """The JSON documents bwrap wrote to the status file (one per line)."""
        try:
            text = self._path(allocation_key, "status").read_text()
        except OSError:
            return []
        docs = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                docs.append(json.loads(line))
        return docs

    def _handle(self, state: dict[str, Any]) -> SandboxHandle:
        return SandboxHandle(
            driver=self.name,
            allocation_key=state["allocation_key"],
            sandbox_id=state["sandbox_id"],
            ref=str(state["pid"]),
        )

    def _running(self, state: dict[str, Any]) -> bool:
        child = self._children.get(state["allocation_key"])
        if child is not None:
            child.poll()  # reap our own exited wrapper so it does not linger as a zombie
        return procfs.alive(state["pid"], state["start_ticks"])

    # -- launch --

    def _choose_limits(self, spec: SandboxSpec) -> Limits:
        # RLIMIT_NPROC counts the uid's processes: only a uid this sandbox has to itself.
        private_uid = os.geteuid() == 0 and spec.mps is None and not spec.owner_id
        if self.limits == "rlimit":
            return rlimits(spec, private_uid)
        try:
            return make_cgroups(spec)
        except OSError as exc:
            if self.limits == "cgroup":
                raise DriverError(f"cannot create cgroups for {spec.allocation_key}: {exc}") from exc
            log.warning("cgroups not usable (%s); sandbox %s falls back to rlimits", exc, spec.allocation_key)
            return rlimits(spec, private_uid)

    @staticmethod
    def _refuse_unsafe(spec: SandboxSpec) -> None:
        # bwrap has no network of its own to give: --share-net would join the host's network
        # namespace, and with it every service listening on the host's loopback (the
        # database, Redis). Refused rather than quietly run without the network it asked for.
        if spec.network:
            raise DriverError(
                f"sandbox {spec.allocation_key}: the process driver cannot give a private network "
                "(only the host's); give network tiers container or vm isolation"
            )
        if spec.mps is not None:
            checked_pipe_dir(spec.mps.pipe_dir)

    def _device_nodes(self, spec: SandboxSpec) -> list[Node]:
        """The GPU nodes to bind: none without a real GPU named (a CPU-only or simulated
        sandbox); exactly its devices' otherwise (raises DriverError for a missing one)."""
        if not (spec.real_gpu and spec.device_uuids):
            return []
        return self.gpu_nodes.nodes(spec.device_uuids)

    def _bwrap_args(
        self,
        spec: SandboxSpec,
        passwd_fd: int,
        group_fd: int,
        status_fd: int,
        seccomp_fd: int,
        nodes: list[Node] | None = None,
        binds: list[Bind] | None = None,
    ) -> list[str]:
        self._refuse_unsafe(spec)
        if nodes is None:
            nodes = self._device_nodes(spec)
        if binds is None:
            binds = self._binds(spec, storage.resolve(self.storage_dir, spec.mounts))
        args = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--seccomp", str(seccomp_fd)]
        args += ["--die-with-parent", "--new-session"]
        args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        args += ["--hostname", f"sandbox-{spec.sandbox_id}", "--ro-bind", "/usr", "/usr"]
        for top in _BOUND_TREES[1:]:
            if os.path.islink(top):  # merged-/usr hosts: keep the symlink into /usr
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        for name in _ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        args += ["--perms", "0644", "--ro-bind-data", str(passwd_fd), "/etc/passwd"]
        args += ["--perms", "0644", "--ro-bind-data", str(group_fd), "/etc/group"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        tmpfs_bytes = str(max(16, spec.memory_limit_mib // 4) * 1024 * 1024)
        args += ["--size", tmpfs_bytes, "--perms", "1777", "--tmpfs", SANDBOX_TMP]
        if not spec.mounts_at(SANDBOX_HOME):  # a persistent home replaces the scratch one
            args += ["--size", tmpfs_bytes, "--perms", "0700", "--tmpfs", SANDBOX_HOME]
        # POSIX shared memory (DataLoader workers, NCCL): the tier's size, a private tmpfs
        # (charged to the sandbox's memory cgroup like the others).
        shm_bytes = str(spec.shm_size_mib * 1024 * 1024) if spec.shm_size_mib > 0 else tmpfs_bytes
        args += ["--size", shm_bytes, "--perms", "1777", "--tmpfs", SANDBOX_SHM]
        # Exactly the sandbox's GPU nodes, each checked to exist (no --dev-bind-try: a
        # missing node is a launch error, not a sandbox whose CUDA fails with error 999).
        for node in nodes:
            args += ["--dev-bind", str(node.host), node.path]
        if nodes:
            # Only its own GPUs under /proc/driver/nvidia/gpus, as libnvidia-container does:
            # the fresh procfs lists every GPU of the host, and NVML in the sandbox would
            # count (and fail on) those it has no node for.
            args += self.gpu_nodes.proc_mask_args(spec.device_uuids)
            # CUDA and NVML read PCI topology and NUMA nodes from sysfs; containers get a
            # read-only sysfs as well.
            args += ["--ro-bind", "/sys", "/sys"]
            for lib_dir in self._lib_dirs():
                if not any(lib_dir == t or lib_dir.startswith(t + "/") for t in _BOUND_TREES):
                    args += ["--ro-bind", lib_dir, lib_dir]
        if spec.mps is not None:
            # Read-write: the client creates and connects to sockets in the pipe directory.
            args += ["--bind", spec.mps.pipe_dir, spec.mps.pipe_dir]
        # After the tmpfs: a project folder may go inside the scratch home. The sandbox reaches
        # its storage through its supplementary groups (the volumes' gids, given by setpriv),
        # and its app's socket folder as its owner.
        for bind in binds:
            args += bind.args()
        args += ["--chdir", SANDBOX_HOME, "--clearenv"]
        env = self._sandbox_env(spec)
        if nodes and (lib_dirs := self._lib_dirs()):
            env = {"LD_LIBRARY_PATH": ":".join(lib_dirs), **env}
        for key, value in env.items():
            args += ["--setenv", key, value]
        args += ["--json-status-fd", str(status_fd), "--", *spec.command]
        return args

    def _binds(self, spec: SandboxSpec, bound: list[storage.BoundStorage]) -> list[Bind]:
        binds = [Bind(m.host_path, m.target, m.read_only) for m in bound]
        if spec.app:  # its app's socket, which the agent connects to from the host
            folder = str(app_socket.host_dir(self.apps_dir, spec.allocation_key))
            binds.append(Bind(folder, app_socket.APP_DIR, False))
        return binds

    @staticmethod
    def _lib_dirs() -> list[str]:
        return _driver_lib_dirs(os.environ.get("LD_LIBRARY_PATH", ""))

    @staticmethod
    def _sandbox_env(spec: SandboxSpec) -> dict[str, str]:
        base = {"PATH": _BASE_PATH, "HOME": SANDBOX_HOME, "USER": "sandbox"}
        app = {"GPUSHARE_APP_SOCKET": app_socket.APP_SOCKET} if spec.app else {}
        return {**base, **spec.env, **app, **spec.gpu_env()}

    @staticmethod
    def _host_uid(spec: SandboxSpec) -> int:
        return uids.host_uid(spec)

    def _run_uid(self, spec: SandboxSpec) -> int:
        """The host uid the sandbox runs as: its own (or its GPU's MPS uid) under a root
        agent, which drops to it with setpriv; the agent's own uid otherwise."""
        return self._host_uid(spec) if os.geteuid() == 0 else os.geteuid()

    def prepare(self, spec: SandboxSpec, report: Callable[[str], None]) -> None:
        """Nothing to fetch: a process sandbox runs on the host's own root, not an image."""

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        if not spec.command:
            raise DriverError(f"sandbox {spec.allocation_key}: the process driver needs a command")
        self._refuse_unsafe(spec)  # before any cgroup or state file is made
        with self._locked():
            state = self._load(spec.allocation_key)
            if state is not None:
                # Idempotent: a repeated launch finds the sandbox, running or exited (its
                # exit code stays readable until stop() clears it).
                return self._handle(state)
            return self._spawn(spec)

    def _spawn(self, spec: SandboxSpec) -> SandboxHandle:
        # Before anything is made: a missing node or an unreachable MPS daemon fails the
        # launch with nothing to clean up.
        nodes = self._device_nodes(spec)
        if spec.mps is not None:
            require_mps_pipe(spec.mps.pipe_dir, self._run_uid(spec), real_gpu=spec.real_gpu)
        # bwrap binds as the sandbox's uid: it needs a way through every folder above them.
        bound = storage.resolve(
            self.storage_dir, spec.mounts, bound_by_sandbox=True, folder=spec.checkpoint_dir
        )
        if spec.app:
            app_socket.make_dir(
                self.apps_dir, spec.allocation_key, self._run_uid(spec), bound_by_sandbox=True
            )
        binds = self._binds(spec, bound)
        limits = self._choose_limits(spec)
        output_dir = self._output_dir(spec.allocation_key)
        status_path = self._path(spec.allocation_key, "status")
        drop = []
        if os.geteuid() == 0:
            uid = str(self._run_uid(spec))
            groups = ["--groups", ",".join(map(str, spec.groups()))] if spec.groups() else ["--clear-groups"]
            drop = ["setpriv", "--reuid", uid, "--regid", uid, *groups, "--"]
        fds: list[int] = []
        try:
            for content in (_PASSWD.encode(), _GROUP.encode(), None, seccomp.bpf_program()):
                if content is None:
                    fds.append(os.open(status_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
                    continue
                fd = os.memfd_create("gpushare-sandbox", 0)  # bwrap reads it: no file on disk
                fds.append(fd)
                os.write(fd, content)
                os.lseek(fd, 0, os.SEEK_SET)
            bwrap = self._bwrap_args(spec, fds[0], fds[1], fds[2], fds[3], nodes, binds)
            argv = [
                "/bin/sh", "-c", _JOIN_AND_WAIT, "gpushare-sandbox", *limits.procs_files, "--",
                *drop, *limits.prlimit, *bwrap,
            ]  # fmt: skip
            # stdout and stderr go through a pipe to the capped writer (workers/drivers/
            # output.py), never straight to a file: a tenant printing without end would fill
            # the host's disk. The writer has a session of its own, so it outlives the agent.
            read_end, write_end = os.pipe()
            fds += [read_end, write_end]
            subprocess.Popen(  # noqa: S603 - argv built here, no shell input
                [sys.executable, "-I", "-S", _OUTPUT_WRITER, str(output_dir), str(self.output_cap)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                cwd="/",
                env={"PATH": _BASE_PATH},
            )
            proc = subprocess.Popen(  # noqa: S603 - argv built here, no shell input
                argv,
                stdin=subprocess.DEVNULL,
                stdout=write_end,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=fds[:4],
                cwd="/",
                env={"PATH": _BASE_PATH},
            )
        except OSError as exc:
            remove_cgroups(limits.cgroups)
            raise DriverError(f"cannot start sandbox {spec.allocation_key}: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        started = time.time()
        stat = procfs.proc_stat(proc.pid)
        info = self._wait_for_setup(spec.allocation_key, proc, output_dir)
        if stat is None or info is None:
            remove_cgroups(limits.cgroups)
            tail = self._output_text(output_dir)[-2000:].strip()
            status_path.unlink(missing_ok=True)
            shutil.rmtree(output_dir, ignore_errors=True)
            raise DriverError(f"sandbox {spec.allocation_key} failed to start: {tail or 'no output'}")
        self._children[spec.allocation_key] = proc
        state = {
            "allocation_key": spec.allocation_key,
            "sandbox_id": spec.sandbox_id,
            "pid": proc.pid,
            "start_ticks": stat[1],
            "started_at_ms": int(started * 1000),
            "child_pid": info["child-pid"],
            "child_start_ticks": info["child-start-ticks"],
            "pidns": f"pid:[{info['pid-namespace']}]",
            "limits": limits.mode,
            "cgroups": list(limits.cgroups),
            "procs_files": list(limits.procs_files),
            "prlimit": list(limits.prlimit),
            "spec": spec.to_json(),
        }
        self._save(state)
        log.info(
            "launched sandbox %s as pid %d (bwrap, limits: %s)",
            spec.allocation_key, proc.pid, limits.mode,
        )  # fmt: skip
        return self._handle(state)

    def _wait_for_setup(
        self, allocation_key: str, proc: subprocess.Popen[bytes], output_dir: Path
    ) -> dict[str, Any] | None:
        """bwrap's first status document once the sandbox is set up; None if setup failed.

        bwrap reports the sandbox's pid as soon as it clones, before the mounts, and forks
        the command only after them: setup is done once anything besides bwrap's own init
        runs in the new pid namespace. A command that exits before we look is told from a
        failed setup (or exec) by bwrap's "bwrap: ..." error in the log.
        """
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            wrapper_done = proc.poll() is not None
            docs = self._status_lines(allocation_key)
            if docs and "child-pid" in docs[0]:
                info = docs[0]
                members = procfs.pids_in_namespace(f"pid:[{info['pid-namespace']}]")
                init = procfs.proc_stat(info["child-pid"])
                if init is not None and any(pid != info["child-pid"] for pid in members):
                    return {**info, "child-start-ticks": init[1]}
                if any("exit-code" in doc for doc in docs):
                    lines = self._output_text(output_dir).splitlines()
                    failed = any(x.startswith("bwrap: ") for x in lines)
                    return None if failed else {**info, "child-start-ticks": -1}
            if wrapper_done:
                return None
            time.sleep(_POLL_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None

    # -- stop / status / list --

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        with self._locked():
            state = self._load(handle.allocation_key)
        if state is None:
            return
        # Outside the lock: one sandbox's grace period must not hold up every launch.
        if self._running(state):
            self._terminate(state, grace_s)
        with self._locked():
            current = self._load(handle.allocation_key)
            if current is None or current["pid"] != state["pid"]:
                return  # a concurrent stop got there first
            remove_cgroups(tuple(state["cgroups"]))
            for suffix in ("json", "status"):
                self._path(handle.allocation_key, suffix).unlink(missing_ok=True)
            shutil.rmtree(self._output_dir(handle.allocation_key), ignore_errors=True)
            app_socket.remove_dir(self.apps_dir, handle.allocation_key)
            self._children.pop(handle.allocation_key, None)
            log.info("stopped sandbox %s", handle.allocation_key)

    def warn(self, handle: SandboxHandle) -> str:
        with self._locked():
            state = self._load(handle.allocation_key)
        if state is None or not self._running(state):
            return "the sandbox is no longer running"
        commands = [p for p in self._sandbox_members(state) if p != state["child_pid"]]
        procfs.signal_all(commands, signal.SIGTERM)  # not bwrap's init: see _terminate
        return f"SIGTERM sent to its {len(commands)} process(es)"

    @staticmethod
    def _sandbox_members(state: dict[str, Any]) -> list[int]:
        # Namespace inodes are reused once a namespace dies: trust the recorded one only
        # while the namespace's init, which holds it, is the process we recorded.
        if not procfs.alive(state["child_pid"], state["child_start_ticks"]):
            return []
        return procfs.pids_in_namespace(state["pidns"])

    def _terminate(self, state: dict[str, Any], grace_s: float) -> None:
        # SIGTERM goes to the sandbox's own processes, not to the wrapper's group: the
        # outer bwrap would die at once and take the sandbox down with SIGKILL, giving the
        # command no chance to clean up. The namespace's init (bwrap) ignores it, then
        # exits with the command's status.
        members = self._sandbox_members(state)
        procfs.signal_all([p for p in members if p != state["child_pid"]], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._running(state):
            time.sleep(_POLL_S)
        if self._running(state):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(state["pid"], signal.SIGKILL)
            procfs.signal_all(self._sandbox_members(state), signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and self._running(state):
                time.sleep(_POLL_S)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        state = self._load(handle.allocation_key)
        if state is None:
            return SandboxStatus(state="missing")
        started = state.get("started_at_ms")
        if self._running(state):
            return SandboxStatus(state="running", started_at_ms=started)
        code = next(
            (d["exit-code"] for d in reversed(self._status_lines(handle.allocation_key))
             if "exit-code" in d),
            None,
        )  # fmt: skip
        reason = None
        if oom_kills(tuple(state.get("cgroups") or ())):
            reason = "out of memory: killed at the memory limit"
        return SandboxStatus(state="exited", exit_code=code, started_at_ms=started, reason=reason)

    def pids(self, handle: SandboxHandle) -> list[int]:
        """Host pids of the sandbox's processes, to attribute GPU memory NVML reports by pid."""
        state = self._load(handle.allocation_key)
        if state is None or not self._running(state):
            return []
        return self._sandbox_members(state)

    def list_owned(self) -> list[SandboxHandle]:
        """Every sandbox with a state file, exited ones included (status says which)."""
        handles = []
        for path in sorted(self.state_dir.glob("*.json")):
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                log.warning("ignoring unreadable sandbox state %s", path)
                continue
            if not isinstance(state, dict) or "allocation_key" not in state:
                # Another driver's file (the state-only driver's, after SANDBOX_DRIVER changed).
                log.warning("ignoring %s: not a process sandbox's state", path)
                continue
            if self.host and state["spec"].get("host") != self.host:
                continue
            handles.append(self._handle(state))
        return handles

    # -- terminal --

    def open_app(self, handle: SandboxHandle) -> app_socket.SocketStream:
        return app_socket.connect(self.apps_dir, handle.allocation_key)

    def _running_state(self, handle: SandboxHandle) -> tuple[dict[str, Any], SandboxSpec]:
        state = self._load(handle.allocation_key)
        if state is None or not self._running(state) or not self._sandbox_members(state):
            raise DriverError(f"sandbox {handle.allocation_key} is not running")
        return state, SandboxSpec.from_json(state["spec"])

    @staticmethod
    def _entered(state: dict[str, Any], spec: SandboxSpec, command: list[str]) -> list[str]:
        """The argv that runs ``command`` inside the running sandbox, with its batch's
        confinement (enter_sandbox.py)."""
        uid = str(SANDBOX_UID)
        groups = ",".join(map(str, spec.groups())) if os.geteuid() == 0 else "-"  # its storage's
        return [
            *state["prlimit"], sys.executable, "-I", _ENTER_SANDBOX, str(state["child_pid"]), uid, uid,
            groups, SANDBOX_HOME, *state["procs_files"], "--", *command,
        ]  # fmt: skip

    def exec_terminal(self, handle: SandboxHandle) -> ProcessTerminal:
        state, spec = self._running_state(handle)
        argv = self._entered(state, spec, ["/bin/sh", "-i"])
        env = {**self._sandbox_env(spec), "TERM": "xterm-256color"}
        return ProcessTerminal.spawn(argv, handle.allocation_key, env=env, cwd="/")

    def open_ssh(self, handle: SandboxHandle, authorized_keys: list[str]) -> sshd.PipedServer:
        """sshd inside the sandbox as its user (workers/drivers/sshd.py): the host's own, which
        the sandbox sees in its read-only /usr."""
        if not os.access(sshd.SSHD, os.X_OK):
            raise DriverError(
                f"this host has no OpenSSH server ({sshd.SSHD}) for its process sandboxes: "
                f"{install_command('openssh-server')} (its daemon need not run)"
            )
        state, spec = self._running_state(handle)
        environment = self._sandbox_env(spec)
        server = sshd.Server.for_keys(authorized_keys, environment)
        argv = self._entered(state, spec, server.argv)
        return sshd.PipedServer.spawn(argv, handle.allocation_key, env={**environment, **server.env}, cwd="/")
