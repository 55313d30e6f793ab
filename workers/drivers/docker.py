"""Docker sandbox driver: one locked-down container per allocation.

Every container runs as an unprivileged uid of its own, from the range no host account uses
(wire/uids.py: the engine maps no user namespace, so it is the host's uid too),
with all capabilities dropped, no-new-privileges, a
read-only root (writable size-limited tmpfs at /tmp and /home/sandbox), memory, CPU and
pids limits, and no network unless the spec allows it. GPUs are handed over with a device
request by GPU or MIG UUID, by CDI name where the host's CDI spec names the device, else
through the NVIDIA toolkit's hook (workers/drivers/docker_gpus.py says which works, and
why); on simulated hosts (``spec.real_gpu`` false) there is no device request and only the
``NVIDIA_VISIBLE_DEVICES`` variable says what the sandbox was given.

When the spec allows network the container joins the engine's default network. On hosts
whose engine runs with ``--bridge=none`` (the development machines do, to leave the host's
network alone) that default network has no bridge, so such a container still sees only
loopback.

Containers are named ``gpushare-<allocation_key>`` and labelled from ``spec.labels()``;
the name makes a concurrent double launch collide (409) instead of making two sandboxes,
and the labels let ``list_owned`` rebuild the agent's picture after a restart.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import requests.exceptions

# The SDK's own translation of ``containers.create``'s arguments into the engine's (private,
# and stable since docker-py 2): the driver calls the engine's create itself (``launch``).
from docker.models.containers import _create_container_args  # type: ignore[attr-defined]

from wire import uids
from wire.config import apps_root, storage_root
from wire.spec import LABEL_PREFIX, SandboxHandle, SandboxSpec
from workers.drivers import app_socket, image_pull, sshd, storage
from workers.drivers.base import DriverError, SandboxStatus, checked_pipe_dir, require_mps_pipe
from workers.drivers.docker_gpus import GpuPaths
from workers.drivers.docker_logs import ContainerLogReader, log_config
from workers.drivers.output import OutputChunk, cap_bytes
from workers.drivers.storage import BoundStorage

log = logging.getLogger(__name__)

SANDBOX_HOME = "/home/sandbox"
SANDBOX_TMP = "/tmp"  # noqa: S108 - the container's own tmpfs, not the host's /tmp
BUILD_HINT = "build it with scripts/build-sandbox-image.sh (or load it with docker load)"
ALLOCATION_LABEL = f"{LABEL_PREFIX}.allocation"
_PING_TIMEOUT_S = 2.0
_RACE_WAIT_S = 5.0
# Container states that still hold the sandbox's processes.
_LIVE_STATES = frozenset({"running", "paused", "restarting"})
# ``docker rm -f`` kills a container, then shows it "removing" until its files are gone. It
# did not exit, it is going: reporting it exited with the kill's code 137 turned a removal
# behind the platform's back into an ordinary stop whenever a report fell in that window (a
# loaded engine's seconds). One left "dead" by a failed removal still reports as exited, so
# that the stop reconcile sends cleans it up.
_BEING_REMOVED = "removing"


def container_name(allocation_key: str) -> str:
    return f"gpushare-{allocation_key}"


def _tmpfs_mib(spec: SandboxSpec) -> int:
    # tmpfs pages are charged to the container's memory cgroup anyway; the size cap only
    # stops one directory from eating the whole memory limit.
    return max(16, spec.memory_limit_mib // 4)


def sandbox_user(spec: SandboxSpec) -> int:
    """The container's uid: its owner's; under MPS, its GPU's (uids.host_uid)."""
    return uids.host_uid(spec)


