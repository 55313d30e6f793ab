"""Who may open a sandbox's web app, and how their browser gets onto its origin.

The app is served on an origin of its own (``portal.sandboxes.reach.app_origin``), which the portal's session
cookie never reaches. The owner crosses over with a grant:

1. ``/sandboxes/<id>/app/<path>`` on the portal (signed in, the owner: ``portal.tunnels.views.open_app``)
   makes a **grant**, a random code valid ``APP_GRANT_TTL_S`` and redeemable once, bound to
   the user, the sandbox and the portal session, and redirects the browser to
   ``<app origin>/__gpushare__/grant?code=…&next=<path>``.
2. The app's origin redeems it for an **app session**: a random cookie on that origin alone
   (host-only, HttpOnly, SameSite=Lax, Secure and ``__Host-`` over https) whose record here
   names the user, the sandbox and the portal session.
3. Every request and open WebSocket on the app's origin is checked against that record: the
   portal session still signed in as that user (signing out of the portal, or a password
   change, ends it), the user active and still the owner, the sandbox running.

Only the owner: an app runs its owner's code, and a manager or admin who opened it would run
that code with their own grant. Records live in Django's cache (Redis, shared by every
server), keyed by a hash of the secret, never the secret itself.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from importlib import import_module
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.core.cache import cache
from django.utils.crypto import constant_time_compare

from portal.sandboxes.models import Sandbox, SandboxState
from portal.sandboxes.reach import TERMINAL_ISOLATION
from portal.tunnels.app_origin import GRANT_PATH, AppLabel, AppsDomain

_GRANT = "app-grant:"
_SESSION = "app-session:"


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str


@dataclass(frozen=True)
class Target:
    """Where a running app is: its host's agent relays a connection to it."""

    host: str
    allocation_key: str
    handle: dict[str, Any] | None


@dataclass(frozen=True)
class AppSession:
    user: Any
    session_key: str  # the portal session it was granted from


def apps_domain() -> AppsDomain | None:
    apps: AppsDomain | None = settings.APPS
    return apps


def cookie_name() -> str:
    apps = apps_domain()
    return "__Host-gpushare_app" if apps is not None and apps.secure else "gpushare_app"


def check_owner(user: Any, sandbox_id: int) -> Target | Refusal:
    """Where the app is, or why ``user`` may not open it (an HTTP status and a sentence)."""
    sandbox = Sandbox.objects.select_related("host", "image").filter(pk=sandbox_id).first()
    return owner_verdict(user, sandbox)


def owner_verdict(user: Any, sandbox: Sandbox | None) -> Target | Refusal:
    """``check_owner`` for a sandbox already read (with its host and image)."""
    if user is None or not user.is_authenticated or not user.is_active:
        return Refusal(403, "Sign in to open a sandbox's app.")
    if sandbox is None or sandbox.owner_id != user.pk:
        return Refusal(403, "Only the sandbox's owner can open its app.")
    if not sandbox.image.app:
        return Refusal(404, f"The image {sandbox.image.name} serves no app.")
    if sandbox.state != SandboxState.RUNNING or sandbox.host is None:
        return Refusal(409, f"The sandbox is {sandbox.get_state_display().lower()}, not running.")
    if sandbox.isolation not in TERMINAL_ISOLATION or sandbox.host.simulated_sandboxes:
        return Refusal(409, "Only container and process sandboxes on a real host serve their app here.")
    if apps_domain() is None:
        return Refusal(503, "This portal serves no apps: its operator has not set APPS_DOMAIN.")
    return Target(sandbox.host.name, sandbox.allocation_key, sandbox.handle)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_grant(user: Any, session_key: str, target: Target, sandbox_id: int, next_path: str) -> str:
    """The URL that takes ``user``'s browser onto the app's origin, signed in there."""
    apps = apps_domain()
    assert apps is not None  # noqa: S101 - check_owner refused first
    code = secrets.token_urlsafe(32)
    record = {"user": user.pk, "sandbox": sandbox_id, "key": target.allocation_key, "session": session_key}
    cache.set(_GRANT + _digest(code), record, timeout=settings.APP_GRANT_TTL_S)
    query = urlencode({"code": code, "next": safe_next(next_path)})
    return f"{apps.origin(sandbox_id, target.allocation_key)}{GRANT_PATH}?{query}"


def safe_next(path: str) -> str:
    """A path on the app's own origin: never another origin (``//evil``, ``/\\evil``)."""
    if not path.startswith("/") or path.startswith(("//", "/\\")) or any(c in path for c in "\r\n\0"):
        return "/"
    return path


def redeem_grant(code: str, label: AppLabel) -> str | None:
    """A new app session's cookie value for the grant ``code``, once, on the origin it was
    made for; None when it is unknown, used, expired, or for another sandbox."""
    key = _GRANT + _digest(code)
    record = cache.get(key)
    # delete() says whether it removed the key: of two racing redemptions, one wins.
    if not isinstance(record, dict) or not cache.delete(key):
        return None
    if record.get("sandbox") != label.sandbox_id or record.get("key") != label.allocation_key:
        return None
    value = secrets.token_urlsafe(32)
    session = {"user": record["user"], "sandbox": label.sandbox_id, "session": record["session"]}
    cache.set(_SESSION + _digest(value), session, timeout=settings.APP_SESSION_TTL_S)
    return value


def app_session(value: str, label: AppLabel) -> AppSession | None:
    """The owner an app session cookie stands for, if it still does: made for this sandbox,
    and the portal session it was granted from still signed in as that user."""
    if not value:
        return None
    record = cache.get(_SESSION + _digest(value))
    if not isinstance(record, dict) or record.get("sandbox") != label.sandbox_id:
        return None
    user = get_user_model().objects.filter(pk=int(record["user"]), is_active=True).first()
    if user is None or not portal_session_holds(str(record.get("session", "")), user):
        return None
    return AppSession(user=user, session_key=str(record["session"]))


def admit(value: str, label: AppLabel) -> tuple[Target, AppSession] | Refusal | None:
    """The app an app session cookie opens on the origin ``label`` names, and whose session
    it is; a Refusal; or None when there is no live app session (the browser must get a
    grant again). Synchronous: it queries."""
    session = app_session(value, label)
    if session is None:
        return None
    verdict = check_owner(session.user, label.sandbox_id)
    if isinstance(verdict, Refusal):
        return verdict
    if verdict.allocation_key != label.allocation_key:
        return Refusal(410, "This address was an earlier run of the sandbox's: open its app from its page.")
    return verdict, session


def portal_session_holds(session_key: str, user: Any) -> bool:
    """Whether the portal session is still signed in as ``user`` (as django.contrib.auth's
    get_user decides: the same user, and the password unchanged since)."""
    if not session_key:
        return False
    store = session_store(session_key)
    if str(store.get(SESSION_KEY, "")) != str(user.pk):
        return False
    return constant_time_compare(str(store.get(HASH_SESSION_KEY, "")), user.get_session_auth_hash())


def session_store(session_key: str) -> Any:
    return import_module(settings.SESSION_ENGINE).SessionStore(session_key=session_key)
