"""A sandbox's web app (JupyterLab, code-server...) on a unix socket the host agent can reach.

Sandboxes have no network, so an app inside one listens on a unix socket instead of a port:
``GPUSHARE_APP_SOCKET`` (in ``APP_DIR``, a directory the driver binds from the host, the
sandbox's own and mode 0700). The agent connects to it on the host side and relays the
bytes to the portal through Redis (``wire/relay.py``, as a
terminal's pty), where ``portal/sandboxes/app_proxy.py`` speaks HTTP to it for the owner's
browser. Nobody else on the host can reach the socket: only root and the sandbox's uid may
enter its directory.

The directory is the tenant's: whatever is named ``app.sock`` there may be a symlink to any
socket on the host (Docker's, another sandbox's through ``/proc/<pid>/root``), a hard link,
a FIFO or a socket of another uid. The agent, root in the host's mount namespace, connects
only to a socket that is the directory's own (``connect``: workers/drivers/tenant_paths.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import stat
from pathlib import Path

from wire.relay import NOT_LISTENING
from workers.drivers import tenant_paths
from workers.drivers.base import DriverError
from workers.drivers.storage import check_reachable

APP_DIR = "/run/gpushare"  # in the sandbox
APP_SOCKET = f"{APP_DIR}/app.sock"
READ_SIZE = 256 * 1024  # a relayed piece: fewer messages in a page's burst
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def host_dir(root: Path, allocation_key: str) -> Path:
    if not _SAFE_ID.fullmatch(allocation_key):
        raise DriverError(f"allocation id {allocation_key!r} is not safe as a directory name")
    return root / allocation_key


def make_dir(root: Path, allocation_key: str, uid: int, *, bound_by_sandbox: bool = False) -> Path:
    """The sandbox's app directory on the host, empty, the sandbox's own (``uid``).
    ``bound_by_sandbox``: as ``storage.resolve``'s (bubblewrap binds it as the sandbox's uid)."""
    path = host_dir(root, allocation_key)
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    if os.geteuid() == 0 and bound_by_sandbox:
        check_reachable(str(root.resolve()), "the app sockets' directory")
        os.chmod(root, 0o711)  # noqa: S103 - search only: no listing, each sandbox's own folder is 0700
    remove_dir(root, allocation_key)  # a stale one of a previous launch, with what it held
    path.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(path, uid, uid)  # just made, in a folder only root writes: nothing to swap
    return path


def remove_dir(root: Path, allocation_key: str) -> None:
    """The app directory and what its tenant left there, removed without following a link
    (shutil.rmtree opens each subfolder following symlinks before it checks what it got)."""
    tenant_paths.remove_tree(root, host_dir(root, allocation_key).name)


def connect(root: Path, allocation_key: str, timeout_s: float = 5.0) -> SocketStream:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        app = _open_socket(host_dir(root, allocation_key))
        try:
            # Through the descriptor of the very socket checked, never by its name again: a
            # socket's path may hold 107 bytes at most besides (a deep var dir would not fit).
            sock.connect(f"/proc/self/fd/{app}")
        finally:
            os.close(app)
    except OSError as exc:
        sock.close()
        raise DriverError(
            f"sandbox {allocation_key}: {NOT_LISTENING} on {APP_SOCKET} ({exc.strerror or exc})"
        ) from exc
    sock.settimeout(None)
    return SocketStream(sock)


def _open_socket(folder: Path) -> int:
    """An ``O_PATH`` descriptor of ``app.sock`` in ``folder``, when it is a socket the
    sandbox's uid made there: not a link (symlink or hard link), not a FIFO, nor anyone
    else's socket. The folder's owner is the sandbox's uid (``make_dir``), which the tenant
    cannot change; connecting to ``/proc/self/fd/N`` then reaches that inode's listener."""
    folder_fd = tenant_paths.open_folder(folder)
    try:
        owner = os.fstat(folder_fd).st_uid
        app = tenant_paths.open_beneath(folder_fd, "app.sock", os.O_PATH | os.O_NOFOLLOW)
    finally:
        os.close(folder_fd)
    try:
        tenant_paths.require(app, APP_SOCKET, stat.S_IFSOCK, owner=owner, single_link=True)
    except OSError:
        os.close(app)
        raise
    return app


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
