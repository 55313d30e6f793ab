"""Asking again while a stream is open: a WebSocket's permission holds only while its reason
to exist does (the sandbox runs, the user is still a member, still active, still signed in,
the API token it was opened with still valid).

A consumer checks at connect, then ``Recheck`` asks again every ``STREAM_RECHECK_S`` seconds
with the user as the database has them now, and closes the socket the first time the answer
is no. Without it an open socket kept streaming a GPU's figures after its user's sandbox had
ended, or to a user removed from the project (only a new connection was refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.sessions.backends.base import SessionBase

from portal.accounts import tokens
from portal.accounts.models import ApiToken
from portal.accounts.socket_auth import socket_key, socket_token

log = logging.getLogger(__name__)


def current_user(scope: dict[str, Any]) -> Any:
    """The socket's user as the database has them now: None once they signed out (session
    gone), were deactivated or deleted, or, for a socket opened with an API token, once the
    token was revoked or expired. Synchronous: call through database_sync_to_async."""
    if socket_token(scope) is not None:
        # The check the socket passed when it opened, without the throttle: this is no guess.
        key = socket_key(scope)
        verdict = tokens.check_api_token(key, None) if key else None
        return verdict.user if isinstance(verdict, ApiToken) else None
    user = scope.get("user")
    session: SessionBase | None = scope.get("session")
    if user is None or not user.is_authenticated or session is None or not session.session_key:
        return None
    if not session.exists(session.session_key):
        return None
    return get_user_model().objects.filter(pk=user.pk, is_active=True).first()


class Recheck:
    """Every ``STREAM_RECHECK_S``: ``allowed(user)`` (synchronous, may query) with the current
    user; on the first False (or no user), ``revoked()`` is awaited and the checks end."""

    def __init__(
        self,
        scope: dict[str, Any],
        allowed: Callable[[Any], bool],
        revoked: Callable[[], Awaitable[None]],
        every_s: float | None = None,
    ) -> None:
        self.scope = scope
        self.allowed = allowed
        self.revoked = revoked
        self.every_s = settings.STREAM_RECHECK_S if every_s is None else every_s
        self._task: asyncio.Task[None] | None = None

    def _still_allowed(self) -> bool:
        user = current_user(self.scope)
        return user is not None and self.allowed(user)

    async def _run(self) -> None:
        # The first check a random part of the period in: sockets opened together (a page's
        # several, every page after a restart) would otherwise all ask in the same instant,
        # every period, thousands of queries at once. Never later than every_s either way.
        await asyncio.sleep(random.uniform(0, self.every_s))  # noqa: S311 - spreading, not secrecy
        while True:
            if not await database_sync_to_async(self._still_allowed)():
                await self.revoked()
                return
            await asyncio.sleep(self.every_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
