"""An MPS pipe directory is written by the GPU's tenants (their CUDA and MPS servers make their
pipes there, as the GPU's MPS uid and gid): root's 1770 (sticky), so they cannot remove or
replace the daemon's ``control`` socket and pid file while it runs, and what they plant while
none runs (a FIFO or a symlink for the pid file, a link or a socket of their own for the
control socket, folders) is never followed, opened or waited on by the agent. Real bubblewrap
and Docker sandboxes plant them, on a stand-in control daemon (tests/workers/test_mps_manager.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.test_app_socket_paths import Listener
from tests.workers.test_driver_storage import driver_for, make_spec, output_of
from tests.workers.test_mps_manager import GPU_A, _no_systemd, control_binary, modes, var_dir  # noqa: F401 - fixtures
from wire import uids
from wire.spec import SandboxHandle
from workers.drivers.base import DriverError, SandboxDriver, require_mps_pipe
from workers.gpu.mps import PID_FILE, MpsManager
from workers.gpu.nvml import NvmlBackend

PIPE = "$CUDA_MPS_PIPE_DIRECTORY"
PID = f"{PIPE}/{PID_FILE}"


class Tenants:
    """A real driver whose sandboxes share GPU_A through MPS, and the daemon's manager."""

    def __init__(self, driver: SandboxDriver, image: str, host: str, manager: MpsManager) -> None:
        self.driver, self.image, self.host, self.manager = driver, image, host, manager
        self.pipe = manager.pipe_dir(GPU_A)

    def launch(self, sandbox_id: int, script: str) -> SandboxHandle:
        share = self.manager.share(GPU_A, 25, 1024)
        spec = make_spec(self.host, sandbox_id, f"{script} && echo READY; exec sleep 300", self.image,
                         mounts=(), mps=share, device_uuids=(GPU_A,), real_gpu=False)  # fmt: skip
        handle = self.driver.launch(spec)
        output_of(self.driver, handle, "READY")
        return handle

    def daemon_pid(self) -> int:
        return int((self.pipe / PID_FILE).read_text())


@pytest.fixture(
    params=[
        pytest.param("process", marks=pytest.mark.bwrap),
        pytest.param("docker", marks=pytest.mark.docker),
    ]
)
def tenants(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    var_dir: Path,  # noqa: F811
    control_binary: Path,  # noqa: F811
    modes: NvmlBackend,  # noqa: F811
) -> Iterator[Tenants]:
    var_dir.chmod(0o711)  # a process sandbox's uid binds the pipe directory: it passes through
    storage = Path(tempfile.mkdtemp(prefix="gpushare-storage-", dir="/var/tmp"))
    host = f"test-{uuid.uuid4().hex[:8]}"
    driver, image = driver_for(request.param, host, storage, tmp_path / "state")
    manager = MpsManager(var_dir / "mps", control_binary=str(control_binary), compute_modes=modes)
    manager.start(GPU_A)
    daemon = int((manager.pipe_dir(GPU_A) / PID_FILE).read_text())
    yield Tenants(driver, image, host, manager)
    for handle in driver.list_owned():
        driver.stop(handle, grace_s=0)
    with contextlib.suppress(Exception):  # MpsError or OSError: a test left it broken on purpose
        manager.stop(GPU_A)  # the daemon a test started again, which the kill below misses
    with contextlib.suppress(ProcessLookupError):
        os.kill(daemon, signal.SIGTERM)  # its pid file may be the tenant's by now
    planted = manager.pipe_dir(GPU_A) / PID_FILE  # var_dir's cleanup reads it: no FIFO there
    with contextlib.suppress(OSError):
        kind = planted.lstat().st_mode
        planted.rmdir() if stat.S_ISDIR(kind) else planted.unlink()
    shutil.rmtree(storage, ignore_errors=True)


@pytest.fixture
def secret() -> Iterator[Path]:
    """A root-only file of the host holding a live pid: what a planted link would have the
    agent read as the daemon's."""
    folder = Path(tempfile.mkdtemp(prefix="probe-", dir="/var/tmp"))
    (folder / "secret").write_text(f"{os.getpid()}\n")
    (folder / "secret").chmod(0o600)
    yield folder / "secret"
    shutil.rmtree(folder)


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a non-root agent's sandboxes run as its own uid")


