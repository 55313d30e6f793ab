"""A sandbox's web app (JupyterLab, code-server...) on a unix socket the host agent can reach.

Sandboxes have no network, so an app inside one listens on a unix socket instead of a port:
``GPUSHARE_APP_SOCKET`` (in ``APP_DIR``, a directory the driver binds from the host, the
sandbox's own and mode 0700). The agent connects to it on the host side and relays the
bytes to the portal through Redis (``workers/terminal_relay.py``, as a
terminal's pty), where ``portal/sandboxes/app_proxy.py`` speaks HTTP to it for the owner's
browser. Nobody else on the host can reach the socket: only root and the sandbox's uid may
enter its directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import socket
from pathlib import Path

from workers.drivers.base import DriverError
from workers.drivers.storage import check_reachable

APP_DIR = "/run/gpushare"  # in the sandbox
APP_SOCKET = f"{APP_DIR}/app.sock"
READ_SIZE = 256 * 1024  # a relayed piece: fewer messages in a page's burst
NOT_LISTENING = "its app is not listening"  # the portal tells "starting" from other refusals by it
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def host_dir(root: Path, allocation_id: str) -> Path:
    if not _SAFE_ID.fullmatch(allocation_id):
        raise DriverError(f"allocation id {allocation_id!r} is not safe as a directory name")
    return root / allocation_id


def make_dir(root: Path, allocation_id: str, uid: int, *, bound_by_sandbox: bool = False) -> Path:
    """The sandbox's app directory on the host, empty, the sandbox's own (``uid``).
    ``bound_by_sandbox``: as ``storage.resolve``'s (bubblewrap binds it as the sandbox's uid)."""
    path = host_dir(root, allocation_id)
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    if os.geteuid() == 0 and bound_by_sandbox:
        check_reachable(str(root.resolve()), "the app sockets' directory")
        os.chmod(root, 0o711)  # noqa: S103 - search only: no listing, each sandbox's own folder is 0700
    shutil.rmtree(path, ignore_errors=True)  # a stale socket of a previous launch
    path.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(path, uid, uid)
    return path


def remove_dir(root: Path, allocation_id: str) -> None:
    shutil.rmtree(host_dir(root, allocation_id), ignore_errors=True)


def connect(root: Path, allocation_id: str, timeout_s: float = 5.0) -> SocketStream:
    folder = host_dir(root, allocation_id)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        # Through the directory's descriptor: a socket's path may hold 107 bytes at most, and
        # a deep var dir with a 32-character allocation id can take more.
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sock.connect(f"/proc/self/fd/{fd}/app.sock")
        finally:
            os.close(fd)
    except OSError as exc:
        sock.close()
        raise DriverError(
            f"sandbox {allocation_id}: {NOT_LISTENING} on {APP_SOCKET} ({exc.strerror or exc})"
        ) from exc
    sock.settimeout(None)
    return SocketStream(sock)


class SocketStream:
    """A connection to a sandbox's app, with the web terminal's interface (``Terminal``), so
    that one relay serves both."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed:
            raise EOFError("the app's connection is closed")
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise EOFError(f"the app closed the connection ({exc.strerror or exc})") from exc

    def read(self, timeout_s: float = 0.1) -> bytes:
        if self._closed:
            raise EOFError("the app's connection is closed")
        ready, _, _ = select.select([self._sock], [], [], timeout_s)
        if not ready:
            return b""
        try:
            data = self._sock.recv(READ_SIZE)
        except OSError as exc:
            raise EOFError(f"the app's connection failed ({exc.strerror or exc})") from exc
        if not data:
            raise EOFError("the app closed the connection")
        return data

    def resize(self, rows: int, cols: int) -> None:
        """A byte stream has no window."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.close()
