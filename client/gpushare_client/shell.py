"""``gpushare shell``: a sandbox's terminal over the portal's WebSocket
(``/ws/sandboxes/<id>/terminal/``, the API token in the Authorization header).

The protocol is the web terminal's (portal/tunnels/consumers.py): JSON ``input`` and
``resize`` messages up; the pty's bytes as binary frames down, and JSON ``opened`` /
``closed`` (with the reason). A refusal is a ``closed`` message and a 44xx close code.

Three ways to use it:
- **interactive** (stdin is a terminal): the local terminal in raw mode, every key sent as
  typed, its size sent at start and on each change (SIGWINCH);
- **piped** (``printf 'echo hi\\nexit\\n' | gpushare shell ID``): the input is a script for the
  sandbox's shell;
- **a command** (``gpushare shell ID -c 'echo hi'``).
The last two print only what the commands print: the client first turns the pty's echo and
prompts off (``stty -echo -onlcr``, empty ``PS1``) and drops what came before a marker the
shell prints once that is done; at the end it asks the shell for ``$?`` behind another
marker, which becomes the client's exit status.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI, WebSocketException

from gpushare_client.config import Credentials
from gpushare_client.exits import ClientError, Exit
from gpushare_client.routes import TERMINAL_SOCKET

# The terminal's refusals (portal/tunnels/consumers.py, portal/accounts/socket_auth.py).
CLOSE_EXIT = {
    4401: Exit.AUTH,
    4403: Exit.REFUSED,
    4404: Exit.NOT_FOUND,
    4409: Exit.REFUSED,
    4429: Exit.RATE_LIMITED,
}
READY_WAIT_S = 30.0  # for the sandbox's shell to run the set-up line
# \036 (ASCII record separator) never comes out of an echoed line: the shell's printf makes
# it from the four characters "\036", which is what the pty echoes.
READY = b"\x1egpushare:ready\x1e"
STATUS_HEAD = b"\x1egpushare:exit="
_STATUS = re.compile(rb"\x1egpushare:exit=(\d{1,3})\x1e")
_PRINT_STATUS = "printf '\\036gpushare:exit=%d\\036\\n' \"$?\""
SET_UP = "stty -echo -onlcr 2>/dev/null; PS1=''; PS2=''; printf '\\036gpushare:ready\\036\\n'\n"


def socket_url(portal: str, sandbox_id: int, route: str = TERMINAL_SOCKET) -> str:
    parts = urlsplit(portal)
    scheme = "wss" if parts.scheme == "https" else "ws"
    path = parts.path.rstrip("/") + route.format(id=sandbox_id)
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def command_line(command: str) -> str:
    """``command`` run by the sandbox's sh with no input, then its status, then the end."""
    return f"sh -c {shlex.quote(command)} </dev/null; {_PRINT_STATUS}; exit\n"


def end_of_script(last_byte: bytes) -> str:
    """What follows a piped script: a newline if it lacked its last one, its status, the end."""
    return ("" if last_byte in (b"", b"\n") else "\n") + f"{_PRINT_STATUS}; exit\n"


class OutputFilter:
    """The pty's output as the user should see it in piped and command modes: nothing before
    the ready marker (the echoed set-up line, a prompt), no status marker (recorded in
    ``status``), nor the newline each marker ends with. Markers may arrive split across
    pieces: a possible beginning of one is held until the next piece says."""

    def __init__(self, wait_for_ready: bool) -> None:
        self.ready = not wait_for_ready
        self.status: int | None = None
        self._held = b""
        self._drop_newline = False

    def feed(self, data: bytes) -> bytes:
        buffer, self._held = self._held + data, b""
        if not self.ready:
            at = buffer.find(READY)
            if at < 0:
                self._held = buffer[-(len(READY) - 1) :]
                return b""
            self.ready, self._drop_newline = True, True
            buffer = buffer[at + len(READY) :]
        out = bytearray()
        while buffer:
            buffer = self._without_newline(buffer)
            at = buffer.find(b"\x1e")
            if at < 0:
                out += buffer
                break
            out += buffer[:at]
            rest = buffer[at:]
            if match := _STATUS.match(rest):
                self.status, self._drop_newline = int(match.group(1)), True
                buffer = rest[match.end() :]
            elif self._may_become_status(rest):
                self._held = rest
                break
            else:
                out += rest[:1]
                buffer = rest[1:]
        return bytes(out)

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held if self.ready else b""

    def _without_newline(self, buffer: bytes) -> bytes:
        if self._drop_newline:
            self._drop_newline = False
            for newline in (b"\r\n", b"\n"):
                if buffer.startswith(newline):
                    return buffer[len(newline) :]
        return buffer

    @staticmethod
    def _may_become_status(rest: bytes) -> bool:
        if len(rest) <= len(STATUS_HEAD):
            return STATUS_HEAD.startswith(rest)
        digits = rest[len(STATUS_HEAD) :]
        return rest.startswith(STATUS_HEAD) and digits.isdigit() and len(digits) <= 3


