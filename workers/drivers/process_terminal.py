"""The web terminal into a process sandbox: a pty whose other end is a shell started by
workers/drivers/enter_sandbox.py inside the sandbox, with the batch's confinement."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import termios
from typing import Any

from workers.drivers.base import DriverError


class ProcessTerminal:
    """A shell inside the sandbox's namespaces on a pty.

    ``read`` returns ``b""`` when nothing arrived within the timeout and raises
    ``EOFError`` once the shell has gone.
    """

    @classmethod
    def spawn(cls, argv: list[str], what: str, **popen: Any) -> ProcessTerminal:
        """``argv`` started on a new pty; DriverError naming ``what`` when it cannot start."""
        master, slave = os.openpty()
        try:
            proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, **popen)  # noqa: S603
        except OSError as exc:
            os.close(master)
            raise DriverError(f"cannot open a terminal in {what}: {exc}") from exc
        finally:
            os.close(slave)
        return cls(master, proc)

    def __init__(self, master_fd: int, proc: subprocess.Popen[bytes]) -> None:
        self._fd = master_fd
        self._proc = proc
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed:
            raise EOFError("terminal is closed")
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except OSError as exc:
                raise EOFError(f"terminal lost: {exc}") from exc

    def read(self, timeout_s: float = 0.1) -> bytes:
        if self._closed:
            raise EOFError("terminal is closed")
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        if not ready:
            return b""
        try:
            data = os.read(self._fd, 65536)
        except OSError as exc:  # EIO: every slave end closed, the shell has exited
            raise EOFError("shell exited") from exc
        if not data:
            raise EOFError("shell exited")
        return data

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self._fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self._fd)  # hangs up the pty: the shell gets SIGHUP
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