def test_a_tenant_cannot_remove_or_replace_the_running_daemons_socket_or_pid_file(tenants: Tenants) -> None:
    """The pipe directory was the MPS uid's 0700: a tenant's ``rm control`` sent every later
    CUDA process of every tenant on the GPU past MPS (review 3 §1.1 item 2)."""
    daemon = tenants.daemon_pid()
    tried = f"rm -f {PID} {PIPE}/control; mv {PIPE}/control {PIPE}/moved; mkfifo {PIPE}/mine; true"
    tenants.launch(701, tried)
    for name in ("control", PID_FILE):
        assert (tenants.pipe / name).lstat().st_uid == os.geteuid(), name  # root's, still there
    assert (tenants.pipe / "control").is_socket() and tenants.daemon_pid() == daemon
    assert stat.S_ISFIFO((tenants.pipe / "mine").lstat().st_mode)  # its own files it may make
    assert tenants.manager.running(GPU_A)


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_a_pid_file_planted_while_no_daemon_runs_is_never_read(
    tenants: Tenants, secret: Path, planted: str
) -> None:
    """Opening a FIFO nobody writes blocks (the agent's MPS lock, and every MPS launch, with
    it); a link would have the agent read a root-only file naming a live pid. Neither is the
    daemon's identity any more: it is not read at all."""
    tenants.manager.stop(GPU_A)  # a daemon gone while its tenants stay (it crashed, say)
    plant = f"mkfifo {PID}" if planted == "fifo" else f"ln -s {secret} {PID}"
    tenants.launch(702, plant)
    assert not tenants.manager.running(GPU_A)
    assert tenants.manager.start(GPU_A) is True  # cleared, and a daemon of its own again
    assert tenants.manager.running(GPU_A)


def test_what_tenants_left_in_a_stopped_daemons_pipe_dir_is_cleared_not_followed(tenants: Tenants) -> None:
    """A folder where the pid file goes, a link where the socket goes, links into the host's
    folders: the next daemon starts all the same, and the host's folders keep their files."""
    kept = Path(tempfile.mkdtemp(prefix="kept-", dir="/var/tmp"))
    (kept / "file").write_text("still here")
    try:
        plant = (
            f"mkdir {PID} && ln -s {kept} {PIPE}/control && mkdir {PIPE}/d "
            f"&& ln -s {kept}/file {PIPE}/d/f && ln -s {kept} {PIPE}/d/dir"
        )
        tenants.manager.stop(GPU_A)  # a daemon gone while its tenants stay (it crashed, say)
        tenants.launch(703, plant)
        assert (tenants.pipe / PID_FILE).is_dir()
        assert tenants.manager.start(GPU_A) is True
        assert tenants.manager.running(GPU_A) and (tenants.pipe / "control").is_socket()
        assert (
            sorted(p.name for p in kept.iterdir()) == ["file"] and (kept / "file").read_text() == "still here"
        )
        tenants.manager.stop(GPU_A)
    finally:
        shutil.rmtree(kept)


@pytest.mark.parametrize("planted", ["symlink to another daemon's socket", "a socket of its own"])
def test_a_control_socket_the_daemon_did_not_make_fails_the_launch_check(
    tenants: Tenants, planted: str
) -> None:
    """CUDA that cannot reach its daemon runs without MPS: a launch checks the socket, and only
    the daemon's own passes (the launch check of real GPUs, here run by hand)."""
    folder = Path(tempfile.mkdtemp(prefix="probe-", dir="/var/tmp"))
    other = Listener(folder / "control")  # root's and 0666: as another GPU's daemon makes it
    os.chmod(other.path, 0o666)  # noqa: S103 - as the daemon makes its socket
    folder.chmod(0o755)
    try:
        if planted.startswith("symlink"):
            plant = f"rm -f {PIPE}/control && ln -s {other.path} {PIPE}/control"
        else:
            bind = "IO::Socket::UNIX->new(Type => SOCK_STREAM(), Local => $ARGV[0], Listen => 1);"
            bind += " chmod 0777, $ARGV[0]"
            plant = f"rm -f {PIPE}/control && perl -MIO::Socket::UNIX -e '{bind}' {PIPE}/control"
        tenants.manager.stop(GPU_A)  # the daemon's own socket cannot be removed while it runs
        tenants.launch(704, plant)
        with pytest.raises(DriverError, match="is not the MPS daemon's socket"):
            require_mps_pipe(str(tenants.pipe), uids.mps_uid(GPU_A), real_gpu=True, socket_wait_s=0)
        assert other.connections() == 0
    finally:
        other.close()
        shutil.rmtree(folder)
