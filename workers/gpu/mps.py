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
to the daemon found through ``CUDA_MPS_PIPE_DIRECTORY`` and prints its answers. The daemon
writes ``nvidia-cuda-mps-control.pid`` into that directory, which is how a running one is
recognised, so ``start`` is idempotent across agent restarts.

Lifetime. Where systemd runs (and the agent is root), each daemon starts as a transient
unit of its own, ``gpushare-mps-<device_key>.service`` (``systemd-run``), outside the agent
service's cgroup: stopping or restarting the agent (``KillMode=mixed`` kills what is left in
its cgroup) no longer kills the daemons and the MPS servers under running sandboxes (review
finding 4). A restarted agent adopts a daemon it finds (pid file, and the daemon answers on
its control socket) rather than start a second. Without systemd (development, tests) the
daemon starts directly, stays in whatever cgroup the agent runs in, and a service manager
that kills that cgroup kills it too; the agent logs so once.

Compute mode. With ``MPS_EXCLUSIVE_PROCESS=true`` (default false) a whole GPU is set to
EXCLUSIVE_PROCESS before its daemon starts, and back to DEFAULT once it stopped, as NVIDIA's
multi-user recipe does (MPS docs, "Appendix: Common Tasks"): the MPS server then holds the
GPU's one context, and a client that cannot reach the daemon (a pipe directory it cannot
enter, say) fails instead of quietly running without MPS and without limits. A driver
setting, changed through NVML (``ComputeMode``); MIG devices are left alone (the mode is
the whole GPU's).
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

import pynvml

from wire import uids
from wire.spec import MpsShare
from workers.drivers import tenant_paths
from workers.gpu.nvml_session import NvmlDidNotStart, nvml_session

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


class ComputeMode(Protocol):
    """Sets a whole GPU's compute mode: the seam between the manager and NVML."""

    def exclusive_process(self, gpu_uuid: str) -> None: ...

    def default(self, gpu_uuid: str) -> None: ...


class NvmlComputeMode:
    """``nvmlDeviceSetComputeMode`` (root); what ``nvidia-smi -c`` does. MpsError on failure."""

    def exclusive_process(self, gpu_uuid: str) -> None:
        self._set(gpu_uuid, "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS")

    def default(self, gpu_uuid: str) -> None:
        self._set(gpu_uuid, "NVML_COMPUTEMODE_DEFAULT")

    @staticmethod
    def _set(gpu_uuid: str, mode: str) -> None:
        try:
            with nvml_session():
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
                pynvml.nvmlDeviceSetComputeMode(handle, getattr(pynvml, mode))
        except (NvmlDidNotStart, pynvml.NVMLError) as exc:
            raise MpsError(f"compute mode of {gpu_uuid} not set to {mode}: {exc}") from exc


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
        exclusive_process: bool = False,
        compute_mode: ComputeMode | None = None,
    ) -> None:
        self.root = Path(root)  # mps_root(): holds <key>/pipe and <key>/log per device
        self.control_binary = control_binary
        self._clock = clock
        self._runner = runner
        # Daemons as units of their own (they outlive the agent), or as the agent's children.
        self.systemd = systemd_runs() if systemd is None else systemd
        # EXCLUSIVE_PROCESS while a whole GPU's daemon runs: the operator's choice (None: read
        # MPS_EXCLUSIVE_PROCESS), through NVML unless a test gives its own ComputeMode.
        self.exclusive_process = exclusive_process
        self._compute_mode = compute_mode
        self._lock = threading.RLock()
        self._known: set[str] = set()  # devices whose daemon this manager started or adopted
        self._warned = False

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
        """A daemon runs for this device: its pid file names a live process."""
        return self._daemon_pid(device_uuid) is not None

    def start(self, device_uuid: str) -> bool:
        """Start the device's daemon unless one runs; True when this call started it.

        MpsError when the binary fails or the daemon does not come up in ``START_TIMEOUT_S``.
        """
        with self._lock:
            pid = self._daemon_pid(device_uuid)
            if pid is not None:
                if device_uuid not in self._known:
                    self._adopt(device_uuid, pid)
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
            self._exclusive(device_uuid)  # before the daemon, as NVIDIA's recipe has it
            try:
                self._spawn_daemon(device_uuid)
                deadline = self._clock() + START_TIMEOUT_S
                while not self.running(device_uuid):
                    if self._clock() > deadline:
                        raise MpsError(
                            f"MPS daemon for {device_uuid} did not come up in {START_TIMEOUT_S:.0f} s"
                        )
                    time.sleep(0.05)
            except MpsError:
                with contextlib.suppress(MpsError):
                    self._restore_mode(device_uuid)
                raise
            self._known.add(device_uuid)
            log.info("started MPS control daemon for %s", device_uuid)
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
        quitting under running clients ends their MPS server with them. Also puts back the
        compute mode a daemon that died (killed, crashed) left behind."""
        with self._lock:
            pid = self._daemon_pid(device_uuid)
            if pid is None:
                self._restore_mode(device_uuid)
                return False
            self.command(device_uuid, "quit")
            deadline = self._clock() + STOP_TIMEOUT_S
            while _alive(pid):
                if self._clock() > deadline:
                    raise MpsError(
                        f"MPS daemon {pid} for {device_uuid} did not quit in {STOP_TIMEOUT_S:.0f} s"
                    )
                time.sleep(0.05)
            with contextlib.suppress(OSError):  # unlink follows nothing; a planted folder stays
                (self.pipe_dir(device_uuid) / PID_FILE).unlink(missing_ok=True)
            self._known.discard(device_uuid)
            log.info("stopped MPS control daemon for %s", device_uuid)
            self._restore_mode(device_uuid)  # MpsError: the next sandbox must not meet it
            return True

    def _exclusive(self, device_uuid: str) -> None:
        """EXCLUSIVE_PROCESS for a whole GPU when the operator asked for it; the mark in its
        directory says we set it, so whoever stops the daemon (a later agent, the setting
        since turned off) puts DEFAULT back."""
        if not self.exclusive_process:
            return
        if not device_uuid.startswith("GPU-"):
            log.info("MPS on %s: compute mode is the whole GPU's, left as it is", device_uuid)
            return
        (self._compute_mode or NvmlComputeMode()).exclusive_process(device_uuid)
        (self._device_dir(device_uuid) / EXCLUSIVE_MARK).touch()
        log.info("compute mode of %s: EXCLUSIVE_PROCESS, for its MPS daemon", device_uuid)

    def _restore_mode(self, device_uuid: str) -> None:
        mark = self._device_dir(device_uuid) / EXCLUSIVE_MARK
        if not mark.exists():
            return
        (self._compute_mode or NvmlComputeMode()).default(device_uuid)
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
        runs as that device's uid (``uids.mps_uid``), so a root agent gives the pipe
        directory to that uid alone (0700); the directories above it are 0711, traversable
        but not listable, and the log directory stays the agent's (the daemon writes the
        logs, its servers send their lines through the pipe directory). A non-root agent's
        sandboxes run as the agent's own uid, which owns everything already.
        """
        self.root.parent.mkdir(parents=True, exist_ok=True)
        for directory in (self.root, self._device_dir(device_uuid)):
            _make_dir(directory, 0o711)
        _claim_key(self._device_dir(device_uuid), device_uuid)
        pipe, logs = self._dirs(device_uuid)
        _make_dir(logs, 0o700)
        _make_dir(pipe, 0o700)
        if os.geteuid() == 0:
            client = uids.mps_uid(device_uuid)
            os.chown(pipe, client, client)

    def _dirs(self, device_uuid: str) -> tuple[Path, Path]:
        return self.pipe_dir(device_uuid), self.log_dir(device_uuid)

    def _daemon_pid(self, device_uuid: str) -> int | None:
        """The pid the daemon wrote in its pipe directory, where the device's tenants write too:
        read only from a file the agent's uid (the daemon's) made, never through a link, and
        never waiting on a FIFO planted in its place."""
        try:
            folder = tenant_paths.open_folder(self.pipe_dir(device_uuid))
        except OSError:
            return None
        try:
            text = tenant_paths.read_file(folder, PID_FILE, PID_FILE, owner=os.geteuid(), limit=32)
            pid = int(text.strip())
        except (OSError, ValueError):
            return None  # none, being written, garbage or planted: not a daemon we can talk to
        finally:
            os.close(folder)
        return pid if pid > 0 and _alive(pid) else None

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


