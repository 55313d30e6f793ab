"""A stand-in for the portal's terminal WebSocket, for the client's shell tests: the same
protocol (portal/tunnels/consumers.py) in front of a real ``/bin/sh`` on a real pty, as
the agent's Docker exec gives one. The e2e test runs the client against the real portal
and a real container."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from websockets.sync.server import Server, ServerConnection, serve

from tests.cli.fake_portal import TOKEN


@dataclass
class FakeTerminal:
    refuse: tuple[int, str] | None = None  # (close code, reason): refuse every socket
    resizes: list[tuple[int, int]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def handle(self, ws: ServerConnection) -> None:
        self.headers.append(dict(ws.request.headers.raw_items()) if ws.request else {})
        authorization = ws.request.headers.get("Authorization") if ws.request else None
        if authorization != f"Bearer {TOKEN}":
            self._close(ws, 4401, "Invalid or revoked API token.")
            return
        if self.refuse is not None:
            self._close(ws, *self.refuse)
            return
        main, side = pty.openpty()
        shell = subprocess.Popen(
            ["/bin/sh", "-i"], stdin=side, stdout=side, stderr=side, start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TERM": "xterm", "PS1": "$ "},
        )  # fmt: skip
        os.close(side)
        ws.send(json.dumps({"type": "opened"}))
        pump = threading.Thread(target=self._output, args=(ws, main, shell), daemon=True)
        pump.start()
        try:
            for message in ws:
                event = json.loads(message)
                if event["type"] == "input":
                    os.write(main, event["data"].encode())
                elif event["type"] == "resize":
                    self.resizes.append((event["rows"], event["cols"]))
        except Exception:  # noqa: S110 - the socket went: the shell is ended below
            pass
        finally:
            if shell.poll() is None:
                shell.kill()
            shell.wait()
            pump.join(timeout=5)

    def _output(self, ws: ServerConnection, main: int, shell: subprocess.Popen[bytes]) -> None:
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: the shell ended and the pty closed
                data = b""
            if not data:
                break
            ws.send(data)
        os.close(main)
        shell.wait()
        self._close(ws, 1000, "shell exited")

    @staticmethod
    def _close(ws: ServerConnection, code: int, reason: str) -> None:
        try:
            ws.send(json.dumps({"type": "closed", "reason": reason}))
            ws.close(code)
        except Exception:  # noqa: S110 - the client left first
            pass


@contextmanager
def terminal_server(terminal: FakeTerminal) -> Iterator[str]:
    """The server on a free port; yields the portal URL the client is given."""
    server: Server = serve(terminal.handle, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.socket.getsockname()[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=5)


def header(terminal: FakeTerminal, name: str) -> Any:
    return next((h.get(name) for h in terminal.headers), None)
