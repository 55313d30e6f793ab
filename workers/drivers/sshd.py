"""OpenSSH's server inside a sandbox, one per connection, for ``gpushare ssh-config``.

The portal relays an SSH connection's bytes (``wire/relay.py``, as it relays a terminal's);
at this end they are the stdin and stdout of ``sshd -i`` (inetd mode) started inside the
sandbox by the driver's own way in (the process driver: ``enter_sandbox.py``; Docker: an
exec), as the sandbox's user, with no pty. So no port is opened anywhere: not on the host,
not in the sandbox; ``ssh -L`` connects from inside the sandbox's network namespace.

sshd not run as root can log in only the user it runs as, and needs no privilege
separation user; it still needs a name for that user in the passwd database. The process
driver's /etc/passwd names uid 1000 ``sandbox``; a Docker sandbox runs as a uid of its own
that the image's passwd file does not name, so ``WRAPPER`` gives it one through nss_wrapper
(the image has it: scripts/build-sandbox-image.sh), the way OpenShift runs arbitrary uids.

Everything the wrapper writes is in ``STATE_DIR`` on the sandbox's own tmpfs, as the
sandbox's user: the host key (made at the first connection, kept for the sandbox's life),
the nss_wrapper files, and per connection a folder with the keys the portal sent and the
server's configuration, removed when the connection ends. The agent writes nothing into the
sandbox. The keys are checked again here (``wire.ssh.bare_key``), so that nothing else can
become a line of ``authorized_keys``; only publickey authentication is configured.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import struct
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wire.ssh import MAX_KEYS, bare_key
from workers.drivers.base import DriverError

SSHD = "/usr/sbin/sshd"
USER = "sandbox"  # the name every sandbox's user has for sshd (``gpushare ssh-config``: User)
STATE_DIR = "/tmp/.gpushare-ssh"  # noqa: S108 - inside the sandbox: its own tmpfs
HOST_KEY = f"{STATE_DIR}/host_ed25519_key"
STDERR_TAIL = 2048  # what is kept of sshd's complaints, for the reason a connection ended
# The sandbox's variables sshd sets itself for a session, or that belong to this connection.
_OWN_VARIABLES = frozenset({"HOME", "USER", "LOGNAME", "SHELL", "MAIL", "TERM", "PWD", "SHLVL", "_"})

# Run by /bin/sh inside the sandbox as its user; its input comes in the environment (below).
WRAPPER = r"""
set -eu
umask 077
say() { printf 'gpushare ssh: %s\n' "$*" >&2; }
sshd=/usr/sbin/sshd
dir=/tmp/.gpushare-ssh
if [ ! -x "$sshd" ]; then
    say "no OpenSSH server in this sandbox ($sshd): its image needs openssh-server"
    exit 127
fi
[ -d "$dir" ] || mkdir -m 700 "$dir"
if [ -L "$dir" ] || [ ! -O "$dir" ]; then
    say "$dir is not a folder of the sandbox's user"
    exit 1
