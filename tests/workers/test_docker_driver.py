"""Docker driver: spec -> container arguments (no engine), then against a real engine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import docker
import docker.errors
import docker.models.containers
import pytest

from tests.workers.engines import require_engine
from wire import uids
from wire.spec import MpsShare, SandboxHandle, SandboxSpec
from workers.drivers import base, make_driver
from workers.drivers.base import DriverError
from workers.drivers.docker import (
    DockerDriver,
    _parse_docker_time,
    container_kwargs,
    docker_available,
    sandbox_user,
)
from workers.drivers.docker_gpus import GpuPaths
from workers.drivers.process import ProcessDriver

IMAGE = "gpushare/sandbox-base:1"
REPO = Path(__file__).resolve().parents[2]


def make_spec(host: str = "h1", **overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "allocation_key": f"t{uuid.uuid4().hex[:12]}",
        "sandbox_id": 42,
        "host": host,
        "project": "proj",
        "owner": "alice",
        "image": IMAGE,
        "command": ("sleep", "300"),
        "device_uuids": ("GPU-aaaa", "MIG-bbbb"),
        "real_gpu": False,
        "cpu_limit": 0.5,
        "memory_limit_mib": 128,
        "pids_limit": 64,
        "env": {"FOO": "bar"},
    }
    values.update(overrides)
    return SandboxSpec(**values)  # type: ignore[arg-type]


# --- no engine needed --------------------------------------------------------------------


def test_kwargs_lock_the_container_down() -> None:
    spec = make_spec()
    kw = container_kwargs(spec)
    assert kw["name"] == f"gpushare-{spec.allocation_key}"
    assert kw["labels"] == spec.labels()
    uid = uids.sandbox_uid(spec.sandbox_id)
    assert kw["user"] == f"{uid}:{uid}" and uid >= uids.SANDBOX_UID_BASE  # no host account's uid
    assert kw["cap_drop"] == ["ALL"]
    assert kw["security_opt"] == ["no-new-privileges"]
    assert kw["read_only"] is True
    assert set(kw["tmpfs"]) == {"/tmp", "/home/sandbox"}
    assert all("size=" in opts for opts in kw["tmpfs"].values())
    assert kw["mem_limit"] == kw["memswap_limit"] == "128m"
    assert kw["nano_cpus"] == 500_000_000
    assert kw["pids_limit"] == 64
    assert kw["network_mode"] == "none"
    assert kw["init"] is True
    assert kw["restart_policy"] == {"Name": "no"}
    assert kw["auto_remove"] is False
    assert kw["environment"]["FOO"] == "bar"
    assert kw["environment"]["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa,MIG-bbbb"
    assert "device_requests" not in kw  # simulated host: no NVIDIA runtime involved
    assert "mounts" not in kw


def test_a_cpu_only_container_asks_the_runtime_for_no_gpu() -> None:
    """On a host with real GPUs: no device request (an empty one is not "none" to every
    runtime), and the variables name no device."""
    kw = container_kwargs(make_spec(device_uuids=(), real_gpu=True))
    assert "device_requests" not in kw and "mounts" not in kw
    assert kw["environment"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert kw["environment"]["CUDA_VISIBLE_DEVICES"] == ""
    gpu = container_kwargs(make_spec(device_uuids=("GPU-aaaa",), real_gpu=True))
    assert [list(r["DeviceIDs"]) for r in gpu["device_requests"]] == [["GPU-aaaa"]]


def test_the_listing_is_the_engines_own_not_an_inspection_per_container() -> None:
    """A heartbeat's report lists every container of the host, then asks each one's status:
    the SDK's full listing would inspect each a first time (and fail when a stop removed one
    in between), while a burst of launches waits on the same engine."""

    class Containers:
        asked: dict[str, object] = {}

        def list(self, **kwargs: object) -> list[object]:
            Containers.asked = kwargs
            labels = {"io.gpushare.allocation": "a1", "io.gpushare.sandbox": "7", "io.gpushare.host": "h"}
            return [
                docker.models.containers.Container(attrs={"Id": "c1", "Labels": labels, "State": "exited"})
            ]

    class Client:
        containers = Containers()

    [handle] = DockerDriver(client=Client(), host="h").list_owned()  # type: ignore[arg-type]
    assert Containers.asked["sparse"] is True
    assert (handle.allocation_key, handle.sandbox_id, handle.ref) == ("a1", 7, "c1")


def test_a_container_being_removed_is_missing_not_exited() -> None:
    """``docker rm -f`` kills the container, then lists it "removing" (exit code 137) until
    its files are gone: a report in that window must not call the removal an exit, or
    reconcile records an ordinary stop where a sandbox vanished."""

    class Containers:
        def get(self, ref: str) -> object:
            state = {"Status": "removing", "ExitCode": 137, "StartedAt": "2026-11-30T08:00:00Z"}
            return docker.models.containers.Container(attrs={"Id": ref, "State": state})

    class Client:
        containers = Containers()

    driver = DockerDriver(client=Client(), host="h")  # type: ignore[arg-type]
    handle = SandboxHandle(driver="docker", allocation_key="a1", sandbox_id=7, ref="c1")
    assert driver.status(handle).state == "missing"


def test_kwargs_real_gpu_requests_devices_by_uuid() -> None:
    kw = container_kwargs(make_spec(real_gpu=True))
    (request,) = kw["device_requests"]
    assert request["DeviceIDs"] == ["GPU-aaaa", "MIG-bbbb"]
    assert request["Capabilities"] == [["gpu"]]
    assert kw["environment"]["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,MIG-bbbb"


def test_kwargs_mps_mounts_pipe_dir_and_sets_variables() -> None:
    mps = MpsShare(pipe_dir="/run/gpushare/mps/GPU-aaaa", thread_pct=25, memory_mib=4096)
    kw = container_kwargs(make_spec(mps=mps, device_uuids=("GPU-aaaa",)))
    (mount,) = kw["mounts"]
    assert mount["Source"] == mount["Target"] == mps.pipe_dir
    assert mount["Type"] == "bind"
    assert mount["ReadOnly"] is False
    env = kw["environment"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == mps.pipe_dir
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"


def test_kwargs_size_dev_shm_from_the_spec() -> None:
    """Docker's own /dev/shm is 64 MiB: DataLoader workers die with a bus error."""
    assert container_kwargs(make_spec(shm_size_mib=2048))["shm_size"] == "2048m"
    assert "shm_size" not in container_kwargs(make_spec())  # an old message: the engine's