def container_kwargs(
    spec: SandboxSpec,
    output_cap: int | None = None,
    bound: Sequence[BoundStorage] = (),
    app_dir: Path | None = None,
    gpu_request: docker.types.DeviceRequest | None = None,
) -> dict[str, Any]:
    """The ``containers.create`` arguments for ``spec`` and its storage, resolved on this host
    (pure, so it is unit-testable). ``gpu_request``: how this host's engine hands out the
    spec's GPUs (``HostGpuFacts.device_request``); the legacy ``--gpus`` request when not
    given."""
    tmpfs_size = f"size={_tmpfs_mib(spec)}m"
    uid = sandbox_user(spec)
    tmpfs = {SANDBOX_TMP: f"rw,nosuid,nodev,mode=1777,{tmpfs_size}"}
    if not spec.mounts_at(SANDBOX_HOME):  # a persistent home replaces the scratch one
        tmpfs[SANDBOX_HOME] = f"rw,nosuid,nodev,mode=0700,uid={uid},gid={uid},{tmpfs_size}"
    kwargs: dict[str, Any] = {
        "image": spec.image,
        "command": list(spec.command) or None,
        "name": container_name(spec.allocation_key),
        "hostname": f"sandbox-{spec.sandbox_id}",
        "labels": spec.labels(),
        # HOME by name: the sandbox's uid has no entry in the image's /etc/passwd.
        "environment": {
            "HOME": SANDBOX_HOME,
            "USER": "sandbox",
            **spec.env,
            **({"GPUSHARE_APP_SOCKET": app_socket.APP_SOCKET} if app_dir is not None else {}),
            **spec.gpu_env(),
        },
        "user": f"{uid}:{uid}",
        "working_dir": SANDBOX_HOME,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "read_only": True,
        "tmpfs": tmpfs,
        "mem_limit": f"{spec.memory_limit_mib}m",
        "memswap_limit": f"{spec.memory_limit_mib}m",  # equal to mem_limit: no swap
        "nano_cpus": round(spec.cpu_limit * 1e9),
        # Counts threads (the pids cgroup): the tiers' default is thousands (SandboxSpec).
        "pids_limit": spec.pids_limit,
        "init": True,  # reap zombies and forward signals, so stop's grace period works
        "restart_policy": {"Name": "no"},
        "auto_remove": False,  # status() must still see the exit code after exit
        # The engine keeps the container's output: at most the cap of it on this host's disk.
        "log_config": docker.types.LogConfig(
            **log_config(output_cap if output_cap is not None else cap_bytes())
        ),
    }
    if spec.shm_size_mib > 0:
        # Docker's default /dev/shm is 64 MiB: PyTorch DataLoader workers die with "bus
        # error", NCCL with "failed to extend /dev/shm". Charged to the memory limit.
        kwargs["shm_size"] = f"{spec.shm_size_mib}m"
    if not spec.network:
        kwargs["network_mode"] = "none"
    if spec.real_gpu and spec.device_uuids:  # a CPU-only sandbox asks the runtime for no GPU
        kwargs["device_requests"] = [
            gpu_request
            or docker.types.DeviceRequest(device_ids=list(spec.device_uuids), capabilities=[["gpu"]])
        ]
    if spec.mps is not None:
        # Read-write: clients create and connect to sockets in the pipe directory. The IPC
        # namespace and /dev/shm stay the container's own: on an H200 with driver 580 an MPS
        # client in a private IPC namespace with its own /dev/shm reached the host's server
        # and got its limits (gpu-checks/mps_checks.sh step 6), so no ipc_mode="host".
        pipe_dir = checked_pipe_dir(spec.mps.pipe_dir)
        kwargs["mounts"] = [
            docker.types.Mount(target=pipe_dir, source=pipe_dir, type="bind", read_only=False)
        ]
    if bound:
        # The container reaches its storage through supplementary groups, the volumes' gids.
        kwargs["mounts"] = kwargs.get("mounts", []) + [
            docker.types.Mount(target=m.target, source=m.host_path, type="bind", read_only=m.read_only)
            for m in bound
        ]
        kwargs["group_add"] = [str(gid) for gid in spec.groups()]
    if app_dir is not None:  # its app's socket, which the agent connects to from the host
        socket_dir = docker.types.Mount(target=app_socket.APP_DIR, source=str(app_dir), type="bind")
        kwargs["mounts"] = [*kwargs.get("mounts", []), socket_dir]
    return kwargs


