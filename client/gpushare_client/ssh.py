"""SSH into sandboxes through the portal: ``gpushare ssh-config`` and ``gpushare ssh-proxy``.

``ssh-proxy ID`` is OpenSSH's ``ProxyCommand``: its stdin and stdout are the SSH
connection's bytes, carried as binary frames over the portal's WebSocket
``/ws/sandboxes/<id>/ssh/`` (the API token in the Authorization header, as the shell's), at
whose other end the sandbox's host runs ``sshd -i`` inside the sandbox as its user (no port
is opened anywhere). It ends when either side does: ssh closes its stdin, or the portal
closes the socket (its reason on stderr, which ssh shows).

A sandbox's sshd makes its host key on the sandbox's tmpfs, so each attempt of the sandbox (a
launch: it is queued again when preempted, when its host is lost, when a fleet plan moves it)
has a new one, and ``StrictHostKeyChecking accept-new`` would then refuse it as a changed key.
So before relaying a byte (ssh checks the host key only after), ``ssh-proxy`` reads the
sandbox's ``attempt`` from the API and compares it with the one it last saw for that sandbox
(``<config dir>/ssh_attempts.json``); when it differs, it removes ``gpushare-<id>``'s lines from
``<config dir>/known_hosts`` and says so on stderr: within one attempt the key is trusted on
first use and held to, as before.

``ssh-config`` gives OpenSSH a ``Host gpushare-*`` entry whose ProxyCommand is this client,
so that ``ssh gpushare-42``, ``scp``, ``rsync -e ssh``, ``ssh -L`` and VS Code's Remote-SSH
("Connect to Host…", ``gpushare-42``) all work. With ``--write`` it writes that entry to
``<config dir>/ssh_config``, includes it from ``~/.ssh/config`` (the ``Include`` line first,
as ssh_config requires for it to apply everywhere), and makes a key pair of its own
(``<config dir>/id_ed25519``, with ssh-keygen) unless ``--identity`` names one, adding its
public half to the account through the API if it is not there yet.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from gpushare_client import config
from gpushare_client.commands import Context
from gpushare_client.exits import ClientError, Exit
from gpushare_client.routes import ADD_SSH_KEY, SANDBOX, SSH_KEYS, SSH_SOCKET
from gpushare_client.shell import CLOSE_EXIT, _StdinReader, open_socket, socket_url

HOST_PREFIX = "gpushare-"
CONFIG_FILE = "ssh_config"
KEY_FILE = "id_ed25519"
KNOWN_HOSTS = "known_hosts"
ATTEMPTS_FILE = "ssh_attempts.json"
MAX_REMEMBERED = 1000  # sandboxes whose attempt is kept; one forgotten is only trusted anew


# --- ssh-proxy ----------------------------------------------------------------------------------


def sandbox_of(target: str) -> int:
    """The sandbox id in ``gpushare-42`` (what ssh passes as %n) or ``42``."""
    raw = target.removeprefix(HOST_PREFIX)
    if not raw.isascii() or not raw.isdigit() or not 0 < int(raw) < 2**63:
        raise ClientError(Exit.USAGE, f"Not a sandbox: {target!r} (give gpushare-ID or ID).")
    return int(raw)


async def _pump_in(ws: ClientConnection, reader: _StdinReader) -> None:
    """ssh's bytes up; at their end (ssh is done) the socket is closed."""
    while chunk := await reader.queue.get():
        try:
            await ws.send(chunk)
        except ConnectionClosed:
            return
    await ws.close()


async def relay(ws: ClientConnection, stdin: Any, stdout_fd: int) -> str:
    """Relay until either side ends; the portal's reason when it closed the connection."""
    reason = ""
    up = asyncio.ensure_future(_pump_in(ws, _StdinReader(stdin, asyncio.get_running_loop())))
    try:
        async for message in ws:
            if isinstance(message, bytes):
                view = memoryview(message)
                while view:
                    view = view[os.write(stdout_fd, view) :]
                continue
            with contextlib.suppress(ValueError):
                event = json.loads(message)
                if isinstance(event, dict) and event.get("type") == "closed":
                    reason = str(event.get("reason", ""))
    except (ConnectionClosed, BrokenPipeError):
        pass  # the close code says how it ended; a broken stdout: ssh has gone
    finally:
        up.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await up
    return reason


async def _proxy(credentials: config.Credentials, sandbox_id: int) -> None:
    url = socket_url(credentials.url, sandbox_id, SSH_SOCKET)
    # No compression: SSH's bytes are encrypted, nothing to gain but CPU.
    ws = await open_socket(url, credentials, "the SSH connection", compression=None)
    async with ws:
        reason = await relay(ws, sys.stdin.buffer, sys.stdout.fileno())
    code, said = ws.close_code, reason or ws.close_reason or ""
    if code in CLOSE_EXIT:
        raise ClientError(CLOSE_EXIT[code], f"SSH to sandbox {sandbox_id} refused: {said or code}")
    if code not in (1000, 1005, None):
        raise ClientError(Exit.UNREACHABLE, f"SSH to sandbox {sandbox_id} broke off ({code}): {said}")