class SimulatedMps(MpsManager):
    """The MPS control daemons of a simulated host: no binary and no GPU, the same lifecycle.

    ``start``, ``stop`` and ``running`` behave as the real manager's: idempotent, and a
    daemon outlives the agent that started it (a marker file in the device's directory
    stands in for the daemon's pid file), so an agent restart finds it up as it would a
    real one. Each start and stop is kept in ``history`` for whoever follows a GPU's
    daemon (the tests). The server limits a daemon was given are kept beside its marker
    (``limits``), and go with it. Other commands fail as they would on a host without the
    NVIDIA driver.
    """

    MARKER = "simulated-daemon"
    LIMITS = "simulated-limits"

    def __init__(self, root: Path | str) -> None:
        super().__init__(root, systemd=False, exclusive_process=False)
        self.history: list[tuple[str, str]] = []  # ("start" | "stop", device uuid), in order

    def running(self, device_uuid: str) -> bool:
        return (self._device_dir(device_uuid) / self.MARKER).exists()

    def start(self, device_uuid: str) -> bool:
        with self._lock:
            if self.running(device_uuid):
                return False
            pipe = self.pipe_dir(device_uuid)
            pipe.mkdir(parents=True, exist_ok=True)
            _claim_key(self._device_dir(device_uuid), device_uuid)
            # The mount is real: the sandbox's uid must be able to traverse down to it (mkdir's
            # mode is cut by the umask).
            for directory in (pipe, *pipe.parents):
                if directory == self.root.parent:
                    break
                directory.chmod(0o755)
            (self._device_dir(device_uuid) / self.MARKER).write_text(f"{os.getpid()}\n")
            self.history.append(("start", device_uuid))
            log.info("simulated MPS control daemon for %s started", device_uuid)
            return True

    def stop(self, device_uuid: str) -> bool:
        with self._lock:
            if not self.running(device_uuid):
                return False
            (self._device_dir(device_uuid) / self.MARKER).unlink(missing_ok=True)
            (self._device_dir(device_uuid) / self.LIMITS).unlink(missing_ok=True)
            self.history.append(("stop", device_uuid))
            log.info("simulated MPS control daemon for %s stopped", device_uuid)
            return True

    def set_server_limits(self, device_uuid: str, thread_pct: int, memory_mib: int) -> None:
        if not self.running(device_uuid):
            raise MpsError(f"no MPS daemon runs for {device_uuid}")
        (self._device_dir(device_uuid) / self.LIMITS).write_text(f"{int(thread_pct)} {int(memory_mib)}\n")

    def limits(self, device_uuid: str) -> tuple[int, int] | None:
        """(thread %, pinned MiB) the device's daemon holds its clients to; None when unset."""
        try:
            pct, mib = (self._device_dir(device_uuid) / self.LIMITS).read_text().split()
        except FileNotFoundError:
            return None
        return int(pct), int(mib)

    def clients(self, device_uuid: str) -> dict[int, list[int]]:
        """A simulated daemon serves no CUDA process: no server, no client (a fault on a
        simulated GPU finds nothing to recover, as on a GPU whose clients all exited)."""
        if not self.running(device_uuid):
            raise MpsError(f"no MPS daemon runs for {device_uuid}")
        return {}


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


def _make_dir(path: Path, mode: int) -> None:
    """Create ``path`` with ``mode`` (the umask cannot narrow it), or set it on one that exists.
    By name, safely: every one of these lies in a directory only the agent writes (the pipe
    directory is the tenants', but its own name is in the device's 0711 directory)."""
    path.mkdir(mode=mode, exist_ok=True)
    os.chmod(path, mode)


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
