"""A browser's terminal into a sandbox, or its web app's connection: a pty or a socket,
relayed through the channel layer (``workers/terminal_relay.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from workers import config, terminal_relay
from workers.drivers.base import DriverError, SandboxDriver, SandboxHandle, Terminal
from workers.telemetry import make_layer

log = logging.getLogger(__name__)


def open_terminal(
    driver: SandboxDriver,
    host: str,
    session: str,
    allocation_id: str,
    handle: SandboxHandle | None,
    idle_s: float,
) -> None:
    """Relay a pty into the sandbox (see ``workers.terminal_relay``) on a thread of its own:
    a session may last as long as the user types."""
    relay_stream(driver.exec_terminal, host, session, allocation_id, handle, idle_s, "terminal")


def open_app(
    driver: SandboxDriver,
    host: str,
    session: str,
    allocation_id: str,
    handle: SandboxHandle | None,
    idle_s: float,
) -> None:
    """Relay one connection to the sandbox's web app (portal/sandboxes/app_proxy.py)."""
    relay_stream(driver.open_app, host, session, allocation_id, handle, idle_s, "app")


def relay_stream(
    opener: Callable[[SandboxHandle], Terminal],
    host: str,
    session: str,
    allocation_id: str,
    handle: SandboxHandle | None,
    idle_s: float,
    what: str,
) -> None:

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