def _parse_docker_time(value: str | None) -> int | None:
    """Epoch ms from Docker's RFC 3339 time (nanoseconds, ``Z``); None for the zero time."""
    if not value or value.startswith("0001-01-01"):
        return None
    stamp = value.replace("Z", "+00:00")
    if "." in stamp:
        # Python parses at most microseconds; Docker writes nanoseconds.
        head, _, rest = stamp.partition(".")
        digits = "".join(c for c in rest if c.isdigit())
        stamp = f"{head}.{digits[:6]}{rest[len(digits) :]}"
    try:
        return int(datetime.fromisoformat(stamp).timestamp() * 1000)
    except ValueError:
        return None


@contextlib.contextmanager
def _engine_errors(action: str) -> Iterator[None]:
    """Turn docker SDK and transport errors into DriverError naming what we were doing."""
    try:
        yield
    except docker.errors.ImageNotFound as exc:
        raise DriverError(f"{action}: image not found ({exc.explanation}); {BUILD_HINT}") from exc
    except docker.errors.APIError as exc:
        raise DriverError(f"{action}: Docker engine refused: {exc.explanation or exc}") from exc
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise DriverError(f"{action}: cannot reach the Docker engine: {exc}") from exc


_UNREACHABLE = (docker.errors.DockerException, requests.exceptions.RequestException)


def _ask_engine(question: Callable[[docker.DockerClient], object], timeout_s: float) -> bool:
    """Whether the engine from the environment (DOCKER_HOST or the socket) answers
    ``question`` truthfully; False when it cannot be reached or refuses."""
    try:
        client = docker.from_env(timeout=max(1, round(timeout_s)))
    except _UNREACHABLE:
        return False
    try:
        return bool(question(client))
    except _UNREACHABLE:
        return False
    finally:
        client.close()


def image_present(reference: str, timeout_s: float = _PING_TIMEOUT_S) -> bool:
    """True when this machine's engine answers and has ``reference``."""
    return _ask_engine(lambda client: client.images.get(reference), timeout_s)


def docker_available(timeout_s: float = _PING_TIMEOUT_S) -> bool:
    """True when the engine from the environment answers a ping."""
    return _ask_engine(lambda client: client.ping(), timeout_s)


class DockerTerminal:
    """A pty exec in a container, over the engine's hijacked attach socket.

    ``read`` returns ``b""`` when nothing arrived within the timeout and raises
    ``EOFError`` once the shell has gone.
    """

    def __init__(self, api: Any, exec_id: str, sock: Any) -> None:
        self._api = api
        self._exec_id = exec_id
        self._holder = sock  # keeps the HTTP response (and so the connection) alive
        # The SDK returns a SocketIO for unix sockets; select/recv need the socket itself.
        self._sock: socket.socket = getattr(sock, "_sock", sock)
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed:
            raise EOFError("terminal is closed")
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise EOFError(f"terminal connection lost: {exc}") from exc

    def read(self, timeout_s: float = 0.1) -> bytes:
        if self._closed:
            raise EOFError("terminal is closed")
        ready, _, _ = select.select([self._sock], [], [], timeout_s)
        if not ready:
            return b""
        try:
            data = self._sock.recv(65536)
        except OSError as exc:
            raise EOFError(f"terminal connection lost: {exc}") from exc
        if not data:
            raise EOFError("shell exited")
        return data

    def resize(self, rows: int, cols: int) -> None:
        with _engine_errors("resize terminal"):
            self._api.exec_resize(self._exec_id, height=rows, width=cols)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Closing the attach stream closes the pty master, which hangs up the shell.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError, AttributeError):
            self._holder.close()


