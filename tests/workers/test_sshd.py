"""The sandbox's sshd (workers/drivers/sshd.py): its configuration and the keys it is given,
then the real OpenSSH client logging in to a real process sandbox (bubblewrap) and a real
container through the driver's ``open_ssh`` alone (``tests/workers/ssh_proxy.py`` as the
ProxyCommand): a command, scp both ways, ``ssh -L`` to a server inside, and no listening
socket added on the host. Through the portal: tests/cli/test_ssh_e2e.py."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workers.engines import require_engine
from tests.workers.listening import Listener, listening, new_listeners, page_through
from tests.workers.test_process_driver import make_spec
from wire.ssh import bare_key
from workers.drivers.base import DriverError
from workers.drivers.sshd import MultiplexedServer, Server, session_environment, sshd_config

REPO = Path(__file__).resolve().parents[2]
ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA0EakXojEzSDFAISLn4t0CKUiHj4Xous65ZINhXhetj"


# --- no engine needed -------------------------------------------------------------------------


def test_the_server_lets_in_public_keys_only_for_the_sandboxs_user() -> None:
    config = sshd_config("abc123").splitlines()
    for line in (
        "AuthenticationMethods publickey", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin no", "AllowUsers sandbox", "AllowTcpForwarding local", "PermitListen none",
        "AllowAgentForwarding no", "X11Forwarding no", "PidFile none", "Subsystem sftp internal-sftp",
        "AuthorizedKeysFile /tmp/.gpushare-ssh/abc123/authorized_keys",  # this connection's keys alone
    ):  # fmt: skip
        assert line in config, line
    assert not any(line.startswith("SetEnv") for line in config)  # one line, the wrapper's


def test_the_sandboxs_environment_reaches_its_sessions_quoted_for_sshd() -> None:
    line = session_environment(
        {"CUDA_VISIBLE_DEVICES": "MIG-1", "Q": 'a "b" c\\d', "HOME": "/x", "BAD": "x\ny", "1X": "v"}
    )
    assert line == '"CUDA_VISIBLE_DEVICES=MIG-1" "Q=a \\"b\\" c\\\\d"'  # no HOME (sshd's), no newline


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ([], "no SSH key"),
        ([f'command="sh" {ED25519}'], "not a public key"),
        ([f"{ED25519}\nssh-ed25519 AAAA"], "not a public key"),
        ([f"{ED25519} comment"], "not a public key"),
        ([ED25519] * 101, "more than 100"),
    ],
)
def test_anything_but_bare_keys_is_refused_before_the_sandbox_is_entered(keys: list[str], says: str) -> None:
    with pytest.raises(DriverError, match=says):
        Server.for_keys(keys, {})


def test_a_connection_gets_a_session_of_its_own() -> None:
    one, two = Server.for_keys([ED25519], {}), Server.for_keys([ED25519], {})
    assert one.env["GPUSHARE_SSH_SESSION"] != two.env["GPUSHARE_SSH_SESSION"]
    assert one.env["GPUSHARE_SSH_KEYS"] == ED25519 and bare_key(ED25519) == ED25519
    assert one.argv[:2] == ["/bin/sh", "-c"]


def test_the_engines_framed_stream_gives_stdout_and_keeps_stderr_for_the_reason() -> None:
    ours, theirs = socket.socketpair()
    frame = lambda kind, data: bytes([kind, 0, 0, 0]) + len(data).to_bytes(4, "big") + data  # noqa: E731
    theirs.sendall(frame(1, b"SSH-2.0-x\r\n") + frame(2, b"no host key")[:5])
    server = MultiplexedServer(ours, lambda: 255)
    assert server.read(1) == b"SSH-2.0-x\r\n"
    theirs.sendall(frame(2, b"no host key")[5:] + frame(1, b"more"))
    assert server.read(1) == b"more"
    theirs.close()
    with pytest.raises(EOFError, match=r"sshd ended \(status 255\): no host key"):
        while True:
            server.read(1)
    server.close()


# --- the real client against real sandboxes ---------------------------------------------------


def assert_no_host_port(before: dict[str, Listener], client_port: int) -> None:
    """No listening socket on the host but the ssh client's own ``-L`` one: not the sandbox's
    server (8111, in its own namespace), nothing of its sshd's. Other processes of this machine
    (other tests) may open ports meanwhile: only ones held by ssh, sshd or the relay count."""
    added = new_listeners(before)
    assert not any(port == 8111 for _address, port in added), added
    ours = {where: command for where, command in added.items() if "ssh" in command or "gpushare" in command}
    assert all(port == client_port and command.startswith("ssh ") for (_a, port), command in ours.items()), (
        ours
    )
    assert any(port == client_port for _a, port in added), added  # the check sees what opens


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# A web server on the sandbox's own loopback, in Perl: the image has no Python, and a
# process sandbox has the host's Perl in its /usr as well.
HTTP_SERVER = (
    "perl -MIO::Socket::INET -e '$| = 1; "
    '$s = IO::Socket::INET->new(LocalAddr => "127.0.0.1:8111", Listen => 5, ReuseAddr => 1) or die "$!"; '
    'print "listening\\n"; while ($c = $s->accept) { <$c>; '
    'print $c "HTTP/1.0 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\nhello from inside\\n"; close $c }\''
)


class Client:
    """The real OpenSSH client, with the driver's stream as its ProxyCommand."""

    def __init__(self, tmp: Path, kind: str, state_dir: Path, allocation_key: str) -> None:
        self.tmp = tmp
        key = tmp / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        proxy = f"{sys.executable} -m tests.workers.ssh_proxy {kind} {state_dir} {allocation_key} {key}.pub"
        self.options = [
            "-F", "/dev/null", "-o", f"ProxyCommand={proxy}", "-o", f"UserKnownHostsFile={tmp}/known_hosts",
            "-o", "StrictHostKeyChecking=accept-new", "-o", "IdentitiesOnly=yes", "-i", str(key),
            "-o", "BatchMode=yes",
        ]  # fmt: skip

    def __call__(self, program: str, *argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [program, *self.options, *argv], cwd=REPO, capture_output=True, text=True, timeout=120, **kwargs
        )


