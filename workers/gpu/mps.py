"""MPS control daemons, one per GPU (or MIG device), for sandboxes that share it by MPS.

Each device gets its own ``nvidia-cuda-mps-control`` daemon, started with
``CUDA_VISIBLE_DEVICES`` set to that device's UUID and its own pipe and log directories
(``<mps_root>/<device_key>/{pipe,log}``, see ``mps_root``), so a client can only reach the
daemon of the device it was given, and stopping one device's daemon leaves the others alone.
Sandboxes get the pipe directory (``MpsShare.pipe_dir``); the drivers mount it and set
``CUDA_MPS_*`` from the share.

Everything goes through the control binary as NVIDIA documents it (``man
nvidia-cuda-mps-control``): ``-d`` starts the daemon in the background; commands are lines
written to the binary's stdin (``echo quit | nvidia-cuda-mps-control``), which forwards them
to the daemon found through ``CUDA_MPS_PIPE_DIRECTORY`` and prints its answers.

Which process is the daemon (issue 36; review 3, §1.1 item 2). The daemon writes
``nvidia-cuda-mps-control.pid`` into its pipe directory, where the GPU's tenants write too:
a tenant who removed or forged it made the agent start a second daemon over the first, or
wait in ``stop`` on a process of its choosing. So that file is never the daemon's identity.
Under systemd the daemon is its unit's ``MainPID`` (``systemctl show -p MainPID``); without
systemd, the pid the agent found right after its own ``-d`` returned (read once, from a
file only root can have made in the sticky pipe directory), kept with the process's start
time in the device's ``state`` directory (root's, 0700, never bound into a sandbox), so a
restarted agent still adopts it and a reused pid is not taken for it. Either way ``start``
is idempotent across agent restarts.

Pipe directory: ``root:<the GPU's MPS gid>``, mode 1770 (sticky). The MPS server runs as the
GPU's MPS uid and makes its sockets there (group rwx); root's ``control`` socket and pid
file can be removed by nobody else (the sticky bit), where the earlier ``<mps uid>`` 0700
let any tenant unlink ``control`` and send every later CUDA process of every tenant on the
GPU past MPS.

Lifetime. Where systemd runs (and the agent is root), each daemon starts as a transient
unit of its own, ``gpushare-mps-<device_key>.service`` (``systemd-run``), outside the agent
service's cgroup: stopping or restarting the agent (``KillMode=mixed`` kills what is left in
its cgroup) no longer kills the daemons and the MPS servers under running sandboxes (review
finding 4). A restarted agent adopts a daemon it finds (pid file, and the daemon answers on
its control socket) rather than start a second. Without systemd (development, tests) the
daemon starts directly, stays in whatever cgroup the agent runs in, and a service manager
that kills that cgroup kills it too; the agent logs so once.

Compute mode: MPS is enforced. A CUDA client that does not reach the daemon (its tenant
unset or changed ``CUDA_MPS_PIPE_DIRECTORY``) "continues to run as it normally would without
MPS": the whole device, every SM, any memory, past every server limit. Only
EXCLUSIVE_PROCESS closes that: the MPS server then holds the device's one context, and such a
client gets none. So every GPU or MIG device whose daemon runs is set to EXCLUSIVE_PROCESS
before the daemon starts (NVIDIA's multi-user recipe, MPS docs "Appendix: Common Tasks";
k8s-device-plugin does it unconditionally), read back after every start and every adoption,
and set back to DEFAULT once the daemon stopped (a dedicated sandbox runs several processes).
A MIG device is set on its own handle (nvml.h: "If MIG is enabled on a GPU, device must be MIG
device handle"). It goes through the GPU backend (``ComputeModes``: ``NvmlBackend``, or the
simulated one). A device that cannot be set, reads back anything else, or fails to answer
starts no daemon and serves no share: ``MpsNotEnforced`` says why, and the launch fails
with it. The one way round is ``enforce=False``, for the ``gpu``-marked tests on a lent GPU,
whose compute mode must never change; the agent never passes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from wire import uids
from wire.spec import MpsShare
from workers.drivers import tenant_paths
from workers.gpu import posix_acl
from workers.gpu.base import COMPUTE_DEFAULT, COMPUTE_EXCLUSIVE_PROCESS, GpuBackendError

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the daemon into its pipe directory
CONTROL_SOCKET = "control"  # the daemon's UNIX socket in the pipe directory
DEVICE_FILE = "device"  # in the device's directory: the UUID it belongs to
SOCKET_PATH_MAX = 108  # sun_path of struct sockaddr_un on Linux, NUL included
# With CUDA_VISIBLE_DEVICES naming one device, the daemon sees it as device 0: the <dev>
# argument of the memory-limit commands counts visible devices, not host indices.
DEVICE_INDEX = 0
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 2.0  # SIGKILL of a daemon that did not quit (restart)
COMMAND_TIMEOUT_S = 15.0
SYSTEMD_RUN = "systemd-run"
UNIT_PREFIX = "gpushare-mps-"  # + device_key(uuid): the daemon's transient systemd unit
EXCLUSIVE_MARK = "compute-mode-exclusive"  # in the device's directory: set by us, to undo
STATE_DIR = "state"  # in the device's directory: root's 0700, what only the agent may say
DAEMON_STATE = "daemon"  # in STATE_DIR: "<pid> <start time>" of a daemon started without systemd
SYSTEMCTL = "systemctl"
START_LOG = "start.log"  # in the log directory: what ``-d`` printed before it forked
# How the manager runs the control binary (and systemd-run): subprocess.run's signature, a seam
# for tests that check command lines.
Runner = Callable[..., "subprocess.CompletedProcess[Any]"]


def mps_root(var_dir: Path, configured: str = "") -> Path:
    """Where a host's MPS pipe and log directories live: ``configured`` (``MPS_DIR``) when set; else, for an
    agent running as root, ``/run/gpushare/mps``: sandboxes run as unprivileged uids that must
    traverse every directory above the pipe directory bwrap binds (a checkout under /root,
    0700, would hide it), and the short path keeps ``<pipe>/control`` within a UNIX socket's
    107 bytes whatever the hostname (``/run/gpushare/mps/<8 hex>/pipe/control`` is 38 bytes;
    the host's name in it made any hostname over 18 characters refuse every share, review
    finding 6). A non-root agent's sandboxes run as its own uid: ``<var_dir>/mps``. The host's
    name is not in the path: GPU UUIDs are unique to a host already, simulated ones included."""
    if configured:
        return Path(configured)
    return Path("/run/gpushare/mps") if os.geteuid() == 0 else var_dir / "mps"


def device_key(device_uuid: str) -> str:
    """The short name of a device's directory (and of its systemd unit): 8 hex digits of the
    UUID's SHA-256. A UUID (40 characters for a GPU, 41 for a MIG device) would take a third
    of the socket path's budget; ``DEVICE_FILE`` in the directory names the device, so two
    UUIDs meeting on one key (one pair in 4 billion) are refused, never mixed up."""
    return hashlib.sha256(device_uuid.encode()).hexdigest()[:8]


def systemd_runs() -> bool:
    """systemd is this host's init (``sd_booted``) and can be asked for units: root, with
    ``systemd-run`` installed."""
    return (
        os.geteuid() == 0 and Path("/run/systemd/system").is_dir() and shutil.which(SYSTEMD_RUN) is not None
    )


class MpsError(RuntimeError):
    """An MPS daemon did not start, stop or answer as asked."""


class MpsNotEnforced(MpsError):
    """The device's MPS shares cannot be enforced (its compute mode is not, or cannot be made,
    EXCLUSIVE_PROCESS): no share may start there; the message says why."""


class ComputeModes(Protocol):
    """The compute-mode half of the GPU backend (``GpuBackend.compute_mode`` and
    ``set_compute_mode``): NVML on a GPU host, the simulated backend's model elsewhere."""

    def compute_mode(self, uuid: str) -> str: ...

    def set_compute_mode(self, uuid: str, mode: str) -> None: ...