fi
named=""
if [ "$(id -un 2>/dev/null || true)" != sandbox ]; then
    lib=$(ls /usr/lib/*/libnss_wrapper.so /usr/lib/libnss_wrapper.so 2>/dev/null | head -n 1 || true)
    if [ -z "$lib" ]; then
        say "the sandbox's uid $(id -u) has no name, and its image has no nss_wrapper to give it one"
        exit 127
    fi
    shell=/bin/sh
    [ ! -x /bin/bash ] || shell=/bin/bash
    printf 'sandbox:x:%s:%s:sandbox:%s:%s\n' "$(id -u)" "$(id -g)" "${HOME:-/}" "$shell" >"$dir/passwd"
    printf 'sandbox:x:%s:\n' "$(id -g)" >"$dir/group"
    export LD_PRELOAD="$lib" NSS_WRAPPER_PASSWD="$dir/passwd" NSS_WRAPPER_GROUP="$dir/group"
    named=yes
fi
if [ ! -s "$dir/host_ed25519_key" ]; then
    ssh-keygen -q -t ed25519 -N '' -C 'gpushare sandbox' -f "$dir/new-key.$$" >/dev/null
    mv -f "$dir/new-key.$$" "$dir/host_ed25519_key"
    rm -f "$dir/new-key.$$.pub"
fi
session="$dir/$GPUSHARE_SSH_SESSION"
mkdir -m 700 "$session"
printf '%s\n' "$GPUSHARE_SSH_KEYS" >"$session/authorized_keys"
printf '%s\n' "$GPUSHARE_SSHD_CONFIG" >"$session/sshd_config"
setenv="$GPUSHARE_SSH_SETENV"
if [ -n "$named" ]; then  # the name in its sessions too (whoami, VS Code)
    setenv="$setenv LD_PRELOAD=$LD_PRELOAD NSS_WRAPPER_PASSWD=$NSS_WRAPPER_PASSWD"
    setenv="$setenv NSS_WRAPPER_GROUP=$NSS_WRAPPER_GROUP"
fi
[ -z "$setenv" ] || printf 'SetEnv %s\n' "$setenv" >>"$session/sshd_config"
unset GPUSHARE_SSH_KEYS GPUSHARE_SSHD_CONFIG GPUSHARE_SSH_SETENV
status=0
"$sshd" -i -e -f "$session/sshd_config" || status=$?
rm -rf "$session"
exit "$status"
"""


def _quoted(entry: str) -> str:
    """One ``SetEnv`` argument, double-quoted the way sshd_config's parser unquotes it."""
    return '"' + entry.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _printable(value: str) -> bool:
    return value.isprintable() and "\n" not in value


def sshd_config(session: str) -> str:
    """The configuration of one connection's server: publickey only, for the sandbox's user,
    the keys of this connection alone (none of ``~/.ssh``), local forwarding only (``ssh
    -L``; no listening socket: ``-R`` and ``PermitListen`` stay shut), no agent or X11
    forwarding, SFTP inside sshd (scp, VS Code)."""
    lines = [
        "# gpushare: one SSH connection's server, run as the sandbox's user (workers/drivers/sshd.py)",
        f"HostKey {HOST_KEY}",
        f"AuthorizedKeysFile {STATE_DIR}/{session}/authorized_keys",
        "AuthenticationMethods publickey",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "HostbasedAuthentication no",
        "PermitRootLogin no",
        f"AllowUsers {USER}",
        "UsePAM no",
        # Its files are on the sandbox's /tmp (mode 1777), which StrictModes refuses; all of
        # them are the sandbox user's own, which is what it would check.
        "StrictModes no",
        "PidFile none",
        "PrintMotd no",
        "PrintLastLog no",
        "UseDNS no",
        "PermitUserEnvironment no",
        "PermitUserRC no",
        "AllowAgentForwarding no",
        "AllowTcpForwarding local",
        "AllowStreamLocalForwarding no",
        "PermitListen none",
        "GatewayPorts no",
        "X11Forwarding no",
        "PermitTunnel no",
        "LogLevel ERROR",
        "Subsystem sftp internal-sftp",
    ]
    return "\n".join(lines)


def session_environment(environment: Mapping[str, str]) -> str:
    """The sandbox's variables as the arguments of sshd's ``SetEnv`` (sshd starts a session
    from a clean environment: its GPUs' variables would be lost). One line: sshd keeps only
    the first ``SetEnv`` (the wrapper adds nss_wrapper's to it). A value sshd_config cannot
    hold (a newline) is left out."""
    return " ".join(
        _quoted(f"{name}={value}")
        for name, value in sorted(environment.items())
        if name not in _OWN_VARIABLES and name.isidentifier() and _printable(value)
    )


@dataclass(frozen=True)
class Server:
    """What a driver runs inside the sandbox (``argv``, with ``env`` added to what the
    sandbox's processes have) for one connection."""

    argv: list[str]
    env: dict[str, str]

    @classmethod
    def for_keys(cls, authorized_keys: Sequence[str], environment: Mapping[str, str]) -> Server:
        """The server for a connection that may log in with ``authorized_keys``; the
        sandbox's ``environment`` goes into its sessions. DriverError when a key is not one
        bare key, or there is none."""
        if not authorized_keys:
            raise DriverError("no SSH key to log in with: add one to your account")
        if len(authorized_keys) > MAX_KEYS:
            raise DriverError(f"more than {MAX_KEYS} SSH keys for one connection")
        if any(not isinstance(key, str) or bare_key(key) is None for key in authorized_keys):
            raise DriverError("an SSH key sent for the connection is not a public key")
        session = secrets.token_hex(8)
        return cls(
            argv=["/bin/sh", "-c", WRAPPER, "gpushare-ssh"],
            env={
                "GPUSHARE_SSH_SESSION": session,
                "GPUSHARE_SSH_KEYS": "\n".join(authorized_keys),
                "GPUSHARE_SSHD_CONFIG": sshd_config(session),
                "GPUSHARE_SSH_SETENV": session_environment(environment),
            },
        )


class _Complaints:
    """The last bytes sshd (or the wrapper) wrote on stderr: why a connection failed."""

    def __init__(self) -> None:
        self.tail = b""

    def add(self, data: bytes) -> None:
        self.tail = (self.tail + data)[-STDERR_TAIL:]

    def reason(self, status: int | None) -> str:
        said = self.tail.decode("utf-8", "replace").strip().replace("\n", "; ")
        if status in (0, None) and not said:
            return "the SSH connection ended"
        return f"the sandbox's sshd ended (status {status}){': ' + said if said else ''}"


class PipedServer:
    """sshd's stdin and stdout as a byte stream with the terminal's interface (``relay``
    calls ``read`` and ``write`` from threads; ``resize`` means nothing here). For drivers
    that start it as a local process (the process driver's ``enter_sandbox.py``)."""

    @classmethod
    def spawn(cls, argv: list[str], what: str, **popen: Any) -> PipedServer:
        try:
            proc = subprocess.Popen(  # noqa: S603 - the argv the driver built, no shell input
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen
            )
        except OSError as exc:
            raise DriverError(f"cannot start an SSH server in {what}: {exc}") from exc
        return cls(proc)

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # noqa: S101
        self._proc = proc
        self._in, self._out, self._err = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
        self._complaints = _Complaints()
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed:
            raise EOFError("the SSH connection is closed")
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._in, view) :]
            except OSError as exc:  # EPIPE: sshd has gone
                raise EOFError(self._ended()) from exc

    def read(self, timeout_s: float = 0.1) -> bytes:
        if self._closed:
            raise EOFError("the SSH connection is closed")
        ready, _, _ = select.select([self._out, self._err], [], [], timeout_s)
        if self._err in ready and (complaint := os.read(self._err, 4096)):
            self._complaints.add(complaint)
        if self._out not in ready:
            return b""
        data = os.read(self._out, 65536)
        if not data:
            raise EOFError(self._ended())
        return data

    def _ended(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=2)
        with contextlib.suppress(OSError):
            os.set_blocking(self._err, False)
            self._complaints.add(os.read(self._err, STDERR_TAIL))
        return self._complaints.reason(self._proc.returncode)

    def resize(self, rows: int, cols: int) -> None:
        """No pty here: the SSH client asks sshd for one inside the connection."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()  # sshd reads the end of its input and goes
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class MultiplexedServer:
    """sshd's stdin and stdout over a container engine's attach socket without a tty, where
    stdout and stderr come framed (Docker's stream format: a byte for the stream, three zero
    bytes, a big-endian length, then that many bytes)."""

    def __init__(self, sock: Any, exit_status: Callable[[], int | None]) -> None:
        self._holder = sock  # keeps the HTTP response (and so the connection) alive
        self._sock: socket.socket = getattr(sock, "_sock", sock)
        self._exit_status = exit_status
        self._buffer = b""
        self._complaints = _Complaints()
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed:
            raise EOFError("the SSH connection is closed")
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise EOFError(self._ended()) from exc

    def read(self, timeout_s: float = 0.1) -> bytes:
        if self._closed:
            raise EOFError("the SSH connection is closed")
        out = self._frames()
        if out:
            return out
        ready, _, _ = select.select([self._sock], [], [], timeout_s)
        if not ready:
            return b""
        try:
            data = self._sock.recv(65536)
        except OSError as exc:
            raise EOFError(self._ended()) from exc
        if not data:
            raise EOFError(self._ended())
        self._buffer += data
        return self._frames()

    def _frames(self) -> bytes:
        """stdout's bytes of every whole frame in the buffer (stderr's kept aside)."""
        out = bytearray()
        while len(self._buffer) >= 8:
            kind, length = struct.unpack(">B3xI", self._buffer[:8])
            if len(self._buffer) < 8 + length:
                break
            payload, self._buffer = self._buffer[8 : 8 + length], self._buffer[8 + length :]
            if kind == 2:
                self._complaints.add(payload)
            else:
                out += payload
        return bytes(out)

    def _ended(self) -> str:
        try:
            status = self._exit_status()
        except Exception:  # the engine's answer only words the reason: any failure, no status
            status = None
        return self._complaints.reason(status)

    def resize(self, rows: int, cols: int) -> None:
        """No pty here: the SSH client asks sshd for one inside the connection."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError, AttributeError):
            self._holder.close()