def _names_host(names: str, host: str) -> bool:
    """Whether a known_hosts line's first field (``a,b`` or hashed ``|1|salt|hmac``) is ``host``."""
    for name in names.split(","):
        if name == host:
            return True
        if name.startswith("|1|"):  # HashKnownHosts: HMAC-SHA1 of the name, keyed by the salt
            try:
                _, _, salt, digest = name.split("|")
                key, wanted = base64.b64decode(salt, validate=True), base64.b64decode(digest, validate=True)
            except ValueError:
                continue
            if hmac.compare_digest(hmac.new(key, host.encode(), "sha1").digest(), wanted):
                return True
    return False


def forget_host_key(known_hosts: Path, host: str) -> bool:
    """Remove ``host``'s keys from ``known_hosts`` (as ``ssh-keygen -R`` would, without needing
    it or leaving a ``.old``); True when there were any. Marker lines (``@revoked``,
    ``@cert-authority``) are the user's own decisions: kept."""
    try:
        lines = known_hosts.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return False
    kept = [
        line
        for line in lines
        if not line.strip() or line.lstrip()[0] in "#@" or not _names_host(line.split()[0], host)
    ]
    if len(kept) == len(lines):
        return False
    target = Path(os.path.realpath(known_hosts))  # through a link, as ssh itself writes it
    _write_private(target, "".join(kept), target.stat().st_mode & 0o777)
    return True


