"""A browser's terminal into a sandbox: a pty relayed through the channel layer."""

from __future__ import annotations

import asyncio
import logging
import threading

from workers import config, terminal_relay
from workers.drivers.base import DriverError, SandboxDriver, SandboxHandle
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

    async def serve() -> None:
        layer = make_layer(config.redis_url())
        if handle is None:
            await terminal_relay.refuse(layer, session, f"sandbox {allocation_id} is not on host {host}")
            return
        try:
            terminal = await asyncio.to_thread(driver.exec_terminal, handle)
        except DriverError as exc:
            await terminal_relay.refuse(layer, session, str(exc))
            return
        reason = await terminal_relay.relay(layer, terminal, session, idle_s)
        log.info("terminal into %s ended: %s", allocation_id, reason)

    threading.Thread(target=asyncio.run, args=(serve(),), name=f"terminal-{session[:8]}", daemon=True).start()