@pytest.fixture(
    params=[
        pytest.param("process", marks=pytest.mark.bwrap),
        pytest.param("docker", marks=pytest.mark.docker),
    ]
)
def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Client, Any]]:
    require_engine(shutil.which("ssh") is not None and shutil.which("scp") is not None, "OpenSSH's client")
    state_dir = tmp_path / "state"
    spec_options: dict[str, Any] = {"pids_limit": 128, "memory_limit_mib": 256, "command": ("sleep", "300")}
    if request.param == "process":
        from workers.drivers.process import ProcessDriver, bwrap_available

        require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
        require_engine(Path("/usr/sbin/sshd").exists(), "OpenSSH's server binary (openssh-server)")
        driver: Any = ProcessDriver(state_dir, host="h1")
    else:
        from workers.drivers.docker import DockerDriver, docker_available

        require_engine(docker_available(), "Docker engine")
        built = subprocess.run(
            [REPO / "scripts" / "build-sandbox-image.sh"], capture_output=True, check=False
        )
        require_engine(built.returncode == 0, "the sandbox image")
        driver = DockerDriver(host=f"test-{uuid.uuid4().hex[:10]}")
        spec_options.update(image="gpushare/sandbox-base:1", host=driver.host)
    handle = driver.launch(make_spec(**spec_options))
    try:
        yield Client(tmp_path, request.param, state_dir, handle.allocation_key), handle
    finally:
        driver.stop(handle, grace_s=0)


def test_the_real_client_runs_copies_and_forwards_through_the_driver(
    sandbox: tuple[Client, Any], tmp_path: Path
) -> None:
    ssh, _handle = sandbox
    before = listening()
    ran = ssh("ssh", "sandbox@sandbox", "echo hi; id -un; echo $FOO")
    assert ran.returncode == 0 and ran.stdout == "hi\nsandbox\nbar\n", ran
    (tmp_path / "in.txt").write_bytes(b"\x00binary\xff" * 1000)
    assert ssh("scp", str(tmp_path / "in.txt"), "sandbox@sandbox:copied.bin").returncode == 0
    back = ssh("scp", "sandbox@sandbox:copied.bin", str(tmp_path / "out.txt"))
    assert back.returncode == 0 and (tmp_path / "out.txt").read_bytes() == (tmp_path / "in.txt").read_bytes()
    started = ssh(
        "ssh",
        "sandbox@sandbox",
        f"nohup {HTTP_SERVER} </dev/null >/tmp/http.log 2>&1 & sleep 1; cat /tmp/http.log",
    )
    assert "listening" in started.stdout, started
    local = free_port()
    forward = subprocess.Popen(
        ["ssh", *ssh.options, "-N", "-L", f"127.0.0.1:{local}:127.0.0.1:8111", "sandbox@sandbox"], cwd=REPO
    )
    try:
        assert page_through(local) == "hello from inside\n"
        assert_no_host_port(before, local)
    finally:
        forward.terminate()
        forward.wait(timeout=10)
