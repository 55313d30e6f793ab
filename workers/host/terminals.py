"""A browser's terminal into a sandbox, an SSH connection to it, or its web app's
connection: a pty, an sshd's pipes or a socket, relayed through Redis (``wire/relay.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from wire import config, relay
from wire.relay import Terminal
from wire.spec import SandboxHandle
from workers.drivers.base import DriverError

log = logging.getLogger(__name__)


def relay_stream(
    opener: Callable[[SandboxHandle], Terminal],
    host: str,
    session: str,
    allocation_key: str,
    handle: SandboxHandle | None,
    idle_s: float,
    what: str,
) -> None:
    """Relay the stream ``opener`` gives (a terminal's pty: ``driver.exec_terminal``; a web
    app's connection: ``driver.open_app``) on a thread of its own, until either side ends it
    (see ``wire.relay``); ``what`` names it in the log and the thread."""

    async def serve() -> None:
        try:
            async with Redis.from_url(config.redis_url()) as redis:
                reason = await opened_and_relayed(redis)
        except RedisError as exc:
            reason = f"Redis failed ({exc})"
        log.log(
            logging.INFO if what in ("terminal", "ssh") else logging.DEBUG,
            "%s of %s ended: %s",
            what,
            allocation_key,
            reason,
        )

    async def opened_and_relayed(redis: Redis) -> str:
        if handle is None:
            reason = f"sandbox {allocation_key} is not on host {host}"
            await relay.refuse(redis, host, session, reason)
            return reason
        try:
            terminal = await asyncio.to_thread(opener, handle)
        except DriverError as exc:
            await relay.refuse(redis, host, session, str(exc))
            return f"not opened: {exc}"
        return await relay.relay(redis, terminal, host, session, idle_s)

    threading.Thread(target=asyncio.run, args=(serve(),), name=f"{what}-{session[:8]}", daemon=True).start()