def _seen_attempts(store: Path, portal: str) -> dict[str, int]:
    """The attempt last seen of each sandbox of ``portal``: {} for another portal (its sandbox
    42 is another machine) or a file that is missing or not ours."""
    try:
        data = json.loads(store.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    if (
        not isinstance(data, dict)
        or data.get("portal") != portal
        or not isinstance(data.get("attempts"), dict)
    ):
        return {}
    return {k: v for k, v in data["attempts"].items() if isinstance(v, int) and not isinstance(v, bool)}


def forget_stale_host_key(ctx: Context, portal: str, sandbox_id: int) -> bool:
    """When the sandbox runs another attempt than the one last seen here, forget its host key
    (it has a new one); True when a key was forgotten. Concurrent proxies may both forget the
    key of one new attempt: ssh then trusts the same key again, no harm."""
    try:
        sandbox = ctx.api().call(SANDBOX, id=sandbox_id)
    except ClientError as exc:
        if exc.code != Exit.REFUSED:  # 404, a bad token, the portal down: the socket would fail too
            raise
        return False  # a token without read:usage may still connect: trust on first use alone
    attempt = sandbox.get("attempt") if isinstance(sandbox, dict) else None
    if not isinstance(attempt, int) or isinstance(attempt, bool):
        return False  # a portal older than attempts
    folder = config.config_dir(ctx.env)
    store = folder / ATTEMPTS_FILE
    seen = _seen_attempts(store, portal)
    key = str(sandbox_id)
    previous = seen.pop(key, None)
    if previous == attempt:
        return False
    host = f"{HOST_PREFIX}{sandbox_id}"
    try:
        # With no record, a key held here is of an attempt unknown: forgotten too.
        forgot = forget_host_key(folder / KNOWN_HOSTS, host)
        seen[key] = attempt  # last, so that the oldest are the first dropped
        kept = dict(list(seen.items())[-MAX_REMEMBERED:])
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(store, json.dumps({"portal": portal, "attempts": kept}) + "\n")
    except OSError as exc:
        raise ClientError(Exit.ERROR, f"Cannot update {folder}: {exc}.") from exc
    if forgot and previous is not None:
        ctx.say(f"gpushare: sandbox {sandbox_id} runs again (attempt {attempt}): its SSH host key is new")
    elif forgot:
        ctx.say(f"gpushare: sandbox {sandbox_id} (attempt {attempt}): its SSH host key is trusted anew")
    return forgot


def ssh_proxy(args: argparse.Namespace, ctx: Context) -> Any:
    sandbox_id = sandbox_of(args.target)
    credentials = config.load(ctx.env)
    forget_stale_host_key(ctx, credentials.url, sandbox_id)  # before any byte: ssh checks the key after
    asyncio.run(_proxy(credentials, sandbox_id))
    return None


# --- ssh-config ---------------------------------------------------------------------------------


def _quoted(path: Path | str) -> str:
    """A path as one ssh_config argument (double quotes hold spaces)."""
    text = str(path)
    if '"' in text or "\n" in text:
        raise ClientError(Exit.USAGE, f"ssh_config cannot name a path with a quote or newline: {text!r}.")
    return f'"{text}"'


def config_text(portal: str, folder: Path, identity: Path, python: str = sys.executable) -> str:
    """The ``Host gpushare-*`` entry: every sandbox, as ``gpushare-<id>``."""
    proxy = f"{shlex.quote(python)} -m gpushare_client ssh-proxy %n"
    return "\n".join(
        [
            f"# Written by gpushare ssh-config for {portal}; it rewrites this file whole.",
            f"Host {HOST_PREFIX}*",
            f"    ProxyCommand {proxy}",
            "    User sandbox",
            f"    IdentityFile {_quoted(identity)}",
            "    IdentitiesOnly yes",
            # Each attempt of a sandbox makes its host key at its first connection: trusted on
            # first use (the connection to it is the portal's, over TLS), held to it afterwards;
            # ssh-proxy forgets it when the sandbox runs again. Not hashed (Debian's default is),
            # so that ssh-proxy can find gpushare-<id>'s line.
            f"    UserKnownHostsFile {_quoted(folder / KNOWN_HOSTS)}",
            "    StrictHostKeyChecking accept-new",
            "    HashKnownHosts no",
            "    CheckHostIP no",
            # A sandbox is someone's machine: never lend it your agent or your display.
            "    ForwardAgent no",
            "    ForwardX11 no",
            # The relay ends a connection with no input for the host's TERMINAL_IDLE_S.
            "    ServerAliveInterval 60",
            "",
        ]
    )


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """``text`` into ``path`` whole (a temporary file renamed over it), with ``mode``."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def include_in_user_config(ssh_dir: Path, included: Path) -> bool:
    """``Include <included>`` first in ``ssh_dir/config``; False when it was there already."""
    line = f"Include {_quoted(included)}"
    # Through a symlink (a dotfiles repository's file): renaming over the link would detach it.
    user_config = Path(os.path.realpath(ssh_dir / "config"))
    try:
        old = user_config.read_text()
    except FileNotFoundError:
        old = ""
    if line in old.splitlines():
        return False
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = user_config.stat().st_mode & 0o777 if user_config.exists() else 0o600
    note = "# gpushare's sandboxes (gpushare ssh-config --write); first, to apply to every Host\n"
    _write_private(user_config, note + line + "\n\n" + old, mode)
    return True


def _public_key(identity: Path) -> tuple[str, str]:
    """(the .pub line's ``<type> <base64>``, its SHA256 fingerprint)."""
    pub = identity.with_name(identity.name + ".pub")
    try:
        words = pub.read_text().split()
        blob = base64.b64decode(words[1], validate=True)
    except (OSError, IndexError, ValueError) as exc:
        raise ClientError(Exit.ERROR, f"Cannot read the public key {pub}: {exc}.") from exc
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"{words[0]} {words[1]}", f"SHA256:{digest}"


def _make_key(identity: Path) -> None:
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        raise ClientError(Exit.ERROR, "ssh-keygen not found: install OpenSSH's client (openssh-client).")
    comment = f"gpushare@{socket.gethostname()}"
    done = subprocess.run(  # noqa: S603 - a fixed argv, no shell
        [keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(identity)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise ClientError(Exit.ERROR, f"ssh-keygen failed: {done.stderr.strip() or done.returncode}.")


def _add_key(ctx: Context, identity: Path) -> tuple[str, bool]:
    """Add the identity's public key to the account unless it is there; (fingerprint, added)."""
    bare, fingerprint = _public_key(identity)
    api = ctx.api()
    if any(key.get("fingerprint") == fingerprint for key in api.pages(SSH_KEYS)):
        return fingerprint, False
    name = f"{identity.name} on {socket.gethostname()}"[:100]
    api.call(ADD_SSH_KEY, body={"public_key": bare, "name": name})
    return fingerprint, True


def ssh_config(args: argparse.Namespace, ctx: Context) -> Any:
    credentials = config.load(ctx.env)  # signed in first: the entry names this portal
    folder = config.config_dir(ctx.env)
    identity = Path(args.identity).expanduser().absolute() if args.identity else folder / KEY_FILE
    text = config_text(credentials.url, folder, identity)
    if not args.write:
        ctx.show(text.rstrip("\n"))
        if not identity.exists():
            ctx.say(f"{identity} does not exist yet: --write makes it and adds it to your account.")
        return {"config": text, "identity": str(identity), "written": False}
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = False
        if not identity.exists():
            if args.identity:
                raise ClientError(Exit.USAGE, f"No key at {identity}.")
            _make_key(identity)
            made = True
        fingerprint, added = _add_key(ctx, identity)
        written = folder / CONFIG_FILE
        _write_private(written, text)
        home = Path(ctx.env.get("HOME") or Path.home())
        included = include_in_user_config(home / ".ssh", written)
    except OSError as exc:
        raise ClientError(Exit.ERROR, f"Cannot write the SSH configuration: {exc}.") from exc
    ctx.say(f"{'Made' if made else 'Using'} the key {identity} ({fingerprint}); "
            f"{'added it to' if added else 'it is already on'} your account.")  # fmt: skip
    ctx.say(f"Wrote {written}{', included from ' + str(home / '.ssh' / 'config') if included else ''}.")
    ctx.say(f"Try: ssh {HOST_PREFIX}ID (ID: a running sandbox's, from gpushare list).")
    return {
        "config": text, "config_file": str(written), "identity": str(identity), "fingerprint": fingerprint,
        "key_made": made, "key_added": added, "included_from": str(home / ".ssh" / "config"), "written": True,
    }  # fmt: skip
