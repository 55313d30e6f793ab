"""Persistent storage through each real driver: mounted for the sandbox's uid, never a host
path outside the storage root, and still there for the owner's next sandbox."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.engines import require_engine, require_module
from wire import uids
from wire.spec import SandboxHandle, SandboxSpec
from wire.storage import StorageMount
from workers.drivers.base import DriverError, SandboxDriver

READY = "READY"
VOLUME = 7
GID = uids.storage_gid(VOLUME)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def storage_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path: its parents are root's alone (0700), and the sandbox's
    # unprivileged uid must reach the root to bind from it, as on a real host.
    root = Path(tempfile.mkdtemp(prefix="gpushare-storage-", dir="/var/tmp"))
    root.chmod(0o755)
    (root / "datasets" / "mnist").mkdir(parents=True)
    (root / "datasets" / "mnist" / "readme").write_text("digits\n")
    for folder in (root / "datasets", root / "datasets" / "mnist"):
        folder.chmod(0o755)  # an admin's dataset: readable by every sandbox
    yield root
    shutil.rmtree(root, ignore_errors=True)


def home(volume: int = VOLUME) -> StorageMount:
    return StorageMount("home", f"homes/{volume}", "/home/sandbox", False, uids.storage_gid(volume), volume)


DATASET = StorageMount("mnist", "datasets/mnist", "/datasets/mnist", True, 0)


def make_spec(host: str, sandbox_id: int, script: str, image: str = "", **overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "allocation_key": f"t{uuid.uuid4().hex[:12]}",
        "sandbox_id": sandbox_id,
        "host": host,
        "project": "proj",
        "owner": "alice",
        "image": image,
        "command": ("sh", "-c", script),
        "device_uuids": (),
        "real_gpu": False,
        "cpu_limit": 0.5,
        "memory_limit_mib": 128,
        "pids_limit": 64,
        "mounts": (home(), DATASET),
    }
    values.update(overrides)
    return SandboxSpec(**values)  # type: ignore[arg-type]


def output_of(driver: SandboxDriver, handle: SandboxHandle, text: str, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    out = ""
    while time.monotonic() < deadline:
        out = driver.read_output(handle, 0, 1 << 20).data.decode(errors="replace")
        if text in out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the sandbox's output: {out!r}")


def driver_for(kind: str, host: str, storage_dir: Path, state_dir: Path) -> tuple[SandboxDriver, str]:
    """A real driver of ``kind`` (process, docker, libvirt) on ``storage_dir``, and the image
    its sandboxes run; skips (fails in CI) without its engine."""
    if kind == "process":
        from workers.drivers.process import ProcessDriver, bwrap_available

        require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
        return ProcessDriver(state_dir, host=host, storage_dir=storage_dir), ""
    if kind == "docker":
        from workers.drivers.docker import DockerDriver, docker_available

        require_engine(docker_available(), "Docker engine")
        script = REPO / "scripts" / "build-sandbox-image.sh"
        built = subprocess.run([script], capture_output=True, check=False)
        require_engine(built.returncode == 0, "the sandbox image")
        return DockerDriver(host=host, storage_dir=storage_dir), "gpushare/sandbox-base:1"
    require_module("libvirt", "libvirt-python (make install-libvirt)")
    from workers.drivers.libvirt import GuestImage, LibvirtDriver, libvirt_available

    require_engine(libvirt_available(), "libvirtd (LIBVIRT_URI or qemu:///system)")
    guest = GuestImage.from_env()
    require_engine(not guest.missing(), "the VM guest image (scripts/build-vm-image.sh)")
    return LibvirtDriver(host, image=guest, storage_dir=storage_dir), ""


@pytest.fixture(
    params=[
        pytest.param("process", marks=pytest.mark.bwrap),
        pytest.param("docker", marks=pytest.mark.docker),
        pytest.param("libvirt", marks=[pytest.mark.libvirt, pytest.mark.slow]),
    ]
)
def make(request: pytest.FixtureRequest, storage_dir: Path, tmp_path: Path) -> Iterator[tuple[object, ...]]:
    """(the driver, a function making a spec for it)."""
    host = f"test-{uuid.uuid4().hex[:8]}"
    driver, image = driver_for(request.param, host, storage_dir, tmp_path / "state")

    def spec(sandbox_id: int, script: str, **overrides: object) -> SandboxSpec:
        return make_spec(host, sandbox_id, script, image, **overrides)

    yield driver, spec
    for handle in driver.list_owned():
        driver.stop(handle, grace_s=0)


def host_uid(driver: SandboxDriver, sandbox_id: int) -> int:
    """The host uid a sandbox's files get: its own (the process driver's under a non-root
    agent: the agent's)."""
    if driver.name == "process" and os.geteuid() != 0:
        return os.geteuid()
    return uids.sandbox_uid(sandbox_id)


