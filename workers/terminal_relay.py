"""Web terminals: a sandbox's pty relayed between its host agent and a browser.

The portal never reaches a GPU host directly (docs/architecture.md: agents only share the broker and the
channel layer). A browser's WebSocket consumer mints a session id nobody else knows, joins
``term-out.<session>`` and asks the sandbox's agent, through its Celery queue, to
``open_terminal``. The agent opens the driver's pty (``exec_terminal``) and relays:

- pty output -> ``term.output`` messages (base64) to ``term-out.<session>``;
- ``term.input`` / ``term.resize`` / ``term.close`` messages sent to ``term-in.<session>``
  -> the pty;

until the shell exits, the browser goes away (``term.close``) or nothing comes in for
``TERMINAL_IDLE_S``; then ``term.closed`` says why. Nothing here touches the database.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from typing import Any

from workers.drivers.base import Terminal

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 0.2


def term_in_group(session: str) -> str:
    return f"term-in.{session}"


def term_out_group(session: str) -> str:
    return f"term-out.{session}"


def encode(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode(text: str) -> bytes:
    return base64.b64decode(text.encode())


async def relay(layer: Any, terminal: Terminal, session: str, idle_s: float) -> str:
    """Relay one session until it ends; returns why it ended (also sent as ``term.closed``)."""
    out = term_out_group(session)
    channel = await layer.new_channel()
    await layer.group_add(term_in_group(session), channel)
    await layer.group_send(out, {"type": "term.opened"})

    async def pump_out() -> str:
        while True:
            try:
                data = await asyncio.to_thread(terminal.read, READ_TIMEOUT_S)
            except EOFError as exc:
                return str(exc) or "the shell exited"
            if data:
                await layer.group_send(out, {"type": "term.output", "data": encode(data)})

    async def pump_in() -> str:
        while True:
            try:
                message = await asyncio.wait_for(layer.receive(channel), timeout=idle_s)
            except TimeoutError:
                return f"closed after {idle_s:.0f} s without input"
            kind = message.get("type")
            if kind == "term.close":
                return "closed by the browser"
            try:
                if kind == "term.input":
                    await asyncio.to_thread(terminal.write, decode(message.get("data", "")))
                elif kind == "term.resize":
                    terminal.resize(int(message["rows"]), int(message["cols"]))
            except EOFError as exc:
                return str(exc) or "the shell exited"
            except (KeyError, ValueError) as exc:
                log.warning("terminal %s: bad message %r ignored (%s)", session, kind, exc)

    tasks = [asyncio.create_task(pump_out()), asyncio.create_task(pump_in())]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        reason = next(iter(done)).result()
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        terminal.close()
        await layer.group_discard(term_in_group(session), channel)
    await layer.group_send(out, {"type": "term.closed", "reason": reason})
    return reason


async def refuse(layer: Any, session: str, reason: str) -> None:
    await layer.group_send(term_out_group(session), {"type": "term.closed", "reason": reason})