class DockerDriver:
    name = "docker"

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        host: str = "",
        storage_dir: Path | None = None,
        apps_dir: Path | None = None,
        gpu_paths: GpuPaths | None = None,
    ) -> None:
        self._client = client
        self.host = host
        self.storage_dir = storage_root() if storage_dir is None else storage_dir
        self.apps_dir = apps_root() if apps_dir is None else apps_dir
        self._logs = ContainerLogReader()
        self.gpu_paths = gpu_paths or GpuPaths(lambda: dict(self.client.info()))

    def gpu_path_problem(self) -> tuple[str, str] | None:
        """(what is missing, how to fix it) when this engine can hand out no NVIDIA GPU at
        all; None when it can (or the engine cannot be asked: the self-test says so)."""
        try:
            with _engine_errors("ask the Docker engine how it hands out GPUs"):
                facts = self.gpu_paths.facts()
        except DriverError as exc:
            log.warning("%s", exc)
            return None
        log.info("Docker GPU path: %s", facts.describe())
        return facts.problem()

    @property
    def client(self) -> docker.DockerClient:
        # Created on first use so that building a driver never needs a running engine.
        if self._client is None:
            with _engine_errors("connect"):
                self._client = docker.from_env()
        return self._client

    def _handle(self, container: Any) -> SandboxHandle:
        labels = container.attrs.get("Labels")  # where a sparse listing's container has them
        if labels is None:  # one the engine was asked about by name: the full inspection
            labels = container.labels
        return SandboxHandle(
            driver=self.name,
            allocation_key=labels[ALLOCATION_LABEL],
            sandbox_id=int(labels.get(f"{LABEL_PREFIX}.sandbox", "0")),
            ref=container.id,
        )

    def _find(self, allocation_key: str) -> Any | None:
        """The allocation's container as the engine lists it (``sparse``: its id, state and
        labels, no inspection; the SDK's full listing inspects each one it found, and raised
        NotFound for one a concurrent stop removed in between)."""
        found = self.client.containers.list(
            all=True, sparse=True, filters={"label": [f"{ALLOCATION_LABEL}={allocation_key}"]}
        )
        return found[0] if found else None

    def _await_named(self, allocation_key: str) -> Any:
        """The container holding our name; the engine reserves a name before the container
        it names can be looked up, so a racing create may briefly see neither."""
        deadline = time.monotonic() + _RACE_WAIT_S
        while True:
            try:
                return self.client.containers.get(container_name(allocation_key))
            except docker.errors.NotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def prepare(self, spec: SandboxSpec, report: Callable[[str], None]) -> None:
        """Pull the sandbox's image when this host lacks it and its registry is one an admin
        approved (``spec.pull``), reporting progress; any other image must have been built
        or loaded here. Credentials: the agent user's ``docker login`` (~/.docker/config.json)."""
        if not spec.pull:
            return
        with _engine_errors(f"pull {spec.image} for sandbox {spec.allocation_key}"):
            try:
                self.client.images.get(spec.image)
                return
            except docker.errors.ImageNotFound:
                pass
            image_pull.follow(spec.image, self.client.api.pull(spec.image, stream=True, decode=True), report)

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        action = f"launch sandbox {spec.allocation_key} from {spec.image}"
        with _engine_errors(action):
            existing = self._find(spec.allocation_key)
            if existing is not None:
                if existing.status == "created":
                    try:
                        # A previous launch died between create and start: finish it.
                        existing.start()
                    except docker.errors.NotFound:
                        # Or a concurrent launch's create has not finished: the engine lists
                        # such a container before it can be started; that launch starts it.
                        return self._handle(self._await_named(spec.allocation_key))
                return self._handle(existing)
            if spec.mps is not None:
                # A container whose uid cannot reach the daemon would run without MPS.
                require_mps_pipe(spec.mps.pipe_dir, sandbox_user(spec), real_gpu=spec.real_gpu)
            try:
                bound = storage.resolve(self.storage_dir, spec.mounts, folder=spec.checkpoint_dir)
                gpu_request = None
                if spec.real_gpu and spec.device_uuids:  # before anything is made for it
                    gpu_request = self.gpu_paths.facts().device_request(spec.device_uuids)
                app_dir = None
                if spec.app:
                    app_dir = app_socket.make_dir(self.apps_dir, spec.allocation_key, sandbox_user(spec))
                kwargs = container_kwargs(spec, bound=bound, app_dir=app_dir, gpu_request=gpu_request)
                # The engine's own create: the SDK's inspects what it made too, one more round
                # trip to the engine per launch while a burst's launches queue at it.
                api = self.client.api
                made = api.create_container(**_create_container_args({**kwargs, "version": api.api_version}))
                ref = made["Id"]
            except docker.errors.ImageNotFound as exc:
                raise DriverError(
                    f"{action}: image {spec.image!r} is not on this host; {BUILD_HINT}"
                ) from exc
            except docker.errors.APIError as exc:
                if exc.status_code != 409:
                    raise
                # A concurrent launch of the same allocation won the name: use its container.
                return self._handle(self._await_named(spec.allocation_key))
            try:
                api.start(ref)
            except docker.errors.APIError:
                # A container that cannot start (bad command, missing runtime) must not be
                # found by the next launch as if it were the sandbox.
                with contextlib.suppress(docker.errors.APIError):
                    api.remove_container(ref, force=True)
                raise
            log.info("launched sandbox %s as container %s", spec.allocation_key, ref)
            return SandboxHandle(
                driver=self.name, allocation_key=spec.allocation_key, sandbox_id=spec.sandbox_id, ref=ref
            )

    def open_app(self, handle: SandboxHandle) -> app_socket.SocketStream:
        return app_socket.connect(self.apps_dir, handle.allocation_key)

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        self._logs.forget(handle.allocation_key)
        app_socket.remove_dir(self.apps_dir, handle.allocation_key)
        with _engine_errors(f"stop sandbox {handle.allocation_key}"):
            api = self.client.api
            try:
                # No inspection first: the engine answers a stop of a container that is not
                # running (an ended batch) with 304 at once, and a burst's ended batches'
                # stops queue at the engine with its launches.
                api.stop(handle.ref, timeout=max(0, round(grace_s)))
                api.remove_container(handle.ref, force=True)
            except docker.errors.NotFound:
                return  # removed already, or concurrently: stopping is idempotent
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: a concurrent removal is in progress
                    raise

    def warn(self, handle: SandboxHandle) -> str:
        with _engine_errors(f"warn sandbox {handle.allocation_key}"):
            try:
                container = self.client.containers.get(handle.ref)
                container.kill(signal="SIGTERM")  # its init (tini) passes it to the command
            except docker.errors.NotFound:
                return "no container: it has already stopped"
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: not running any more
                    raise
                return "the container is no longer running"
        return "SIGTERM sent to the container's command"

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        """The container's output from ``offset`` on (workers/drivers/docker_logs.py)."""
        with _engine_errors(f"read the output of sandbox {handle.allocation_key}"):
            # By id, uninspected: the agent reads every batch's output each tick, and an
            # inspection first doubled those questions while a burst's launches waited.
            container = self.client.containers.prepare_model({"Id": handle.ref})
            try:
                return self._logs.read(container, handle.allocation_key, offset, limit)
            except docker.errors.NotFound:
                return OutputChunk(start=offset, data=b"", total=offset)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        with _engine_errors(f"inspect sandbox {handle.allocation_key}"):
            try:
                container = self.client.containers.get(handle.ref)
            except docker.errors.NotFound:
                return SandboxStatus(state="missing")
            state = container.attrs.get("State") or {}
            started = _parse_docker_time(state.get("StartedAt"))
            if container.status in _LIVE_STATES:
                return SandboxStatus(state="running", started_at_ms=started)
            if container.status == _BEING_REMOVED:
                return SandboxStatus(state="missing")
            if container.status == "created":
                # Made but never started: a launch died in between; the next launch starts it.
                return SandboxStatus(state="created")
            # "created" (never started) has no exit code worth reporting.
            code = state.get("ExitCode") if container.status != "created" else None
            reason = "out of memory: killed at the memory limit" if state.get("OOMKilled") else None
            return SandboxStatus(state="exited", exit_code=code, started_at_ms=started, reason=reason)

    def pids(self, handle: SandboxHandle) -> list[int]:
        """Host pids of the container's processes, to attribute GPU memory NVML reports by pid."""
        with _engine_errors(f"list processes of sandbox {handle.allocation_key}"):
            try:
                top = self.client.containers.get(handle.ref).top(ps_args="-o pid")
            except docker.errors.NotFound:
                return []
            except docker.errors.APIError as exc:
                if exc.status_code == 409:  # not running
                    return []
                raise
        return [int(row[0]) for row in top.get("Processes") or [] if row and str(row[0]).isdigit()]

    def list_owned(self) -> list[SandboxHandle]:
        labels = [ALLOCATION_LABEL]
        if self.host:
            labels.append(f"{LABEL_PREFIX}.host={self.host}")
        with _engine_errors("list sandboxes"):
            # The engine's own listing (``sparse``): the SDK's full one inspects every
            # container, which each heartbeat's report (its status() inspects each again)
            # doubled while a burst of launches waited on the same engine.
            containers = self.client.containers.list(all=True, sparse=True, filters={"label": labels})
        handles = []
        for container in containers:
            try:
                handles.append(self._handle(container))
            except ValueError:
                log.warning("container %s has a malformed sandbox label; ignored", container.id)
        return handles

    def _running_container(self, handle: SandboxHandle) -> Any:
        try:
            container = self.client.containers.get(handle.ref)
        except docker.errors.NotFound as exc:
            raise DriverError(f"sandbox {handle.allocation_key} has no container") from exc
        if container.status != "running":
            raise DriverError(f"sandbox {handle.allocation_key} is {container.status}, not running")
        return container

    def exec_terminal(self, handle: SandboxHandle) -> DockerTerminal:
        with _engine_errors(f"open a terminal in sandbox {handle.allocation_key}"):
            container = self._running_container(handle)
            api = self.client.api
            exec_id = api.exec_create(
                container.id,
                cmd=["/bin/sh"],
                stdin=True,
                tty=True,
                user=str(container.attrs["Config"].get("User") or "nobody"),  # the sandbox's own uid
                workdir=SANDBOX_HOME,
                environment={"TERM": "xterm-256color"},
            )["Id"]
            sock = api.exec_start(exec_id, tty=True, socket=True)
        return DockerTerminal(api, exec_id, sock)

    def open_ssh(self, handle: SandboxHandle, authorized_keys: list[str]) -> sshd.MultiplexedServer:
        """sshd in the container as its uid, over an exec without a tty (workers/drivers/sshd.py)."""
        with _engine_errors(f"open an SSH connection to sandbox {handle.allocation_key}"):
            container = self._running_container(handle)
            config = container.attrs["Config"]
            variables = dict(entry.split("=", 1) for entry in config.get("Env") or [] if "=" in entry)
            server = sshd.Server.for_keys(authorized_keys, variables)
            api = self.client.api
            exec_id = api.exec_create(
                container.id,
                cmd=server.argv,
                stdin=True,
                tty=False,
                user=str(config.get("User") or "nobody"),  # the sandbox's own uid
                workdir=SANDBOX_HOME,
                environment=server.env,
            )["Id"]
            sock = api.exec_start(exec_id, tty=False, socket=True)

        def exit_status() -> int | None:
            status = api.exec_inspect(exec_id).get("ExitCode")
            return status if isinstance(status, int) else None

        return sshd.MultiplexedServer(sock, exit_status)