@dataclass
class ShellResult:
    reason: str = ""  # why the terminal closed, in the portal's (or the agent's) words
    status: int | None = None  # the script's or command's exit status, when it was learned
    output: bytearray = field(default_factory=bytearray)  # kept when asked (--json)


class _StdinReader:
    """stdin's bytes into the event loop, from a daemon thread: a read blocked on a terminal
    must not keep the process alive at the end (asyncio.to_thread's pool would), and a
    regular file cannot be watched by the loop."""

    def __init__(self, stream: BinaryIO, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._stream, self._loop = stream, loop
        threading.Thread(target=self._read, name="gpushare-stdin", daemon=True).start()

    def _read(self) -> None:
        fd = self._stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            try:
                self._loop.call_soon_threadsafe(self.queue.put_nowait, chunk)
            except RuntimeError:  # the session is over and its loop closed
                return
            if not chunk:
                return


async def _send(ws: ClientConnection, **message: Any) -> None:
    with contextlib.suppress(ConnectionClosed):  # the end is read from the socket, not here
        await ws.send(json.dumps(message))


class Terminal:
    def __init__(self, ws: ClientConnection, stdin: BinaryIO, stdout: BinaryIO, *, capture: bool) -> None:
        self.ws, self.stdin, self.stdout, self.capture = ws, stdin, stdout, capture
        self.result = ShellResult()
        self._tasks: list[asyncio.Task[None]] = []

    def _write(self, data: bytes) -> None:
        if not data:
            return
        if self.capture:
            self.result.output += data
        else:
            self.stdout.write(data)
            self.stdout.flush()

    async def _pipe_stdin(self, reader: _StdinReader, after: str | None) -> None:
        """stdin to the sandbox as typed text (UTF-8); at its end, ``after``."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        last = b""
        while chunk := await reader.queue.get():
            last = chunk[-1:]
            if text := decoder.decode(chunk):
                await _send(self.ws, type="input", data=text)
        if tail := decoder.decode(b"", final=True):
            await _send(self.ws, type="input", data=tail)
        if after is not None:
            await _send(self.ws, type="input", data=after if after else end_of_script(last))

    async def _send_size(self) -> None:
        try:  # the terminal the keys come from (stdout may be redirected)
            size = os.get_terminal_size(self.stdin.fileno())
        except (OSError, ValueError):
            size = shutil.get_terminal_size()
        await _send(self.ws, type="resize", rows=size.lines, cols=size.columns)

    async def run(self, mode: str, command: str | None) -> ShellResult:
        """Relay until the terminal closes. ``mode``: interactive, piped or command."""
        loop = asyncio.get_running_loop()
        output = OutputFilter(wait_for_ready=mode != "interactive")
        ready = asyncio.Event()
        try:
            async for message in self.ws:
                if isinstance(message, bytes):
                    self._write(output.feed(message) if mode != "interactive" else message)
                    if output.ready and not ready.is_set() and mode != "interactive":
                        ready.set()
                        self._start_input(mode, command, loop)
                    continue
                event = _parsed(message)
                if event.get("type") == "opened":
                    await self._opened(mode, command, loop, ready)
                elif event.get("type") == "closed":
                    self.result.reason = str(event.get("reason", ""))
        except ConnectionClosed:
            pass  # the close code says how it ended
        finally:
            for task in self._tasks:
                task.cancel()
        self._write(output.flush())
        self.result.status = output.status
        self._check_close(mode, ready)
        return self.result

    async def _opened(
        self, mode: str, command: str | None, loop: asyncio.AbstractEventLoop, ready: asyncio.Event
    ) -> None:
        if mode == "interactive":
            await self._send_size()
            with contextlib.suppress(NotImplementedError, RuntimeError):  # no SIGWINCH: no resizes
                loop.add_signal_handler(signal.SIGWINCH, lambda: self._spawn(self._send_size()))
            self._start_input(mode, command, loop)
            return
        await _send(self.ws, type="input", data=SET_UP)
        self._spawn(self._give_up_unless(ready))

    def _start_input(self, mode: str, command: str | None, loop: asyncio.AbstractEventLoop) -> None:
        if mode == "command":
            self._spawn(_send(self.ws, type="input", data=command_line(command or "")))
            return
        reader = _StdinReader(self.stdin, loop)
        self._spawn(self._pipe_stdin(reader, None if mode == "interactive" else ""))

    def _spawn(self, work: Any) -> None:
        self._tasks.append(asyncio.ensure_future(work))

    async def _give_up_unless(self, ready: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(ready.wait(), READY_WAIT_S)
        except TimeoutError:
            self.result.reason = f"the sandbox's shell did not answer in {READY_WAIT_S:g} s"
            await self.ws.close()

    def _check_close(self, mode: str, ready: asyncio.Event) -> None:
        code = self.ws.close_code
        reason = self.result.reason or self.ws.close_reason or ""
        if code in CLOSE_EXIT:
            raise ClientError(CLOSE_EXIT[code], f"Terminal refused: {reason or code}")
        if code not in (1000, None) and self.result.status is None:
            raise ClientError(Exit.UNREACHABLE, f"The terminal's connection broke off ({code}): {reason}")
        if mode != "interactive" and not ready.is_set():
            raise ClientError(Exit.ERROR, f"The sandbox's shell never became ready: {reason or 'it closed'}.")


def _parsed(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@contextlib.contextmanager
def _raw_terminal(stream: BinaryIO) -> Any:
    """The local terminal in raw mode (every key as typed, no local echo), restored after."""
    import termios
    import tty

    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def open_socket(url: str, credentials: Credentials, what: str, **options: Any) -> ClientConnection:
    """The WebSocket at ``url`` with the API token, or a ClientError saying why not (``what``:
    whose connection, in the message)."""
    try:
        return await connect(
            url,
            additional_headers={"Authorization": f"Bearer {credentials.token}"},
            user_agent_header="gpushare-client",
            open_timeout=30,
            **options,
        )
    except InvalidURI as exc:
        raise ClientError(Exit.USAGE, f"Not a WebSocket address: {url} ({exc}).") from exc
    except InvalidStatus as exc:
        status = exc.response.status_code
        code = {401: Exit.AUTH, 403: Exit.REFUSED, 404: Exit.NOT_FOUND}.get(status, Exit.UNREACHABLE)
        raise ClientError(code, f"The portal refused {what} ({status}).") from exc
    except (OSError, TimeoutError, WebSocketException) as exc:
        raise ClientError(Exit.UNREACHABLE, f"Cannot reach {url}: {exc or type(exc).__name__}.") from exc


async def _session(
    credentials: Credentials, sandbox_id: int, mode: str, command: str | None, capture: bool,
    stdin: BinaryIO, stdout: BinaryIO,
) -> ShellResult:  # fmt: skip
    url = socket_url(credentials.url, sandbox_id)
    ws = await open_socket(url, credentials, "the terminal's connection")
    async with ws:
        return await Terminal(ws, stdin, stdout, capture=capture).run(mode, command)


def open_shell(
    credentials: Credentials,
    sandbox_id: int,
    *,
    command: str | None = None,
    capture: bool = False,
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
) -> ShellResult:
    """Run one terminal session to its end. Interactive when stdin is a terminal and no
    ``command`` is given; ``capture`` keeps the output instead of writing it (--json)."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    interactive = command is None and stdin.isatty()
    mode = "command" if command is not None else "interactive" if interactive else "piped"
    session = _session(credentials, sandbox_id, mode, command, capture, stdin, stdout)
    if not interactive:
        return asyncio.run(session)
    with _raw_terminal(stdin):
        return asyncio.run(session)
