"""``gpushare ssh-config`` and ``gpushare ssh-proxy`` (client/gpushare_client/ssh.py): the
entry OpenSSH reads, checked by the real ``ssh -G``; ``--write`` making and adding a key once,
and including its file first in ``~/.ssh/config`` (through a symlink); the proxy forgetting a
sandbox's host key when the sandbox runs another attempt, relaying bytes both ways against a
stand-in of the portal's socket, and saying why the portal refused. Against the real portal,
sshd and client: tests/cli/test_ssh_e2e.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httpx
import pytest
from gpushare_client import ssh
from gpushare_client.exits import ClientError
from gpushare_client.ssh import config_text, forget_host_key, sandbox_of
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve

from tests.cli.conftest import Run
from tests.cli.fake_portal import BASE, TOKEN, FakePortal, page, sandbox

REPO = Path(__file__).resolve().parents[2]
needs_openssh = pytest.mark.skipif(
    shutil.which("ssh") is None or shutil.which("ssh-keygen") is None,
    reason="OpenSSH's client is not installed",
)


def test_a_sandbox_is_named_as_ssh_passes_it() -> None:
    assert sandbox_of("gpushare-42") == 42 and sandbox_of("42") == 42
    for wrong in ("gpushare-", "gpushare-x", "other-42", "gpushare-٤٢", "0"):
        with pytest.raises(ClientError):
            sandbox_of(wrong)


@needs_openssh
def test_openssh_reads_the_entry_for_every_sandbox(tmp_path: Path) -> None:
    folder = tmp_path / "my config"  # a space: quoted for ssh_config
    entry = tmp_path / "entry"
    entry.write_text(config_text("https://gpus.example.org", folder, folder / "id_ed25519", "/opt/py thon"))
    done = subprocess.run(
        ["ssh", "-G", "-F", str(entry), "gpushare-42"], capture_output=True, text=True, check=True
    )
    resolved = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert resolved["proxycommand"] == "'/opt/py thon' -m gpushare_client ssh-proxy %n"  # %n: gpushare-42
    assert resolved["user"] == "sandbox" and resolved["identityfile"] == str(folder / "id_ed25519")
    assert resolved["userknownhostsfile"] == str(folder / "known_hosts")
    assert resolved["stricthostkeychecking"] == "accept-new" and resolved["identitiesonly"] == "yes"
    assert resolved["hashknownhosts"] == "no"  # ssh-proxy finds gpushare-<id>'s line by its name
    assert resolved["forwardagent"] == "no" and resolved["serveraliveinterval"] == "60"
    other = subprocess.run(["ssh", "-G", "-F", str(entry), "example.org"], capture_output=True, text=True)
    assert "proxycommand" not in other.stdout  # other hosts are left alone


def test_without_write_it_prints_the_entry_and_touches_nothing(gpushare: Run) -> None:
    done = gpushare("ssh-config")
    assert done.code == 0 and done.out.startswith("# Written by gpushare ssh-config for "), done
    assert "Host gpushare-*\n" in done.out and "--write makes it and adds it" in done.err
    assert not (gpushare.home / "config").exists() and gpushare.portal.seen == []


class Keys:
    """The portal's SSH keys API for one account (``FakePortal.overrides``)."""

    def __init__(self, portal: FakePortal) -> None:
        self.held: list[dict[str, Any]] = []
        portal.overrides[("GET", "/api/v1/ssh-keys/")] = lambda _r: httpx.Response(200, json=page(self.held))
        portal.overrides[("POST", "/api/v1/ssh-keys/")] = self.add

    def add(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key_type, blob = body["public_key"].split()
        fingerprint = subprocess.run(
            ["ssh-keygen", "-lf", "-"], input=f"{key_type} {blob}", capture_output=True, text=True, check=True
        ).stdout.split()[1]
        self.held.append({"id": len(self.held) + 1, "fingerprint": fingerprint, "name": body["name"]})
        return httpx.Response(201, json=self.held[-1])


@needs_openssh
def test_write_makes_a_key_adds_it_once_and_includes_the_entry_first(gpushare: Run) -> None:
    keys = Keys(gpushare.portal)
    home = gpushare.home / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host work\n    User me\n")
    gpushare.env["HOME"] = str(home)
    done = gpushare("ssh-config", "--write", "--json")
    assert done.code == 0, done
    document = done.json()
    folder = gpushare.home / "config" / "gpushare"
    assert (
        document["key_made"] and document["key_added"] and document["identity"] == str(folder / "id_ed25519")
    )
    assert (folder / "id_ed25519").stat().st_mode & 0o077 == 0 and len(keys.held) == 1
    assert keys.held[0]["fingerprint"] == document["fingerprint"]
    assert (folder / "ssh_config").read_text() == document["config"]
    user_config = (home / ".ssh" / "config").read_text()
    assert user_config.splitlines()[1] == f'Include "{folder / "ssh_config"}"'  # before every Host
    assert user_config.endswith("Host work\n    User me\n")
    again = gpushare("ssh-config", "--write", "--json")
    assert again.code == 0 and not again.json()["key_made"] and not again.json()["key_added"], again
    assert len(keys.held) == 1 and (home / ".ssh" / "config").read_text() == user_config
    posted = [body for method, _path, body in gpushare.portal.seen if method == "POST"]
    assert posted == [{"public_key": " ".join((folder / "id_ed25519.pub").read_text().split()[:2]),
                       "name": posted[0]["name"]}]  # fmt: skip


@needs_openssh
def test_write_goes_through_a_symlinked_ssh_config(gpushare: Run) -> None:
    Keys(gpushare.portal)
    home, dotfiles = gpushare.home / "home", gpushare.home / "dotfiles"
    (home / ".ssh").mkdir(parents=True)
    dotfiles.mkdir()
    target = dotfiles / "ssh_config"
    target.write_text("Host work\n    User me\n")
    target.chmod(0o640)
    (home / ".ssh" / "config").symlink_to(target)
    gpushare.env["HOME"] = str(home)
    done = gpushare("ssh-config", "--write")
    assert done.code == 0, done
    link = home / ".ssh" / "config"
    assert link.is_symlink() and link.resolve() == target  # the dotfiles setup stays attached
    included = f'Include "{gpushare.home / "config" / "gpushare" / "ssh_config"}"'
    assert target.read_text().splitlines()[1] == included and target.read_text().endswith(
        "Host work\n    User me\n"
    )
    assert target.stat().st_mode & 0o777 == 0o640 and list(dotfiles.iterdir()) == [target]


def test_write_with_a_key_that_is_not_there_refuses(gpushare: Run, tmp_path: Path) -> None:
    Keys(gpushare.portal)
    gpushare.env["HOME"] = str(tmp_path / "home")
    done = gpushare("ssh-config", "--write", "--identity", str(tmp_path / "nope"))
    assert done.code == 2 and "No key at" in done.err


# --- ssh-proxy: a host key per attempt ----------------------------------------------------------

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA0EakXojEzSDFAISLn4t0CKUiHj4Xous65ZINhXhetj"


def test_the_proxy_forgets_a_sandboxs_host_key_when_it_runs_again(
    gpushare: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = gpushare.home / "config" / "gpushare"
    folder.mkdir(parents=True)
    known, store = folder / "known_hosts", folder / "ssh_attempts.json"
    others = (
        f"gpushare-70 {KEY}\ngpushare-17,gpushare-71 {KEY}\n@revoked gpushare-7 {KEY}\nexample.org {KEY}\n"
    )
    relayed: list[str] = []

    async def relay(_credentials: Any, sandbox_id: int) -> None:  # what ssh would then check
        relayed.append(f"{sandbox_id}: {known.read_text()}")

    monkeypatch.setattr(ssh, "_proxy", relay)
    known.write_text(f"gpushare-7 {KEY}\n{others}")
    first = gpushare("ssh-proxy", "gpushare-7")  # no attempt seen yet: the key's attempt is unknown
    assert first.code == 0 and relayed == [f"7: {others}"], first
    assert first.err == "gpushare: sandbox 7 (attempt 1): its SSH host key is trusted anew\n"
    assert json.loads(store.read_text()) == {"portal": BASE, "attempts": {"7": 1}}
    assert store.stat().st_mode & 0o777 == 0o600
    known.write_text(f"{others}gpushare-7 {KEY}\n")  # ssh trusted attempt 1's key
    same = gpushare("ssh-proxy", "7")
    assert same.code == 0 and same.err == "" and known.read_text() == f"{others}gpushare-7 {KEY}\n", same
    gpushare.portal.states = [sandbox(state="running", host="h2", attempt=2)]  # preempted, run again
    again = gpushare("ssh-proxy", "gpushare-7")
    assert (
        again.code == 0
        and again.err == "gpushare: sandbox 7 runs again (attempt 2): its SSH host key is new\n"
    )
    assert relayed[-1] == f"7: {others}" and known.read_text() == others  # other hosts' lines untouched
    assert json.loads(store.read_text())["attempts"] == {"7": 2}
    assert ssh._seen_attempts(store, "http://other.test") == {}  # another portal's sandbox 7 is another


def test_the_proxy_reads_the_attempt_before_relaying_or_says_why_not(
    gpushare: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    relayed: list[int] = []

    async def relay(_credentials: Any, sandbox_id: int) -> None:
        relayed.append(sandbox_id)

    monkeypatch.setattr(ssh, "_proxy", relay)
    known = gpushare.home / "config" / "gpushare" / "known_hosts"
    known.parent.mkdir(parents=True)
    known.write_text(f"gpushare-7 {KEY}\n")
    refused = {"detail": "This token lacks the read:usage scope."}
    gpushare.portal.overrides[("GET", "/api/v1/sandboxes/7/")] = lambda _r: httpx.Response(403, json=refused)
    blind = gpushare("ssh-proxy", "gpushare-7")  # a token that may connect but not read: as before
    assert blind.code == 0 and relayed == [7] and known.read_text() == f"gpushare-7 {KEY}\n", blind
    missing = gpushare("ssh-proxy", "gpushare-8")  # the fake portal has no sandbox 8: a 404
    assert missing.code == 5 and relayed == [7], missing


@needs_openssh
def test_a_hashed_entry_is_forgotten_too(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(f"gpushare-7 {KEY}\ngpushare-8 {KEY}\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], capture_output=True, check=True)
    assert "gpushare-" not in known.read_text()  # HashKnownHosts yes, as an older entry had
    assert forget_host_key(known, "gpushare-7") and not forget_host_key(known, "gpushare-7")

    def held(host: str) -> bool:
        return (
            subprocess.run(["ssh-keygen", "-F", host, "-f", str(known)], capture_output=True).returncode == 0
        )

    assert not held("gpushare-7") and held("gpushare-8")


# --- ssh-proxy, against a stand-in of the portal's socket --------------------------------------


@contextmanager
def ssh_socket(refuse: tuple[int, str] | None = None) -> Iterator[tuple[str, list[Any]]]:
    """A WebSocket server in the portal's place: each binary frame answered reversed, or every
    socket refused with ``refuse``; yields its URL and the requests' Authorization headers."""
    seen: list[Any] = []

    def handle(ws: ServerConnection) -> None:
        seen.append((ws.request.path, ws.request.headers.get("Authorization")) if ws.request else None)
        if refuse is not None:
            ws.send(json.dumps({"type": "closed", "reason": refuse[1]}))
            ws.close(refuse[0])
            return
        ws.send(json.dumps({"type": "opened"}))
        for message in ws:
            if isinstance(message, bytes):
                ws.send(message[::-1])

    def api(connection: ServerConnection, request: Request) -> Response | None:
        """The portal's API in the same place: the sandbox the proxy reads its attempt from."""
        if request.path == "/api/v1/sandboxes/7/":
            return connection.respond(HTTPStatus.OK, json.dumps(sandbox(state="running", host="h1")))
        return None

    server: Server = serve(handle, "127.0.0.1", 0, process_request=api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.socket.getsockname()[1]}", seen
    finally:
        server.shutdown()
        thread.join(timeout=5)


def proxy(url: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GPUSHARE_URL": url, "GPUSHARE_TOKEN": TOKEN, "XDG_CONFIG_HOME": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-m", "gpushare_client", "ssh-proxy", "gpushare-7"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO / "client",
    )  # fmt: skip


def test_the_proxy_relays_bytes_both_ways_and_ends_with_its_input(tmp_path: Path) -> None:
    with ssh_socket() as (url, seen):
        running = proxy(url, tmp_path)
        assert running.stdin is not None and running.stdout is not None and running.stderr is not None
        running.stdin.write(b"SSH-2.0-client\r\n\x00\xff")
        running.stdin.flush()
        answer = running.stdout.read(18)
        running.stdin.close()  # ssh is done: the proxy closes the socket and ends
        assert running.wait(timeout=30) == 0, running.stderr.read()
    assert answer == b"\xff\x00\n\rtneilc-0.2-HSS" and running.stderr.read() == b""
    assert seen == [("/ws/sandboxes/7/ssh/", f"Bearer {TOKEN}")]


def test_the_proxy_says_why_the_portal_refused(tmp_path: Path) -> None:
    reason = "You have no SSH key on your account: add one"
    with ssh_socket(refuse=(4409, reason)) as (url, _seen):
        running = proxy(url, tmp_path)
        # stdin held open, as ssh holds it: closed at once, the proxy would end the socket itself
        # (1000) before the refusal reached it.
        assert running.wait(timeout=30) == 3 and running.stdout and running.stderr and running.stdin
        out, err = running.stdout.read(), running.stderr.read()
        running.stdin.close()
    assert out == b"" and err.decode() == f"gpushare: SSH to sandbox 7 refused: {reason}\n"