def test_storage_is_the_sandboxes_own_and_outlives_it(make: tuple, storage_dir: Path) -> None:
    driver, spec = make
    first = spec(
        101,
        # A program's own umask 077: the volume's default ACL overrides it on the host. A VM's
        # guest applies it before virtiofsd sees the file, so there the guest's 0007 is kept.
        f"echo groups: $(id -G); {'' if driver.name == 'libvirt' else 'umask 077;'} "
        "echo one >> $HOME/notes.txt && echo wrote; "
        f"cat /datasets/mnist/readme; touch /datasets/mnist/x 2>&1; echo {READY}; exec sleep 300",
    )
    handle = driver.launch(first)
    out = output_of(driver, handle, READY)
    groups = next(line for line in out.splitlines() if line.startswith("groups: ")).split()[1:]
    # The volume's group, a supplementary one: inside bwrap's user namespace, which maps none
    # of the host's groups, it shows as the overflow gid, yet the host's checks see it.
    assert str(GID) in groups or (driver.name == "process" and "65534" in groups)
    assert "wrote" in out and "digits" in out
    assert "Read-only file system" in out  # a dataset is read-only
    notes = storage_dir / "homes" / str(VOLUME) / "notes.txt"
    info = notes.stat()
    assert info.st_uid == host_uid(driver, 101)  # written by the sandbox's own uid
    if os.geteuid() == 0:
        volume = (storage_dir / "homes" / str(VOLUME)).stat()
        assert (volume.st_uid, volume.st_gid, stat.S_IMODE(volume.st_mode)) == (0, GID, 0o2770)
        assert info.st_gid == GID
    # Group read-write: a sandbox of another uid (an MPS share's, a colleague's in a project
    # folder) reaches the volume through its group.
    assert stat.S_IMODE(info.st_mode) & 0o060 == 0o060
    driver.stop(handle, grace_s=0)

    # Another sandbox with no owner named: another id, so another uid, on the same storage.
    script = f"cat $HOME/notes.txt; echo two >> $HOME/notes.txt; echo {READY}; sleep 300"
    second = driver.launch(spec(202, script))
    out = output_of(driver, second, READY)
    assert "one" in out
    assert notes.read_text() == "one\ntwo\n"
    if driver.name == "libvirt":
        return  # a VM's terminal is its console, which its command holds
    # The web terminal has the same storage, with the same group.
    terminal = driver.exec_terminal(second)
    try:
        terminal.write(b"touch $HOME/from-terminal && echo TERMINAL-$((40+2))\n")  # not its echo
        seen = b""
        deadline = time.monotonic() + 10
        while b"TERMINAL-42" not in seen and time.monotonic() < deadline:
            seen += terminal.read(0.2)
        assert b"TERMINAL-42" in seen, seen
    finally:
        terminal.close()
    assert (storage_dir / "homes" / str(VOLUME) / "from-terminal").exists()


@pytest.mark.parametrize(
    "source", ["../etc", "/etc", "homes/../../etc", "homes//7", "./homes/7", "escape/7", "escape"]
)
def test_a_path_outside_the_storage_root_is_refused(make: tuple, storage_dir: Path, source: str) -> None:
    driver, spec = make
    (storage_dir / "escape").symlink_to("/etc")  # an admin's (or an attacker's) symlink
    forged = StorageMount("home", source, "/home/sandbox", False, GID, VOLUME)
    with pytest.raises(DriverError, match="storage"):
        driver.launch(spec(303, "sleep 300", mounts=(forged,)))
    assert driver.list_owned() == []
    assert not Path("/etc/7").exists()


@pytest.mark.parametrize("target", ["/", "/etc", "/usr/lib", "/proc", "/dev/shm", "/tmp", "home"])
def test_a_mount_point_over_the_sandboxes_own_paths_is_refused(make: tuple, target: str) -> None:
    driver, spec = make
    mount = StorageMount("home", "homes/7", target, False, GID, VOLUME)
    with pytest.raises(DriverError, match="storage"):
        driver.launch(spec(304, "sleep 300", mounts=(mount,)))
    assert driver.list_owned() == []


APP = (
    "import http.server, os, socketserver\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        said = 'hello from ' + os.environ['GPUSHARE_APP_URL'] + ' as ' + str(os.getuid())\n"
    "        body = said.encode()\n"
    "        self.send_response(200)\n"
    "        self.send_header('content-length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "class S(socketserver.UnixStreamServer):\n"
    "    def get_request(self):\n"
    "        conn, _ = super().get_request(); return conn, ('', 0)\n"
    # READY once the server listens: its socket file exists from bind(), a moment before
    # listen(), and a connect in between is refused (seen once in CI, under load).
    "server = S(os.environ['GPUSHARE_APP_SOCKET'], H)\n"
    "print('READY', flush=True)\n"
    "server.serve_forever()\n"
)


@pytest.mark.bwrap
def test_a_process_sandboxes_app_is_reached_through_its_socket(storage_dir: Path, tmp_path: Path) -> None:
    """The agent's side of the portal's app proxy: the sandbox's app listens on its socket
    (no network), and ``open_app`` connects to it from the host; another sandbox's is apart."""
    from workers.drivers.process import ProcessDriver, bwrap_available

    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
    apps = Path(tempfile.mkdtemp(prefix="apps-", dir="/var/tmp"))
    driver = ProcessDriver(tmp_path / "state", host="h", storage_dir=storage_dir, apps_dir=apps)
    spec = make_spec("h", 404, "", command=("python3", "-c", APP), mounts=(), app=True,
                     env={"GPUSHARE_APP_URL": "/sandboxes/404/app/"})  # fmt: skip
    handle = driver.launch(spec)
    try:
        output_of(driver, handle, "READY")
        deadline = time.monotonic() + 20
        while not (apps / spec.allocation_key / "app.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stream = driver.open_app(handle)
        stream.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        with contextlib.suppress(EOFError):
            while True:
                answer += stream.read(1.0)
        stream.close()
        assert answer.startswith(b"HTTP/1.0 200") and b"hello from /sandboxes/404/app/ as 1000" in answer
        folder = (apps / spec.allocation_key).stat()
        assert stat.S_IMODE(folder.st_mode) == 0o700  # only the sandbox (and root) may enter
        if os.geteuid() == 0:
            assert folder.st_uid == uids.sandbox_uid(404)
    finally:
        driver.stop(handle, grace_s=0)
        shutil.rmtree(apps, ignore_errors=True)
    assert not (apps / spec.allocation_key).exists()
    with pytest.raises(DriverError, match="not listening"):
        driver.open_app(handle)
