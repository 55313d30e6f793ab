"""ASGI entry point: Django for HTTP, Channels for WebSockets (origin and session checked),
and, for any Host under ``APPS_DOMAIN``, sandboxes' web apps on their own origins
(portal/sandboxes/app_proxy.py, app_websocket.py), which never reach Django or the portal's
sockets: a request's Host decides, before any route.

Two rules sit in front of all of them, decided here once for any ASGI server (uvicorn, daphne):
- The client's address and scheme come from ``X-Forwarded-For``/``X-Forwarded-Proto`` only
  when the connection comes from one of ``TRUSTED_PROXIES`` (uvicorn's own middleware, which
  takes the right-most address not a trusted proxy). Servers are started with their own
  proxy handling off (``--no-proxy-headers``), so nobody else's headers are believed: with
  uvicorn's default, anyone on the machine's loopback could pick their address per request.
- A WebSocket is accepted only from the page's own origin, compared by scheme, host and
  port (or from one of ``CSRF_TRUSTED_ORIGINS``), as Django's CSRF check compares forms.
  A WebSocket with an ``Authorization`` header (an API token: the command-line client's
  shell) is not a browser's, which cannot send one: it skips the origin check and takes no
  session, only its token (``portal/accounts/socket_auth.py``), on the routes that take one.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

from wire.config import ensure_embedded_redis

ensure_embedded_redis()

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import WebsocketDenier  # noqa: E402
from django.conf import settings  # noqa: E402
from django.http.request import split_domain_port, validate_host  # noqa: E402
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware  # noqa: E402

from portal.accounts.socket_auth import BearerOrSession, TokenSocketAuth  # noqa: E402
from portal.sandboxes.app_proxy import AppProxy  # noqa: E402
from portal.sandboxes.app_websocket import AppWebSocket  # noqa: E402
from portal.telemetry.routing import token_websocket_urlpatterns, websocket_urlpatterns  # noqa: E402

_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _origin(url: str) -> tuple[str, str, str] | None:
    """(scheme, host, port) of an origin, the default port spelled out; None if malformed."""
    try:
        parts = urlsplit(url.strip().lower())
        port = str(parts.port) if parts.port is not None else _DEFAULT_PORTS.get(parts.scheme, "")
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    return parts.scheme, parts.hostname, port


def same_origin(scope: dict[str, Any]) -> bool:
    """True when the socket's Origin is the page's own origin or a trusted one."""
    headers = {name.lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}
    origin, host = headers.get(b"origin"), headers.get(b"host")
    if not origin or not host or not validate_host(split_domain_port(host)[0], settings.ALLOWED_HOSTS):
        return False
    scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
    allowed = {_origin(f"{scheme}://{host}"), *(_origin(o) for o in settings.CSRF_TRUSTED_ORIGINS)}
    asked = _origin(origin)
    return asked is not None and asked in allowed


class SameOriginValidator:
    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] == "websocket" and not same_origin(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)


class ByHost:
    """Requests for a host under ``APPS_DOMAIN`` go to ``apps``, every other to ``portal``."""

    def __init__(self, apps: Any, portal: Any) -> None:
        self.apps = apps
        self.portal = portal

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        domain = settings.APPS
        host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"host"), "")
        app = self.apps if domain is not None and domain.holds(host) else self.portal
        return await app(scope, receive, send)


def build(trusted_proxies: list[str]) -> Any:
    router = ProtocolTypeRouter(
        {
            "http": ByHost(AppProxy.as_asgi(), django_asgi_app),
            "websocket": ByHost(
                AppWebSocket.as_asgi(),
                BearerOrSession(
                    token_app=TokenSocketAuth(URLRouter(token_websocket_urlpatterns)),
                    session_app=SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
                ),
            ),
        }
    )
    return ProxyHeadersMiddleware(router, trusted_hosts=trusted_proxies) if trusted_proxies else router


application = build(settings.TRUSTED_PROXIES)
