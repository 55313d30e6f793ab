"""A sandbox's app socket folder is the tenant's: whatever it plants as ``app.sock`` (a symlink
to a root-only socket of the host or, through ``/proc/<pid>/root``, to another sandbox's app;
a hard link; a FIFO; a socket of another uid) the agent connects to nothing, and the owner
hears that the app is not listening. Real bubblewrap and Docker sandboxes."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.test_driver_storage import driver_for, make_spec, output_of
from wire import relay
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers import app_socket
from workers.drivers.base import DriverError, SandboxDriver

# The app: answers each connection with its name and how many it has had, so a victim app
# tells whether anyone but its owner reached it. Perl: in the Debian minbase image as well as
# on the host a process sandbox runs from.
APP = (
    "use IO::Socket::UNIX; $| = 1;"
    "my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Local => $ENV{GPUSHARE_APP_SOCKET}, Listen => 5)"
    " or die qq(listen: $!);"
    "print qq(READY\\n); my $n = 0;"
    "while (my $c = $s->accept) { $n++; print $c qq(app of $ENV{APP_NAME}, connection $n\\n); close $c }"
)


class Sandboxes:
    """A real driver with its app folders in a root of the test's, and the sandboxes it ran."""

    def __init__(self, driver: SandboxDriver, image: str, host: str, apps: Path) -> None:
        self.driver, self.image, self.host, self.apps = driver, image, host, apps
        self.driver.apps_dir = apps  # type: ignore[attr-defined]

    def launch(self, sandbox_id: int, command: str, **env: str) -> tuple[SandboxSpec, SandboxHandle]:
        spec = make_spec(self.host, sandbox_id, "", self.image, command=("sh", "-c", command), mounts=(),
                         app=True, env=env)  # fmt: skip
        handle = self.driver.launch(spec)
        output_of(self.driver, handle, "READY")
        return spec, handle

    def app_dir(self, spec: SandboxSpec) -> Path:
        return self.apps / spec.allocation_key

    def ask(self, handle: SandboxHandle) -> str:
        stream = self.driver.open_app(handle)
        answer = b""
        with contextlib.suppress(EOFError):
            while True:
                answer += stream.read(1.0)
        stream.close()
        return answer.decode()

    def refused(self, handle: SandboxHandle) -> str:
        with pytest.raises(DriverError) as raised:
            self.driver.open_app(handle)
        assert relay.NOT_LISTENING in str(raised.value)
        return str(raised.value)


@pytest.fixture(
    params=[
        pytest.param("process", marks=pytest.mark.bwrap),
        pytest.param("docker", marks=pytest.mark.docker),
    ]
)
def sandboxes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sandboxes]:
    # Under /var/tmp, not tmp_path (0700 parents): a process sandbox's uid binds its folder.
    storage = Path(tempfile.mkdtemp(prefix="gpushare-storage-", dir="/var/tmp"))
    apps = Path(tempfile.mkdtemp(prefix="gpushare-apps-", dir="/var/tmp"))
    host = f"test-{uuid.uuid4().hex[:8]}"
    driver, image = driver_for(request.param, host, storage, tmp_path / "state")
    yield Sandboxes(driver, image, host, apps)
    for handle in driver.list_owned():
        driver.stop(handle, grace_s=0)
    shutil.rmtree(apps, ignore_errors=True)
    shutil.rmtree(storage, ignore_errors=True)


class Listener:
    """A root-only unix socket of the host (0600 in a 0700 folder), as Docker's or an MPS
    daemon's is: it must never see the agent connect on a tenant's behalf."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        os.chmod(path, 0o600)
        self.sock.listen()
        self.sock.setblocking(False)

    def connections(self) -> int:
        """Connections made so far: a unix connect() is queued here before it returns, so one
        the agent made is waiting already."""
        count = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                conn, _ = self.sock.accept()
                conn.close()
                count += 1
        return count

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    folder = Path(tempfile.mkdtemp(prefix="probe-", dir="/var/tmp"))  # 0700, root's
    probe = Listener(folder / "probe.sock")
    yield probe
    probe.close()
    shutil.rmtree(folder, ignore_errors=True)


PLANT_AND_WAIT = "{plant} && echo READY && exec sleep 300"


def test_the_app_itself_is_reached(sandboxes: Sandboxes) -> None:
    """What the checks let through: the socket the sandbox's app made in its own folder."""
    _, handle = sandboxes.launch(501, f"exec perl -e '{APP}'", APP_NAME="mine")
    assert sandboxes.ask(handle) == "app of mine, connection 1\n"
    assert sandboxes.ask(handle) == "app of mine, connection 2\n"


