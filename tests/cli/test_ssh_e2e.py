"""SSH into a sandbox through the portal, with the real OpenSSH client: the platform's web
server, control worker and an agent running Docker containers of the sandbox image (whose
sshd runs per connection as the sandbox's user), and the command-line client from a fresh
virtualenv (tests/cli/test_cli_e2e.py's). A scenario of steps: sign in and start a sandbox;
``gpushare ssh-config --write`` makes a key and adds it; ``ssh gpushare-<id> echo hi``; scp
in and back out; ``ssh -L`` to a web server on the sandbox's loopback, with no listening
socket opened on the host but the client's own; the history says who opened SSH; once the
sandbox is stopped, ssh is refused with the portal's reason."""

from __future__ import annotations

import os
import re
import subprocess
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.accounts.models import ApiToken, SshKey
from tests.cli import test_cli_e2e
from tests.cli.test_cli_e2e import REQUEST, Client, url, wait_for
from tests.e2e.platform import Platform
from tests.workers.listening import listening, page_through
from tests.workers.test_sshd import HTTP_SERVER, assert_no_host_port, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow]
# The client's fresh virtualenv and the platform with its Docker agent, as the CLI's scenario has them.
client = test_cli_e2e.client
platform = test_cli_e2e.platform


def openssh(
    client: Client, program: str, *argv: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``ssh`` or ``scp`` as the client's user runs them: the user's ssh config (OpenSSH finds
    ~ in the passwd file, not $HOME: named here), the client's environment for its ProxyCommand."""
    env = {
        "PATH": f"{client.venv / 'bin'}:/usr/bin:/bin", "HOME": str(client.home),
        "XDG_CONFIG_HOME": str(client.home / "config"), "LANG": "C.UTF-8",
    }  # fmt: skip
    config = str(client.home / ".ssh" / "config")
    return subprocess.run(
        [program, "-F", config, "-o", "BatchMode=yes", *argv], capture_output=True, text=True, env=env,
        cwd=client.home, timeout=timeout,
    )  # fmt: skip


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestSshThroughThePortal:
    def test_01_sign_in_and_start_a_sandbox(
        self, client: Client, platform: Platform, world: Any, state: dict[str, Any]
    ) -> None:
        _, key = ApiToken.issue(
            world["owner"], "laptop", ["read:usage", "write:sandboxes"], timezone.now() + timedelta(days=1)
        )
        assert client("login", url(platform), "--token-stdin", stdin=key + "\n").code == 0
        done = client(*REQUEST, "--name", "e2e-ssh", "--wait", "--timeout", "120")
        assert done.code == 0, done
        state["id"] = int(done.out.strip())

    def test_02_ssh_config_makes_a_key_and_adds_it_to_the_account(
        self, client: Client, world: Any, state: dict[str, Any]
    ) -> None:
        done = client("ssh-config", "--write", "--json")
        assert done.code == 0, done
        document = done.json()
        assert document["key_made"] and document["key_added"], document
        [key] = SshKey.objects.filter(user=world["owner"])
        assert key.fingerprint == document["fingerprint"]
        assert "Include" in (client.home / ".ssh" / "config").read_text()

    def test_03_ssh_runs_echo_hi_in_the_sandbox(self, client: Client, state: dict[str, Any]) -> None:
        done = openssh(client, "ssh", f"gpushare-{state['id']}", "echo hi; id -un")
        assert done.returncode == 0, done
        assert done.stdout == "hi\nsandbox\n", done
        assert "Permanently added 'gpushare-" in done.stderr  # its host key, trusted on first use

    def test_04_scp_copies_a_file_in_and_back_out(self, client: Client, state: dict[str, Any]) -> None:
        original = client.home / "weights.bin"
        original.write_bytes(os.urandom(200_000))
        host = f"gpushare-{state['id']}"
        sent = openssh(client, "scp", str(original), f"{host}:weights.bin")
        assert sent.returncode == 0, sent
        back = client.home / "back.bin"
        fetched = openssh(client, "scp", f"{host}:weights.bin", str(back))
        assert fetched.returncode == 0, fetched
        assert back.read_bytes() == original.read_bytes()

    def test_05_ssh_forwards_a_port_to_a_server_inside_and_no_host_port_opens(
        self, client: Client, state: dict[str, Any]
    ) -> None:
        host = f"gpushare-{state['id']}"
        before = listening()
        started = openssh(
            client,
            "ssh",
            host,
            f"nohup {HTTP_SERVER} </dev/null >/tmp/http.log 2>&1 & sleep 1; cat /tmp/http.log",
        )
        assert "listening" in started.stdout, started
        local = free_port()
        env = {"PATH": f"{client.venv / 'bin'}:/usr/bin:/bin", "HOME": str(client.home),
               "XDG_CONFIG_HOME": str(client.home / "config")}  # fmt: skip
        forward = subprocess.Popen(
            ["ssh", "-F", str(client.home / ".ssh" / "config"), "-o", "BatchMode=yes", "-N",
             "-L", f"127.0.0.1:{local}:127.0.0.1:8111", host],
            env=env, cwd=client.home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            assert page_through(local) == "hello from inside\n"
            assert_no_host_port(before, local)
        finally:
            forward.terminate()
            forward.wait(timeout=15)

    def test_06_the_history_says_who_opened_ssh(self, client: Client, state: dict[str, Any]) -> None:
        done = client("logs", str(state["id"]))
        assert done.code == 0 and "ssh opened by olivia" in done.out, done.out

    def test_07_a_stopped_sandbox_refuses_ssh_saying_why(
        self, client: Client, platform: Platform, state: dict[str, Any]
    ) -> None:
        assert client("stop", str(state["id"])).code == 0
        wait_for(
            lambda: client("show", str(state["id"]), "--json").json()["state"] == "stopped", 60, "the stop"
        )
        done = openssh(client, "ssh", f"gpushare-{state['id']}", "true")
        assert done.returncode == 255, done
        assert re.search(r"SSH to sandbox \d+ refused: The sandbox is stopped, not running\.", done.stderr), (
            done
        )
