"""A browser's terminal into a sandbox, or its web app's connection: a pty or a socket,
relayed through the channel layer (``workers/terminal_relay.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from workers import config, terminal_relay
from workers.drivers.base import DriverError, SandboxHandle, Terminal
from workers.telemetry import make_layer

log = logging.getLogger(__name__)


def relay_stream(
    opener: Callable[[SandboxHandle], Terminal],
    host: str,
    session: str,
    allocation_id: str,
    handle: SandboxHandle | None,
    idle_s: float,
    what: str,
) -> None:
    """Relay the stream ``opener`` gives (a terminal's pty: ``driver.exec_terminal``; a web
    app's connection: ``driver.open_app``) on a thread of its own, until either side ends it
    (see ``workers.terminal_relay``); ``what`` names it in the log and the thread."""

    async def serve() -> None:
        layer = make_layer(config.redis_url())
        if handle is None:
            await terminal_relay.refuse(layer, session, f"sandbox {allocation_id} is not on host {host}")
            return
        try:
            terminal = await asyncio.to_thread(opener, handle)
        except DriverError as exc:
            await terminal_relay.refuse(layer, session, str(exc))
            return
        reason = await terminal_relay.relay(layer, terminal, session, idle_s)
        log.log(
            logging.INFO if what == "terminal" else logging.DEBUG,
            "%s of %s ended: %s",
            what,
            allocation_id,
            reason,
        )

    threading.Thread(target=asyncio.run, args=(serve(),), name=f"{what}-{session[:8]}", daemon=True).start()