def test_an_mps_share_that_could_not_reach_its_daemon_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container runs as the GPU's MPS uid: against a pipe directory it cannot enter
    (an agent's own 0700 directory) its CUDA would run without MPS, silently. Refused before
    the engine is asked for anything."""

    class NoEngine:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the engine was asked for {name}")

    class Driver(DockerDriver):
        def _find(self, allocation_key: str) -> None:
            return None

    driver = Driver(client=NoEngine(), host="h")  # type: ignore[arg-type]
    monkeypatch.setattr(base, "MPS_SOCKET_WAIT_S", 0.2)
    pipe = tmp_path / "pipe"
    pipe.mkdir(mode=0o700)
    missing = MpsShare(pipe_dir=str(tmp_path / "absent"), thread_pct=25, memory_mib=1024)
    with pytest.raises(DriverError, match="absent is missing"):
        driver.launch(make_spec(mps=missing, device_uuids=("GPU-aaaa",)))
    share = MpsShare(pipe_dir=str(pipe), thread_pct=25, memory_mib=1024)
    with pytest.raises(DriverError, match=r"cannot be entered by the sandbox's uid \d+"):
        driver.launch(make_spec(mps=share, device_uuids=("GPU-aaaa",)))
    pipe.chmod(0o711)
    with pytest.raises(DriverError, match="control is missing"):  # a real GPU needs the daemon's socket
        driver.launch(make_spec(mps=share, device_uuids=("GPU-aaaa",), real_gpu=True))


def test_kwargs_network_only_when_allowed() -> None:
    assert "network_mode" not in container_kwargs(make_spec(network=True))


def test_parse_docker_time() -> None:
    assert _parse_docker_time("2026-01-02T03:04:05.123456789Z") == 1767323045123
    assert _parse_docker_time("2026-01-02T03:04:05Z") == 1767323045000
    assert _parse_docker_time("0001-01-01T00:00:00Z") is None
    assert _parse_docker_time("") is None


def test_make_driver_kinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_driver("docker", "h1", tmp_path), DockerDriver)
    assert isinstance(make_driver("process", "h1", tmp_path), ProcessDriver)
    monkeypatch.setattr("workers.drivers.docker.docker_available", lambda: False)
    assert isinstance(make_driver("auto", "h1", tmp_path), ProcessDriver)
    monkeypatch.setattr("workers.drivers.docker.docker_available", lambda: True)
    assert isinstance(make_driver("auto", "h1", tmp_path), DockerDriver)
    with pytest.raises(ValueError, match="'libvrit'"):
        make_driver("libvrit", "h1", tmp_path)


def test_unreachable_engine_is_a_driver_error() -> None:
    client = docker.DockerClient(base_url="unix:///nonexistent/docker.sock", version="1.41")
    with pytest.raises(DriverError, match="cannot reach the Docker engine"):
        DockerDriver(client, host="h1").list_owned()


# --- against a real engine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    require_engine(docker_available(), "Docker engine")
    built = subprocess.run(
        [REPO / "scripts" / "build-sandbox-image.sh"], capture_output=True, text=True, check=False
    )
    require_engine(built.returncode == 0, f"{IMAGE} image ({built.stderr.strip()})")
    engine = docker.from_env()
    yield engine
    engine.close()


@pytest.fixture
def host(client: docker.DockerClient) -> Iterator[str]:
    """A host name no one else uses, so that list_owned and cleanup see only our sandboxes."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    for container in client.containers.list(all=True, filters={"label": f"io.gpushare.host={name}"}):
        container.remove(force=True)


@pytest.fixture
def driver(client: docker.DockerClient, host: str) -> DockerDriver:
    return DockerDriver(client, host=host)


def read_until(terminal: object, pattern: bytes, timeout_s: float = 10.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not re.search(pattern, out):
        out += terminal.read(0.2)  # type: ignore[attr-defined]
    return out


def read_until_eof(terminal: object, timeout_s: float = 10.0) -> None:
    """Reads until the terminal raises EOFError; returns (failing the caller) if it never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        terminal.read(0.2)  # type: ignore[attr-defined]


@pytest.mark.docker
def test_launch_applies_confinement(driver: DockerDriver, client: docker.DockerClient, host: str) -> None:
    spec = make_spec(host)
    before_ms = int(time.time() * 1000) - 60_000  # the engine stamps it; allow clock skew
    handle = driver.launch(spec)
    container = client.containers.get(handle.ref)
    attrs = container.attrs
    config, hostcfg = attrs["Config"], attrs["HostConfig"]
    assert handle.allocation_key == spec.allocation_key and handle.sandbox_id == 42
    assert container.name == f"gpushare-{spec.allocation_key}"
    assert spec.labels().items() <= config["Labels"].items()
    uid = uids.sandbox_uid(spec.sandbox_id)
    assert config["User"] == f"{uid}:{uid}"
    assert hostcfg["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in hostcfg["SecurityOpt"]
    assert hostcfg["ReadonlyRootfs"] is True
    assert hostcfg["Memory"] == hostcfg["MemorySwap"] == 128 * 1024 * 1024
    assert hostcfg["NanoCpus"] == 500_000_000
    assert hostcfg["PidsLimit"] == 64
    assert hostcfg["NetworkMode"] == "none"
    assert hostcfg["Init"] is True
    assert hostcfg["RestartPolicy"]["Name"] == "no"
    assert hostcfg["AutoRemove"] is False
    assert "NVIDIA_VISIBLE_DEVICES=GPU-aaaa,MIG-bbbb" in config["Env"]
    assert "FOO=bar" in config["Env"]

    status = driver.status(handle)
    assert status.state == "running"
    assert status.started_at_ms is not None and status.started_at_ms >= before_ms

    # What the sandbox itself sees, not only what the engine was told.
    # demux: the engine copies stdout and stderr on their own, so their order across the
    # two streams is not kept; each is checked on its own.
    code, streams = container.exec_run(
        ["sh", "-c", "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; touch /x"], demux=True
    )
    stdout, stderr = cast(tuple[bytes | None, bytes | None], streams)  # demux=True: a pair
    text = (stdout or b"").decode()
    assert code != 0  # the root filesystem is read-only
    assert text.splitlines()[0] == str(uid)
    assert re.search(r"CapEff:\s+0+\n", text)
    assert re.search(r"NoNewPrivs:\s+1", text)
    assert "Read-only file system" in (stderr or b"").decode()
    code, out = container.exec_run(["sh", "-c", "cd && touch ok && echo $HOME && ls /tmp"])
    assert code == 0 and isinstance(out, bytes), out
    assert out.decode().splitlines()[0] == "/home/sandbox"


@pytest.mark.docker
def test_launch_is_idempotent(driver: DockerDriver, client: docker.DockerClient, host: str) -> None:
    spec = make_spec(host)
    first = driver.launch(spec)
    assert driver.launch(spec) == first
    # A second driver (another agent process) racing on the same allocation.
    spec2 = make_spec(host)
    results: list[str] = []
    launchers = [
        threading.Thread(target=lambda: results.append(DockerDriver(host=host).launch(spec2).ref))
        for _ in range(4)
    ]
    for thread in launchers:
        thread.start()
    for thread in launchers:
        thread.join()
    assert len(results) == 4 and len(set(results)) == 1
    owned = client.containers.list(
        all=True, filters={"label": f"io.gpushare.allocation={spec2.allocation_key}"}
    )
    assert [c.id for c in owned] == results[:1]


@pytest.mark.docker
def test_mps_env_and_mount(driver: DockerDriver, client: docker.DockerClient, host: str) -> None:
    with tempfile.TemporaryDirectory(prefix="gpushare-mps-") as pipe_dir:
        mps = MpsShare(pipe_dir=pipe_dir, thread_pct=30, memory_mib=2048)
        spec = make_spec(host, mps=mps, device_uuids=("GPU-aaaa",))
        if os.geteuid() == 0:  # as the agent's MpsManager makes it: root:<MPS gid> 1770
            os.chown(pipe_dir, 0, sandbox_user(spec))
            os.chmod(pipe_dir, 0o1770)  # noqa: S103 - the MPS group's, sticky: as the agent makes it
        else:
            os.chmod(pipe_dir, 0o711)  # noqa: S103 - what a client of another uid needs
        handle = driver.launch(spec)
        container = client.containers.get(handle.ref)
        (mount,) = container.attrs["Mounts"]
        assert mount["Type"] == "bind"
        assert mount["Source"] == mount["Destination"] == pipe_dir
        assert mount["RW"] is True
        env = container.attrs["Config"]["Env"]
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}" in env
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in env
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M" in env
        code, _ = container.exec_run(["test", "-d", pipe_dir])
        assert code == 0
        driver.stop(handle, grace_s=0)


@pytest.mark.docker
def test_stop_removes_container_and_is_idempotent(
    driver: DockerDriver, client: docker.DockerClient, host: str
) -> None:
    handle = driver.launch(make_spec(host))
    started = time.monotonic()
    driver.stop(handle, grace_s=5)
    assert time.monotonic() - started < 5  # init forwards SIGTERM: no wait for the grace
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(handle.ref)
    assert driver.status(handle).state == "missing"
    driver.stop(handle)  # already gone: no error


@pytest.mark.docker
def test_concurrent_stops_all_succeed(driver: DockerDriver, host: str) -> None:
    handle = driver.launch(make_spec(host))
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            DockerDriver(host=host).stop(handle, grace_s=0)
        except BaseException as exc:  # collected: a thread's exception would be lost
            errors.append(exc)

    stoppers = [threading.Thread(target=stop) for _ in range(4)]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join()
    assert errors == []
    assert driver.status(handle).state == "missing"


@pytest.mark.docker
def test_status_reports_exit_code(driver: DockerDriver, host: str) -> None:
    handle = driver.launch(make_spec(host, command=("sh", "-c", "exit 3")))
    deadline = time.monotonic() + 10
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    status = driver.status(handle)
    assert status.state == "exited"
    assert status.exit_code == 3
    assert driver.launch(make_spec(host, allocation_key=handle.allocation_key)) == handle


TRAPS_TERM = "trap 'echo got-term; exit 3' TERM; echo READY; while :; do sleep 0.2; done"


@pytest.mark.docker
def test_a_warning_signals_the_command_and_leaves_the_container(driver: DockerDriver, host: str) -> None:
    handle = driver.launch(make_spec(host, command=("sh", "-c", TRAPS_TERM)))
    deadline = time.monotonic() + 10
    while b"READY" not in driver.read_output(handle, 0, 4096).data and time.monotonic() < deadline:
        time.sleep(0.1)
    assert driver.warn(handle) == "SIGTERM sent to the container's command"
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert driver.status(handle).exit_code == 3  # its trap ran: it could save its work
    assert b"got-term" in driver.read_output(handle, 0, 4096).data
    assert driver.warn(handle) == "the container is no longer running"
    driver.stop(handle)


@pytest.mark.docker
def test_list_owned_filters_by_host(driver: DockerDriver, host: str) -> None:
    handles = {driver.launch(make_spec(host)) for _ in range(2)}
    assert set(driver.list_owned()) == handles
    assert not handles & set(DockerDriver(host=f"{host}-other").list_owned())
    assert handles <= set(DockerDriver().list_owned())  # no host: everything labelled


@pytest.mark.docker
def test_network_allowed_leaves_the_none_network(
    driver: DockerDriver, client: docker.DockerClient, host: str
) -> None:
    handle = driver.launch(make_spec(host, network=True))
    # The engine's default network; on a --bridge=none engine that still means loopback.
    assert client.containers.get(handle.ref).attrs["HostConfig"]["NetworkMode"] != "none"


@pytest.mark.docker
def test_terminal_runs_a_shell(driver: DockerDriver, host: str) -> None:
    handle = driver.launch(make_spec(host))
    terminal = driver.exec_terminal(handle)
    try:
        terminal.resize(40, 120)
        terminal.write(b"echo h''i; id -u\n")  # the quotes keep the echoed line from matching
        uid = str(uids.sandbox_uid(handle.sandbox_id)).encode()
        out = read_until(terminal, rb"hi\r?\n" + uid + rb"\r?\n")
        assert re.search(rb"hi\r?\n" + uid + rb"\r?\n", out), out
        terminal.write(b"exit\n")
        with pytest.raises(EOFError):
            read_until_eof(terminal)
    finally:
        terminal.close()


@pytest.mark.docker
def test_missing_image_names_the_build_script(driver: DockerDriver, host: str) -> None:
    with pytest.raises(DriverError, match=r"gpushare/no-such-image:0.*build-sandbox-image\.sh"):
        driver.launch(make_spec(host, image="gpushare/no-such-image:0"))
    assert driver.list_owned() == []


@pytest.mark.docker
def test_missing_binary_exits_127(driver: DockerDriver, host: str) -> None:
    # The init process (tini) execs the command, so the container starts and then exits.
    handle = driver.launch(make_spec(host, command=("/no/such/binary",)))
    deadline = time.monotonic() + 10
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert driver.status(handle).exit_code == 127


@pytest.mark.docker
def test_container_that_cannot_start_leaves_nothing(
    driver: DockerDriver, client: docker.DockerClient, host: str
) -> None:
    if "nvidia" in client.info().get("Runtimes", {}):
        pytest.skip("this engine can satisfy GPU device requests")
    # Told the toolkit's hook is there when it is not, the driver sends the legacy request,
    # and the engine refuses it at start.
    driver.gpu_paths = GpuPaths(lambda: {}, hook=lambda: "/usr/bin/nvidia-container-runtime-hook")
    with pytest.raises(DriverError, match="Docker engine refused"):
        driver.launch(make_spec(host, real_gpu=True))
    assert driver.list_owned() == []


@pytest.mark.docker
def test_pids_are_the_containers_host_pids(
    driver: DockerDriver, client: docker.DockerClient, host: str
) -> None:
    handle = driver.launch(make_spec(host))
    pids = driver.pids(handle)
    inspected = client.containers.get(handle.ref).attrs["State"]["Pid"]
    assert inspected in pids
    driver.stop(handle, grace_s=0)
    assert driver.pids(handle) == []


@pytest.mark.docker
def test_the_image_runs_glibc_binaries(driver: DockerDriver, client: docker.DockerClient, host: str) -> None:
    """The NVIDIA toolkit injects the host's glibc-linked nvidia-smi and libcuda into GPU
    containers: the old static-busybox image had no loader to run them ("not found")."""
    script = "/lib64/ld-linux-x86-64.so.2 --version | head -1; ldd /bin/ls; /bin/ls -d / && echo ran"
    handle = driver.launch(make_spec(host, command=("sh", "-c", script)))
    deadline = time.monotonic() + 20
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    out = driver.read_output(handle, 0, 1 << 16).data.decode()
    assert driver.status(handle).exit_code == 0, out
    assert "GLIBC" in out and "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6" in out and "ran" in out
    # A host binary bound in, as the toolkit binds nvidia-smi, under the sandbox's confinement.
    host_binary = shutil.which("env")
    assert host_binary is not None
    uid = uids.sandbox_uid(42)
    out_bytes = client.containers.run(
        IMAGE, ["/usr/local/bin/injected", "echo", "injected-ok"], remove=True, user=f"{uid}:{uid}",
        read_only=True, cap_drop=["ALL"], network_mode="none",
        volumes={os.path.realpath(host_binary): {"bind": "/usr/local/bin/injected", "mode": "ro"}},
    )  # fmt: skip
    assert out_bytes.decode().strip() == "injected-ok"


@pytest.mark.docker
def test_dev_shm_has_the_tiers_size(driver: DockerDriver, client: docker.DockerClient, host: str) -> None:
    handle = driver.launch(make_spec(host, shm_size_mib=96))
    container = client.containers.get(handle.ref)
    assert container.attrs["HostConfig"]["ShmSize"] == 96 * 2**20
    code, out = container.exec_run(["sh", "-c", "df -k /dev/shm | tail -1; touch /dev/shm/x && echo ok"])
    assert code == 0 and isinstance(out, bytes), out
    assert out.decode().split()[1] == str(96 * 1024) and "ok" in out.decode()
    driver.stop(handle, grace_s=0)


def test_a_read_before_the_first_line_does_not_break_the_next() -> None:
    """Polling a container that has printed nothing yet, then again: the first read left no
    time to resume from, and Docker refuses ``since=0`` (it raised InvalidArgument)."""
    from workers.drivers.docker_logs import ContainerLogReader

    class Container:
        def __init__(self) -> None:
            self.lines = b""
            self.since: list[object] = []

        def logs(self, **kwargs: object) -> bytes:
            self.since.append(kwargs["since"])
            return self.lines

    container, reader = Container(), ContainerLogReader()
    assert reader.read(container, "a1", 0, 4096).data == b""
    container.lines = b"2026-11-27T05:00:00.000000001Z READY\n"
    assert reader.read(container, "a1", 0, 4096).data == b"READY\n"
    assert container.since == [None, None]


def test_an_app_gets_its_socket_folder_and_nothing_else_of_the_host(tmp_path: Path) -> None:
    spec = make_spec(app=True)
    kw = container_kwargs(spec, app_dir=tmp_path / spec.allocation_key)
    [mount] = kw["mounts"]
    assert (mount["Target"], mount["Source"], mount["Type"]) == (
        "/run/gpushare",
        str(tmp_path / spec.allocation_key),
        "bind",
    )
    assert kw["environment"]["GPUSHARE_APP_SOCKET"] == "/run/gpushare/app.sock"
    assert kw["network_mode"] == "none"  # the app is reached through its socket, never a network
    assert "mounts" not in container_kwargs(make_spec())


def test_a_persons_sandboxes_run_as_their_uid_and_an_mps_share_as_its_gpus() -> None:
    assert container_kwargs(make_spec(owner_id=5))["user"] == f"{uids.owner_uid(5)}:{uids.owner_uid(5)}"
    assert uids.owner_uid(5) != uids.owner_uid(6) and uids.owner_uid(5) != uids.sandbox_uid(5)
    share = make_spec(owner_id=5, mps=MpsShare("/run/gpushare/mps/x/pipe", 50, 4096))
    assert sandbox_user(share) == uids.mps_uid("GPU-aaaa")


class _LoggedContainer:
    """A container's log as the engine serves it: entries in the order written, ``since``
    filtering by each entry's own stamp (stdout and stderr are stamped apart, so that order
    and the stamps' can differ)."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, bytes]] = []

    def logs(self, **kwargs: object) -> bytes:
        since = kwargs["since"]
        lines = []
        for stamp, content in self.entries:
            if since is None or stamp >= float(since):  # type: ignore[arg-type]
                seconds, fraction = f"{stamp:.9f}".split(".")
                day = datetime.fromtimestamp(int(seconds), UTC).strftime("%Y-%m-%dT%H:%M:%S")
                lines.append(f"{day}.{fraction}Z ".encode() + content)
        return b"".join(lines)


def test_a_line_logged_behind_a_newer_one_of_the_other_stream_is_still_read() -> None:
    """``echo out; echo err >&2``: the engine logged err first and out (a few microseconds
    older) second. A reader that took "older than what I returned" for "returned" lost out,
    both when the two came in one read and when out landed after a read had taken err."""
    from workers.drivers.docker_logs import ContainerLogReader

    together, reader = _LoggedContainer(), ContainerLogReader()
    together.entries = [(1_800_000_000.000200, b"to-stderr\n"), (1_800_000_000.000100, b"hello\n")]
    chunk = reader.read(together, "a1", 0, 4096)
    assert chunk.data == b"to-stderr\nhello\n" and chunk.total == 16

    apart = _LoggedContainer()
    apart.entries = [(1_800_000_000.000200, b"to-stderr\n")]
    first = reader.read(apart, "a2", 0, 4096)
    assert first.data == b"to-stderr\n"
    apart.entries.append((1_800_000_000.000100, b"hello\n"))
    second = reader.read(apart, "a2", first.end, 4096)
    assert (second.start, second.data) == (10, b"hello\n")
    apart.entries.append((1_800_000_001.5, b"later\n"))
    third = reader.read(apart, "a2", second.end, 4096)
    assert (third.start, third.data) == (16, b"later\n")  # nothing returned twice
    assert reader.read(apart, "a2", third.end, 4096).data == b""