class MpsManager:
    """Start, configure, query and stop per-device MPS control daemons.

    Methods take the device UUID as the sandbox specs carry it (``GPU-...`` or ``MIG-...``).
    One lock per manager: a start racing a stop on the same device would leave a daemon
    nobody tracks.
    """

    def __init__(
        self,
        root: Path | str,
        control_binary: str = CONTROL_BINARY,
        clock: Callable[[], float] = time.monotonic,
        runner: Runner = subprocess.run,
        systemd: bool | None = None,
        compute_modes: ComputeModes | None = None,
        enforce: bool = True,
        enforced_elsewhere: bool = False,
    ) -> None:
        """``enforced_elsewhere``: another engine runs the GPUs' MPS (a Slurm node's is
        Slurm's), so compute modes left alone here are no hole to warn of."""
        self.root = Path(root)  # mps_root(): holds <key>/pipe and <key>/log per device
        self.control_binary = control_binary
        self._clock = clock
        self._runner = runner
        # Daemons as units of their own (they outlive the agent), or as the agent's children.
        self.systemd = systemd_runs() if systemd is None else systemd
        # EXCLUSIVE_PROCESS on every device whose daemon runs, through the GPU backend. Without
        # a backend nothing can be enforced, and no daemon starts. enforce=False leaves compute
        # modes alone and so runs shares a tenant can escape: only for tests on a lent GPU.
        self._compute_modes = compute_modes
        self.enforce = enforce
        self._lock = threading.RLock()
        self._known: set[str] = set()  # devices whose daemon this manager started or adopted
        # device -> (pid, start time) of its daemon, as this manager last found it
        self._pids: dict[str, tuple[int, int]] = {}
        self._warned = False
        if not enforce and not enforced_elsewhere:
            log.warning("MPS compute modes left as they are: shares on this manager are not enforced")

    # -- paths and environment ----------------------------------------------------------------

    def pipe_dir(self, device_uuid: str) -> Path:
        return self._device_dir(device_uuid) / "pipe"

    def log_dir(self, device_uuid: str) -> Path:
        return self._device_dir(device_uuid) / "log"

    def _device_dir(self, device_uuid: str) -> Path:
        # Only the UUID's hash goes into the path, but an empty or odd one is a caller's bug.
        if not device_uuid or "/" in device_uuid or device_uuid in (".", "..") or "\0" in device_uuid:
            raise MpsError(f"not a device UUID: {device_uuid!r}")
        return self.root / device_key(device_uuid)

    def env(self, device_uuid: str) -> dict[str, str]:
        """The environment every call for this device runs in: daemon and commands alike."""
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = device_uuid
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir(device_uuid))
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir(device_uuid))
        return env

    def share(self, device_uuid: str, thread_pct: int, memory_mib: int) -> MpsShare:
        """What a sandbox on this device's daemon needs (see ``SandboxSpec.gpu_env``)."""
        if not 1 <= thread_pct <= 100:
            raise MpsError(f"active thread percentage must be 1..100, not {thread_pct}")
        if memory_mib < 1:
            raise MpsError(f"pinned memory limit must be at least 1 MiB, not {memory_mib}")
        return MpsShare(str(self.pipe_dir(device_uuid)), thread_pct, memory_mib)

    # -- lifecycle ---------------------------------------------------------------------------------

    def running(self, device_uuid: str) -> bool:
        """A daemon runs for this device: its unit's main process (systemd), or the process
        the agent recorded when it started it, is alive."""
        return self._daemon_pid(device_uuid) is not None

    def start(self, device_uuid: str) -> bool:
        """Start the device's daemon unless one runs; True when this call started it. Either
        way the device is left in EXCLUSIVE_PROCESS, read back, or nothing runs on it.

        MpsNotEnforced when the compute mode cannot be made EXCLUSIVE_PROCESS; MpsError when
        the binary fails or the daemon does not come up in ``START_TIMEOUT_S``.
        """
        with self._lock:
            pid = self._daemon_pid(device_uuid)
            if pid is not None:
                if device_uuid not in self._known:
                    self._adopt(device_uuid, pid)
                self._enforce(device_uuid)  # every share's start checks it, not only the first
                return False
            self._known.discard(device_uuid)
            socket_path = self.pipe_dir(device_uuid) / CONTROL_SOCKET
            if len(os.fsencode(socket_path)) >= SOCKET_PATH_MAX:
                # The daemon would fail to bind with a vague message; say why up front.
                raise MpsError(
                    f"MPS control socket {socket_path} is {len(os.fsencode(socket_path))} bytes, too "
                    f"long for a UNIX socket ({SOCKET_PATH_MAX - 1} at most): set MPS_DIR to a "
                    "shorter directory (the default for a root agent is /run/gpushare/mps)"
                )
            self._make_dirs(device_uuid)
            # Emptied: a pid file left by a daemon that died (host crash, kill -9) would hide
            # the new one, and whatever the device's tenants left there (they write in it) could
            # stand where the daemon makes its socket and pid file.
            self._clear_pipe_dir(device_uuid)
            self._forget(device_uuid)
            pid = None
            try:
                self._enforce(device_uuid)  # before the daemon, as NVIDIA's recipe has it
                self._spawn_daemon(device_uuid)
                deadline = self._clock() + START_TIMEOUT_S
                while (pid := self._started_pid(device_uuid)) is None:
                    if self._clock() > deadline:
                        raise MpsError(
                            f"MPS daemon for {device_uuid} did not come up in {START_TIMEOUT_S:.0f} s"
                        )
                    time.sleep(0.05)
                self._enforce(device_uuid, set_it=False)  # read back with the daemon up
            except MpsError:
                with contextlib.suppress(MpsError, OSError):
                    if pid is not None:
                        self._quit(device_uuid, pid)  # not left up on a device it cannot hold
                with contextlib.suppress(MpsError):
                    self._restore_mode(device_uuid)
                raise
            self._known.add(device_uuid)
            log.info("started MPS control daemon %d for %s", pid, device_uuid)
            return True

    def unit(self, device_uuid: str) -> str:
        """The daemon's transient systemd unit (where ``systemd`` is on)."""
        return f"{UNIT_PREFIX}{device_key(device_uuid)}.service"

    def _adopt(self, device_uuid: str, pid: int) -> None:
        """A daemon this manager did not start (an agent from before a restart did): take it
        on if it answers; one that does not would take clients in and serve none."""
        self._make_dirs(device_uuid)  # as this agent makes them: modes, owner, device name
        result = self._run(device_uuid, [], "get_server_list\n")
        if result.returncode != 0:
            raise MpsError(
                f"MPS daemon {pid} of {device_uuid} does not answer on its control socket "
                f"({(result.stderr or result.stdout).strip()}): stop it (kill {pid}) and launch again"
            )
        self._known.add(device_uuid)
        log.info("adopted the running MPS control daemon %d of %s", pid, device_uuid)

    def stop(self, device_uuid: str) -> bool:
        """Quit the device's daemon; False when none ran. Its clients should be gone first:
        quitting under running clients ends their MPS server with them. Puts the compute mode
        back to DEFAULT, also the one a daemon that died (killed, crashed) left behind."""
        with self._lock:
            pid = self._daemon_pid(device_uuid)
            if pid is None:
                self._restore_mode(device_uuid)
                return False
            self._quit(device_uuid, pid)
            log.info("stopped MPS control daemon for %s", device_uuid)
            self._restore_mode(device_uuid)  # MpsError: the next sandbox must not meet it
            return True

    def _quit(self, device_uuid: str, pid: int) -> None:
        """``quit`` to the daemon ``pid`` and wait until that process is gone."""
        self.command(device_uuid, "quit")
        deadline = self._clock() + STOP_TIMEOUT_S
        while _alive(pid):
            if self._clock() > deadline:
                raise MpsError(f"MPS daemon {pid} for {device_uuid} did not quit in {STOP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        with contextlib.suppress(OSError):  # unlink follows nothing; a planted folder stays
            (self.pipe_dir(device_uuid) / PID_FILE).unlink(missing_ok=True)
        self._known.discard(device_uuid)
        self._forget(device_uuid)

    # -- compute mode ------------------------------------------------------------------------------

    def _enforce(self, device_uuid: str, set_it: bool = True) -> None:
        """Make the device's compute mode EXCLUSIVE_PROCESS (unless ``set_it`` is False) and
        read it back; MpsNotEnforced, naming the device and what was found, when it is not.
        The mark in the device's directory says we set it, so whoever stops the daemon (a
        later agent included) puts DEFAULT back."""
        if not self.enforce:
            return
        refused = f"this MPS share cannot be enforced on {device_uuid}"
        modes = self._compute_modes
        if modes is None:
            raise MpsNotEnforced(f"{refused}: no GPU backend to set its compute mode to EXCLUSIVE_PROCESS")
        try:
            if set_it:
                # Marked also when it was EXCLUSIVE_PROCESS already: leaving MPS means DEFAULT.
                (self._device_dir(device_uuid) / EXCLUSIVE_MARK).touch()
                if modes.compute_mode(device_uuid) != COMPUTE_EXCLUSIVE_PROCESS:
                    modes.set_compute_mode(device_uuid, COMPUTE_EXCLUSIVE_PROCESS)
                    log.info("compute mode of %s: EXCLUSIVE_PROCESS, for its MPS daemon", device_uuid)
            found = modes.compute_mode(device_uuid)
        except GpuBackendError as exc:
            raise MpsNotEnforced(f"{refused}: compute mode not set to EXCLUSIVE_PROCESS ({exc})") from exc
        if found != COMPUTE_EXCLUSIVE_PROCESS:
            raise MpsNotEnforced(
                f"{refused}: compute mode is {found.upper()} after setting EXCLUSIVE_PROCESS (a tenant "
                "could run its CUDA past the MPS daemon, with the whole device and no limits)"
            )

    def _restore_mode(self, device_uuid: str) -> None:
        """DEFAULT again on a device we set to EXCLUSIVE_PROCESS (the mark says so): whatever
        runs there next (a dedicated sandbox's several processes) needs more than one context.
        MpsError when the backend refuses; the mark stays, so the next stop tries again."""
        mark = self._device_dir(device_uuid) / EXCLUSIVE_MARK
        if not self.enforce or not mark.exists():
            return
        if self._compute_modes is None:
            raise MpsError(f"compute mode of {device_uuid} not set back to DEFAULT: no GPU backend")
        try:
            self._compute_modes.set_compute_mode(device_uuid, COMPUTE_DEFAULT)
        except GpuBackendError as exc:
            raise MpsError(f"compute mode of {device_uuid} not set back to DEFAULT: {exc}") from exc
        mark.unlink(missing_ok=True)
        log.info("compute mode of %s: DEFAULT again", device_uuid)

    # -- commands ----------------------------------------------------------------------------------

    def command(self, device_uuid: str, line: str) -> str:
        """Send one command line to the device's daemon through the control binary's stdin;
        its answer, stripped. MpsError when no daemon runs or the binary fails."""
        if "\n" in line or "\r" in line:
            raise MpsError(f"one command per call, not {line!r}")
        if not self.running(device_uuid):
            raise MpsError(f"no MPS daemon runs for {device_uuid}")
        result = self._run(device_uuid, [], line + "\n")
        if result.returncode != 0:
            raise MpsError(
                f"MPS command {line!r} for {device_uuid} exited {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()}"
            )
        return result.stdout.strip()

    def set_default_active_thread_percentage(self, device_uuid: str, pct: int) -> None:
        """Default share of SMs for clients of servers started from now on (running servers
        keep theirs: MPS applies defaults when it spawns a server)."""
        if not 1 <= pct <= 100:
            raise MpsError(f"active thread percentage must be 1..100, not {pct}")
        self.command(device_uuid, f"set_default_active_thread_percentage {int(pct)}")

    def set_default_pinned_mem_limit(self, device_uuid: str, memory_mib: int) -> None:
        """Default device memory each client may pin, in MiB, for servers started from now on."""
        if memory_mib < 1:
            raise MpsError(f"pinned memory limit must be at least 1 MiB, not {memory_mib}")
        self.command(device_uuid, f"set_default_device_pinned_mem_limit {DEVICE_INDEX} {int(memory_mib)}M")

    def set_server_limits(self, device_uuid: str, thread_pct: int, memory_mib: int) -> None:
        """The limits the device's MPS server holds every client to, whatever the client's
        environment says: the defaults for a server spawned from now on, and each running
        server's own for the clients that connect to it from now on.

        NVIDIA: a client's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` "will only further constrain
        the limit set by the control daemon (via set_default_active_thread_percentage or
        set_active_thread_percentage ...). If the control daemon has a lower setting, the
        control daemon setting will be obeyed" (https://docs.nvidia.com/deploy/mps/latest/
        appendix-environment-variables.html); ``set_default_*`` "will only affect the next
        server" once one is spawned (.../mps/latest/mpsv2-interface.html), hence ``set_*``
        with each running server's pid too. Measured on an H200 (driver 580.159.04): with the
        server's default pinned memory limit set, a client that unset its environment still
        could not allocate past it; with the environment only, it could (3 GiB past a 1 GiB
        limit). A client keeps the limits it connected with: lowering them later binds only
        clients that come after. The limits are per client process, so a sandbox running
        several CUDA processes gets them once each."""
        if not 1 <= thread_pct <= 100:
            raise MpsError(f"active thread percentage must be 1..100, not {thread_pct}")
        if memory_mib < 1:
            raise MpsError(f"pinned memory limit must be at least 1 MiB, not {memory_mib}")
        self.set_default_active_thread_percentage(device_uuid, thread_pct)
        self.set_default_pinned_mem_limit(device_uuid, memory_mib)
        for server in self.server_pids(device_uuid):
            self.command(device_uuid, f"set_active_thread_percentage {server} {int(thread_pct)}")
            self.command(
                device_uuid, f"set_device_pinned_mem_limit {server} {DEVICE_INDEX} {int(memory_mib)}M"
            )

    def server_pids(self, device_uuid: str) -> list[int]:
        """PIDs of the MPS servers this daemon runs (``get_server_list``)."""
        return _pids(self.command(device_uuid, "get_server_list"))

    def client_pids(self, device_uuid: str, server_pid: int) -> list[int]:
        """PIDs of the clients of one server (``get_client_list <pid>``): CUDA processes of the
        sandboxes on this device, which the agent maps to sandboxes by their cgroups."""
        return _pids(self.command(device_uuid, f"get_client_list {int(server_pid)}"))

    def clients(self, device_uuid: str) -> dict[int, list[int]]:
        """Every server of the device's daemon with its clients."""
        return {server: self.client_pids(device_uuid, server) for server in self.server_pids(device_uuid)}

    # -- internals ---------------------------------------------------------------------------------

    def _make_dirs(self, device_uuid: str) -> None:
        """The daemon's directories, reachable by its clients and by no other sandbox.

        Clients connect to the control socket in the pipe directory, so they need to reach
        it: a client that cannot runs as if MPS did not exist, with no thread or memory
        limit (seen on an H200: uid 1000 against a root-only 0700 pipe directory got all
        132 SMs and any memory), and bwrap cannot even bind it. Every MPS client on a device
        runs as that device's uid and gid (``uids.mps_uid``). Its MPS server, which makes its
        sockets in the pipe directory, runs as that uid with gid 0 and no other group (the
        control daemon sets the uid alone; seen on an H200, where a directory only the MPS
        group could write left the server exiting at once and every client with error 805).
        A root agent makes the pipe directory ``root:<mps gid>`` 1770 with an ACL entry
        granting the MPS uid itself rwx: clients and server may enter and create, and the
        sticky bit keeps root's ``control`` socket and pid file from being removed or
        replaced by anyone but root. The directories above it are 0711, traversable but not
        listable; the log and
        state directories stay the agent's, 0700 (the daemon writes the logs, its servers
        send their lines through the pipe directory). A non-root agent's sandboxes run as
        the agent's own uid, which owns everything already.
        """
        self.root.parent.mkdir(parents=True, exist_ok=True)
        for directory in (self.root, self._device_dir(device_uuid)):
            _make_dir(directory, 0o711)
        _claim_key(self._device_dir(device_uuid), device_uuid)
        pipe, logs = self._dirs(device_uuid)
        _make_dir(logs, 0o700)
        _make_dir(self._device_dir(device_uuid) / STATE_DIR, 0o700)
        if os.geteuid() != 0:
            _make_dir(pipe, 0o1770, owner=(os.geteuid(), os.getegid()))
            return
        client = uids.mps_uid(device_uuid)
        _make_dir(pipe, 0o1770, owner=(0, client))
        try:
            posix_acl.grant_user(pipe, client)
        except OSError as err:
            raise MpsError(
                f"cannot grant the MPS uid {client} its pipe directory {pipe} through an ACL "
                f"({err.strerror}): MPS servers run as that uid with gid 0, so without it every "
                "client fails to connect; put MPS_DIR on a file system with POSIX ACLs (tmpfs "
                "and ext4 have them)"
            ) from err

    def _dirs(self, device_uuid: str) -> tuple[Path, Path]:
        return self.pipe_dir(device_uuid), self.log_dir(device_uuid)

    def _daemon_pid(self, device_uuid: str) -> int | None:
        """The device's live daemon: the one this manager last found, while that very process
        (pid and start time) lives; else the unit's main pid (systemd), or the one recorded in
        the root-only state directory. Never the pid file in the pipe directory, which the
        device's tenants could remove or forge."""
        known = self._pids.get(device_uuid)
        if known is not None and _start_time(known[0]) == known[1] and _alive(known[0]):
            return known[0]
        self._pids.pop(device_uuid, None)
        pid = self._main_pid(device_uuid) if self.systemd else self._recorded_pid(device_uuid)
        if pid is None or not _alive(pid):
            return None
        started = _start_time(pid)
        if started is not None:
            self._pids[device_uuid] = (pid, started)
        return pid

    def _main_pid(self, device_uuid: str) -> int | None:
        """``MainPID`` of the daemon's unit (0, or no such unit: none runs). With
        ``Type=forking`` systemd takes the process ``-d`` left behind as the main one."""
        argv = [SYSTEMCTL, "show", "-p", "MainPID", "--value", self.unit(device_uuid)]
        try:
            result = self._runner(
                argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"{' '.join(argv)}: {exc}") from exc
        text = (result.stdout or "").strip()
        if result.returncode != 0 or not text.isdigit():
            raise MpsError(f"{' '.join(argv)} exited {result.returncode}: {(result.stderr or text).strip()}")
        return int(text) or None

    def _recorded_pid(self, device_uuid: str) -> int | None:
        """The daemon this agent (or one before a restart) started without systemd, from the
        state directory, if that process (same pid, same start time) still lives."""
        try:
            pid, started = (int(word) for word in self._state_file(device_uuid).read_text().split())
        except (OSError, ValueError):
            return None
        return pid if pid > 0 and _start_time(pid) == started else None

    def _started_pid(self, device_uuid: str) -> int | None:
        """The daemon this manager just started, once it is up: under systemd its unit's main
        pid; else the pid it wrote in its pipe directory, read this once (a file owned by the
        agent's uid, which in the sticky directory no tenant can have made or replaced) and
        recorded in the state directory."""
        if self.systemd:
            return self._daemon_pid(device_uuid)
        try:
            folder = tenant_paths.open_folder(self.pipe_dir(device_uuid))
        except OSError:
            return None
        try:
            text = tenant_paths.read_file(folder, PID_FILE, PID_FILE, owner=os.geteuid(), limit=32)
            pid = int(text.strip())
        except (OSError, ValueError):
            return None  # not yet written (or being written)
        finally:
            os.close(folder)
        started = _start_time(pid) if pid > 0 and _alive(pid) else None
        if started is None:
            return None
        state = self._state_file(device_uuid)
        state.with_suffix(".tmp").write_text(f"{pid} {started}\n")
        state.with_suffix(".tmp").replace(state)
        self._pids[device_uuid] = (pid, started)
        return pid

    def _state_file(self, device_uuid: str) -> Path:
        return self._device_dir(device_uuid) / STATE_DIR / DAEMON_STATE

    def _forget(self, device_uuid: str) -> None:
        """The device's daemon is gone (or about to be replaced): no pid is its any more."""
        self._pids.pop(device_uuid, None)
        self._state_file(device_uuid).unlink(missing_ok=True)

    def _clear_pipe_dir(self, device_uuid: str) -> None:
        folder = tenant_paths.open_folder(self.pipe_dir(device_uuid))
        try:
            tenant_paths.remove_contents(folder)
        finally:
            os.close(folder)

    def _spawn_daemon(self, device_uuid: str) -> None:
        """Run ``<control> -d``, its output into ``start.log`` in the log directory.

        Never into pipes: the daemon it forks keeps the inherited stdout and stderr open, so
        reading them to their end (``capture_output``) waits as long as the daemon lives, and
        the start ran into its timeout although the daemon was up (review §3.1). A file has no
        end to wait for; what the binary said before it forked is read back from it."""
        argv = self._daemon_argv(device_uuid)
        output = self.log_dir(device_uuid) / START_LOG
        with output.open("ab") as sink:
            offset = sink.tell()
            try:
                result = self._runner(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=self.env(device_uuid),
                    timeout=COMMAND_TIMEOUT_S,
                    check=False,
                )
            except FileNotFoundError as err:
                raise MpsError(f"{argv[0]} not found: is the NVIDIA driver installed?") from err
            except subprocess.TimeoutExpired as err:
                raise MpsError(f"{' '.join(argv)} for {device_uuid} timed out") from err
        if result.returncode != 0:
            with output.open("rb") as said:
                said.seek(offset)
                text = said.read(4096).decode(errors="replace").strip()
            raise MpsError(f"{' '.join(argv)} for {device_uuid} exited {result.returncode}: {text}")

    def _daemon_argv(self, device_uuid: str) -> list[str]:
        """``<control> -d``; under systemd, inside a transient unit of its own. The unit's
        environment is only what ``--setenv`` gives (not the agent's); ``Type=forking``
        because ``-d`` returns once the daemon forked; ``--collect`` so a daemon that failed
        leaves no unit behind to block the name."""
        if not self.systemd:
            if os.geteuid() == 0 and not self._warned:
                self._warned = True
                log.warning(
                    "no systemd: MPS daemons start in the agent's own cgroup and die with the agent's "
                    "service when it is stopped or restarted"
                )
            return [self.control_binary, "-d"]
        env = self.env(device_uuid)
        names = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
        return [
            SYSTEMD_RUN,
            f"--unit={self.unit(device_uuid)}",
            f"--description=gpushare MPS control daemon of {device_uuid}",
            "--collect",
            "--quiet",
            "--property=Type=forking",
            *(f"--setenv={name}={env[name]}" for name in names),
            "--",
            shutil.which(self.control_binary) or self.control_binary,
            "-d",
        ]

    def _run(self, device_uuid: str, args: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
        try:
            return self._runner(
                [self.control_binary, *args],
                input=stdin,
                env=self.env(device_uuid),
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        except FileNotFoundError as err:
            raise MpsError(f"{self.control_binary} not found: is the NVIDIA driver installed?") from err
        except subprocess.TimeoutExpired as err:
            raise MpsError(f"{self.control_binary} {' '.join(args)} for {device_uuid} timed out") from err

    # -- fault recovery (workers.gpu.mps_recovery drives these) -------------------------------------

    def terminate_client(self, device_uuid: str, server_pid: int, client_pid: int) -> None:
        """``terminate_client <server pid> <client pid>``: NVIDIA's control command that ends one
        client's work on one server (``man nvidia-cuda-mps-control``). After a fault the
        server holds every client that shared it, and refuses new ones until they are gone."""
        self.command(device_uuid, f"terminate_client {int(server_pid)} {int(client_pid)}")

    def restart(self, device_uuid: str, servers: list[int] | None = None) -> None:
        """Quit and start the device's daemon: a faulted server that would not let go of its
        clients goes, and the next client gets a new one. ``quit`` waits for the servers'
        clients to finish, so a daemon that does not quit in ``STOP_TIMEOUT_S`` (or does not
        answer) is killed, with the MPS servers it listed (``servers``), checked by their
        command line to be NVIDIA's MPS processes before the signal; every client of a faulted
        server has lost its CUDA context already, so this costs no share anything more.
        Under systemd the daemon is its unit's main process: its end stops the unit, whose
        cgroup goes with it. MpsError when it cannot be stopped or started again."""
        with self._lock:
            try:
                self.stop(device_uuid)
            except MpsError as exc:
                log.warning("MPS daemon of %s did not quit (%s): killed with its servers", device_uuid, exc)
                self._kill_daemon(device_uuid, servers or [])
            self.start(device_uuid)
            log.info("MPS control daemon of %s restarted", device_uuid)

    def _kill_daemon(self, device_uuid: str, servers: list[int]) -> None:
        pid = self._daemon_pid(device_uuid)
        for victim in [*servers, *([pid] if pid is not None else [])]:
            if _is_mps_process(victim):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                log.warning("MPS process %d of %s killed", victim, device_uuid)
        deadline = self._clock() + KILL_TIMEOUT_S
        while pid is not None and _alive(pid):
            if self._clock() > deadline:
                raise MpsError(f"MPS daemon {pid} for {device_uuid} did not die in {KILL_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        self._known.discard(device_uuid)
        self._restore_mode(device_uuid)  # as a stop would; the start sets it again


def _claim_key(directory: Path, device_uuid: str) -> None:
    """Name the device in its directory, or refuse one another device's UUID named first."""
    named = directory / DEVICE_FILE
    try:
        owner = named.read_text().strip()
    except FileNotFoundError:
        named.write_text(device_uuid + "\n")
        return
    if owner != device_uuid:
        raise MpsError(f"{directory} belongs to {owner}, not {device_uuid}: their keys collide")


def _make_dir(path: Path, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Create ``path`` with ``mode`` (the umask cannot narrow it) and ``owner`` (uid, gid), or
    set them on one that exists. By name, safely: every one of these lies in a directory only
    the agent writes (the pipe directory is the tenants', but its own name is in the device's
    0711 directory). The mode last: chown may drop set-id bits."""
    path.mkdir(mode=mode & 0o777, exist_ok=True)
    if owner is not None:
        os.chown(path, *owner)
    os.chmod(path, mode)


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22):
    with the pid, what names one process; None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[-1].split()[19])
    except (IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but alive (a root daemon seen by a non-root agent)
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    """A daemon that exited but was not reaped yet still answers kill(0): read its state."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _is_mps_process(pid: int) -> bool:
    """``pid`` runs NVIDIA's MPS control daemon or server (their command line names
    ``nvidia-cuda-mps``): a pid the daemon listed, checked before it is killed, so that a
    pid reused meanwhile by another process is left alone."""
    try:
        return b"nvidia-cuda-mps" in Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def _pids(text: str) -> list[int]:
    """PIDs from a daemon's answer, one per line; other lines (messages) are skipped."""
    return [int(line) for line in (raw.strip() for raw in text.splitlines()) if line.isdigit()]
