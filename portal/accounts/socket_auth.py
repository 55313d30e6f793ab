"""API tokens on WebSockets: ``Authorization: Bearer gps_...`` on the handshake (the
``gpushare`` command-line client's shell), beside the browser's session cookie.

A browser cannot put an Authorization header on a WebSocket, so a socket that carries one
was not opened by a page on another site: it needs no Origin check (``portal.asgi`` keeps
that check for every cookie-authenticated socket). It gets no session either: a token
socket is its token's user with the token's scopes, and nothing a cookie says.

The token is checked by the API's own check (``tokens.check_api_token``): refused while its
address is throttled, and each invalid, revoked or expired token counted against that
address. ``streams.current_user`` asks the same check again every ``STREAM_RECHECK_S``, so
a token revoked or expired while its socket is open (or its user deactivated) closes it.

Only routes listed for tokens take them (``portal.routing``); a refusal is
accepted, told why in a ``closed`` message, and closed with a 44xx code, as the terminal
refuses: 4401 no valid token, 4404 no such route for tokens, 4429 throttled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from channels.db import database_sync_to_async
from django.http import HttpRequest

from portal.accounts import tokens
from portal.accounts.models import ApiToken

SCOPE_KEY = "api_token"  # the ASGI scope's entry for a token socket: a SocketToken
UNAUTHORIZED, NOT_FOUND, THROTTLED = 4401, 4404, 4429
_KEYWORDS = ("bearer", "token")  # as ApiTokenAuthentication takes them


@dataclass(frozen=True)
class SocketToken:
    """The scopes of the token a socket was opened with (the recheck finds the token again
    by the handshake's key: ``socket_key``)."""

    scopes: tuple[str, ...]


def authorization(scope: dict[str, Any]) -> str | None:
    """The handshake's Authorization header, or None when it has none."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            return str(value.decode("latin-1"))
    return None


def bearer_key(header: str) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (None: not that form)."""
    words = header.split()
    return words[1] if len(words) == 2 and words[0].lower() in _KEYWORDS else None


def socket_key(scope: dict[str, Any]) -> str | None:
    """The API key a socket's handshake carried (None: none, or not as a bearer token)."""
    header = authorization(scope)
    return None if header is None else bearer_key(header)


def socket_token(scope: dict[str, Any]) -> SocketToken | None:
    token = scope.get(SCOPE_KEY)
    return token if isinstance(token, SocketToken) else None


def socket_has_scope(scope: dict[str, Any], needed: str) -> bool:
    """A session socket has its user's full rights; a token socket those of its scopes."""
    token = socket_token(scope)
    return token is None or needed in token.scopes or ApiToken.Scope.ADMIN in token.scopes


def _address_of(scope: dict[str, Any]) -> HttpRequest:
    """What the throttle reads of a request (the client's address, which ``portal.asgi``
    has already taken from a trusted proxy where there is one), for a socket."""
    request = HttpRequest()
    client = scope.get("client")
    request.META["REMOTE_ADDR"] = str(client[0]) if client else "unknown"
    return request


@dataclass(frozen=True)
class Refusal:
    code: int
    reason: str


def authenticate(header: str, scope: dict[str, Any]) -> tuple[Any, SocketToken] | Refusal:
    """The token's user and scopes, or why the socket is refused. Synchronous (it queries)."""
    key = bearer_key(header)
    if key is None:
        return Refusal(UNAUTHORIZED, "The Authorization header must be 'Bearer <token>'.")
    verdict = tokens.check_api_token(key, _address_of(scope))
    if isinstance(verdict, tokens.TokenRefusal):
        return Refusal(THROTTLED if verdict.throttled else UNAUTHORIZED, verdict.reason)
    return verdict.user, SocketToken(tuple(verdict.scopes))


async def refuse(receive: Any, send: Any, refusal: Refusal) -> None:
    """Accept the handshake, say why in a ``closed`` message, close with the refusal's code
    (a client learns the reason, which a denied handshake cannot carry)."""
    message = await receive()
    if message.get("type") != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps({"type": "closed", "reason": refusal.reason})})
    await send({"type": "websocket.close", "code": refusal.code})


class NotForTokens:
    """The token router's last route: any socket that takes no token."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        reason = "This WebSocket does not take API tokens (the sandbox terminal does)."
        await refuse(receive, send, Refusal(NOT_FOUND, reason))


class TokenSocketAuth:
    """Middleware for token sockets: the token's user in ``scope["user"]``, the token in
    ``scope[SCOPE_KEY]``; a missing or bad token is refused before the route runs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        verdict = await database_sync_to_async(authenticate)(authorization(scope) or "", scope)
        if isinstance(verdict, Refusal):
            return await refuse(receive, send, verdict)
        user, token = verdict
        return await self.inner({**scope, "user": user, SCOPE_KEY: token}, receive, send)


class BearerOrSession:
    """WebSockets with an Authorization header go to ``token_app``, the others (browsers,
    by their session cookie) to ``session_app``."""

    def __init__(self, token_app: Any, session_app: Any) -> None:
        self.token_app = token_app
        self.session_app = session_app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        app = self.token_app if authorization(scope) is not None else self.session_app
        return await app(scope, receive, send)
