"""Asking again while a stream is open: a WebSocket's permission holds only while its reason
to exist does (the sandbox runs, the user is still a member, still active, still signed in,
the API token it was opened with still valid).

A consumer checks at connect, then registers with its process's ``OpenStreams``, which asks
again for every open socket every ``STREAM_RECHECK_S`` seconds and closes each socket the
first time its answer is no. Without it an open socket kept streaming a GPU's figures after
its user's sandbox had ended, or to a user removed from the project.

Why one batch per process and not a timer per socket: at 2,000 open pages a check per socket
was 400 checks a second, each a few queries and a hop onto Channels' single database thread.
The batch asks once per period with a few bulk queries whatever the number of sockets: who is
still signed in (``current_users``: sessions, users, API tokens), then each consumer class
answers for all its own sockets at once (``Rechecked.still_allowed_all``).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol, Self

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone

from portal.accounts.models import ApiToken, token_hash
from portal.accounts.socket_auth import socket_key, socket_token

log = logging.getLogger(__name__)


class Rechecked(Protocol):
    """A consumer whose permission is asked again while it is open."""

    scope: dict[str, Any]

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        """For each (socket of this class, its user as the database has them now): whether it
        may keep streaming. Synchronous, in bulk: a few queries for all of them together."""
        ...


@dataclass(eq=False)
class _Open:
    consumer: Rechecked
    revoked: Callable[[], Awaitable[None]]


def _session_model() -> Any:
    """The table the configured session engine keeps (db and cached_db: the database is the
    truth, the cache only a copy; signing out deletes the row)."""
    return import_module(settings.SESSION_ENGINE).SessionStore.get_model_class()


def current_users(scopes: Sequence[dict[str, Any]]) -> list[Any]:
    """Each socket's user as the database has them now, in three queries whatever their
    number: None once they signed out (session gone or expired), were deactivated or deleted,
    or, for a socket opened with an API token, once the token was revoked or expired."""
    session_keys: dict[int, str] = {}
    user_ids: dict[int, Any] = {}
    token_hashes: dict[int, str] = {}
    for i, scope in enumerate(scopes):
        if socket_token(scope) is not None:
            key = socket_key(scope)
            if key:
                token_hashes[i] = token_hash(key)
            continue
        user, session = scope.get("user"), scope.get("session")
        if user is not None and user.is_authenticated and session is not None and session.session_key:
            session_keys[i], user_ids[i] = session.session_key, user.pk
    now = timezone.now()
    live_sessions = (
        set(
            _session_model()
            .objects.filter(session_key__in=set(session_keys.values()), expire_date__gt=now)
            .values_list("session_key", flat=True)
        )
        if session_keys
        else set()
    )
    active = (
        get_user_model().objects.filter(pk__in=set(user_ids.values()), is_active=True).in_bulk()
        if user_ids
        else {}
    )
    tokens = (
        {
            t.key_hash: t
            for t in ApiToken.objects.select_related("user").filter(key_hash__in=token_hashes.values())
        }
        if token_hashes
        else {}
    )
    users: list[Any] = [None] * len(scopes)
    for i, key in session_keys.items():
        if key in live_sessions:
            users[i] = active.get(user_ids[i])
    for i, digest in token_hashes.items():
        token = tokens.get(digest)
        # As tokens.check_api_token decides for a socket asking again (no throttle: no guess).
        if token is not None and token.user.is_active and token.state == "active":
            users[i] = token.user
    return users


def current_user(scope: dict[str, Any]) -> Any:
    """``current_users`` for one socket."""
    return current_users([scope])[0]


def still_allowed(consumers: Sequence[Rechecked]) -> list[bool]:
    """Whether each open socket may keep streaming: its user first, then its class's own
    question, asked once per class for all its sockets. Synchronous (it queries)."""
    users = current_users([c.scope for c in consumers])
    verdicts = [False] * len(consumers)
    by_class: dict[type[Rechecked], list[int]] = {}
    for i, user in enumerate(users):
        if user is not None:
            by_class.setdefault(type(consumers[i]), []).append(i)
    for cls, indexes in by_class.items():
        answers = cls.still_allowed_all([(consumers[i], users[i]) for i in indexes])
        for i, answer in zip(indexes, answers, strict=True):
            verdicts[i] = answer
    return verdicts


class OpenStreams:
    """The open sockets of one process (one event loop) and the one task that asks again for
    all of them every ``STREAM_RECHECK_S``; the task runs while any socket is open."""

    def __init__(self) -> None:
        self._open: dict[int, _Open] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._open)

    def watch(self, consumer: Rechecked, revoked: Callable[[], Awaitable[None]]) -> None:
        """Ask again for ``consumer`` from now on; ``revoked()`` is awaited the first time the
        answer is no, and it is then forgotten."""
        self._open[id(consumer)] = _Open(consumer, revoked)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    def forget(self, consumer: Rechecked) -> None:
        self._open.pop(id(consumer), None)

    async def _run(self) -> None:
        while self._open:
            # Read each period: tests shorten it on a running process.
            await asyncio.sleep(settings.STREAM_RECHECK_S)
            try:
                await self.check_now()
            except Exception:  # a database hiccup: ask again next period rather than never
                log.exception("rechecking %d open streams failed", len(self._open))

    async def check_now(self) -> int:
        """One period's checks for every open socket; the number closed."""
        asked = list(self._open.values())
        if not asked:
            return 0
        verdicts = await database_sync_to_async(still_allowed)([o.consumer for o in asked])
        closed = 0
        for entry, allowed in zip(asked, verdicts, strict=True):
            if self._open.get(id(entry.consumer)) is not entry:
                continue  # gone while we asked
            if allowed:
                # A consumer whose check also says what it listens to (the telemetry ones:
                # the host holding what it shows) follows it now.
                follow = getattr(entry.consumer, "rechecked", None)
                if follow is not None:
                    try:
                        await follow()
                    except Exception:  # the socket went away meanwhile: its disconnect follows
                        log.debug("following a stream's groups failed", exc_info=True)
                continue
            del self._open[id(entry.consumer)]
            # Its own task: one client slow to take its close must not hold up the others'.
            task = asyncio.create_task(self._close(entry))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            closed += 1
        return closed

    async def _close(self, entry: _Open) -> None:
        try:
            await entry.revoked()
        except Exception:  # the socket went away meanwhile: its disconnect follows
            log.debug("closing a revoked stream failed", exc_info=True)


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, OpenStreams] = weakref.WeakKeyDictionary()


def open_streams() -> OpenStreams:
    """This process's registry (one per event loop: each test has its own)."""
    loop = asyncio.get_running_loop()
    registry = _per_loop.get(loop)
    if registry is None:
        registry = _per_loop[loop] = OpenStreams()
    return registry