def test_a_symlink_to_a_root_only_host_socket_reaches_nothing(
    sandboxes: Sandboxes, listener: Listener
) -> None:
    plant = f"ln -s {listener.path} {app_socket.APP_SOCKET}"
    _, handle = sandboxes.launch(502, PLANT_AND_WAIT.format(plant=plant))
    said = sandboxes.refused(handle)
    assert "symlink" in said
    assert listener.connections() == 0


def test_a_symlink_to_another_sandboxes_app_through_proc_reaches_nothing(sandboxes: Sandboxes) -> None:
    _, victim = sandboxes.launch(503, f"exec perl -e '{APP}'", APP_NAME="victim")
    pid = sandboxes.driver.pids(victim)[-1]  # type: ignore[attr-defined]  # a process in its mount namespace
    plant = f"ln -s /proc/{pid}/root{app_socket.APP_SOCKET} {app_socket.APP_SOCKET}"
    _, attacker = sandboxes.launch(504, PLANT_AND_WAIT.format(plant=plant))
    sandboxes.refused(attacker)
    # The victim's app had no connection before its owner's: it accepts them in order.
    assert sandboxes.ask(victim) == "app of victim, connection 1\n"


def test_a_fifo_planted_as_the_socket_is_refused_without_waiting(sandboxes: Sandboxes) -> None:
    _, handle = sandboxes.launch(505, PLANT_AND_WAIT.format(plant=f"mkfifo {app_socket.APP_SOCKET}"))
    assert "FIFO" in sandboxes.refused(handle)


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root agent's sandboxes run as its own uid")
def test_a_socket_of_another_uid_in_the_folder_reaches_nothing(sandboxes: Sandboxes) -> None:
    spec, handle = sandboxes.launch(506, PLANT_AND_WAIT.format(plant="true"))
    # Root's own socket where the app's would be (the tenant cannot chown; a rename or a bug
    # could put one there): not the folder owner's, so not the app.
    foreign = Listener(sandboxes.app_dir(spec) / "app.sock")
    try:
        assert "belongs to uid 0" in sandboxes.refused(handle)
        assert foreign.connections() == 0
    finally:
        foreign.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root agent's sandboxes run as its own uid")
def test_a_hard_link_planted_as_the_socket_reaches_nothing(sandboxes: Sandboxes) -> None:
    spec, handle = sandboxes.launch(507, PLANT_AND_WAIT.format(plant="true"))
    folder = sandboxes.app_dir(spec)
    # A socket elsewhere on the folder's file system, even one of the sandbox's uid: a second
    # name for it is not the app's own.
    decoy = Listener(sandboxes.apps / f"decoy-{uuid.uuid4().hex[:6]}.sock")
    try:
        owner = folder.stat().st_uid
        os.chown(decoy.path, owner, owner)
        os.link(decoy.path, folder / "app.sock")
        assert "2 names" in sandboxes.refused(handle)
        assert decoy.connections() == 0
    finally:
        decoy.close()
        decoy.path.unlink()


def test_a_stopped_sandboxes_folder_goes_without_its_links_targets(sandboxes: Sandboxes) -> None:
    """Removing the folder (at stop, and before a launch reuses it) follows none of what the
    tenant left there."""
    kept = Path(tempfile.mkdtemp(prefix="kept-", dir="/var/tmp"))
    (kept / "file").write_text("still here")
    try:
        here = app_socket.APP_DIR
        plant = f"mkdir {here}/sub && ln -s {kept} {here}/sub/host && ln -s {kept}/file {here}/f"
        spec, handle = sandboxes.launch(508, PLANT_AND_WAIT.format(plant=plant))
        assert (sandboxes.app_dir(spec) / "sub" / "host").is_symlink()
        sandboxes.driver.stop(handle, grace_s=0)
        assert not sandboxes.app_dir(spec).exists()
        assert (kept / "file").read_text() == "still here"
    finally:
        shutil.rmtree(kept)
