"""API tokens, self-service: every token is made, checked and revoked here; making and
revoking are audited.

``check_issue_token`` says what a user may ask for (``admin`` scope for staff only, an
expiry from the offered choices); ``do_issue_token`` makes the token and returns its key,
which is then shown once and never stored; ``do_revoke_token`` ends one (its owner, or
staff for anyone's). ``check_api_token`` is the one check of a presented key, for the API
(``authentication.py``), a token WebSocket (``socket_auth.py``) and the recheck of an open
one (``streams.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, timedelta
from typing import Any

from django.db import transaction
from django.http import HttpRequest
from django.utils import timezone
from rest_framework.request import Request

from portal.accounts import throttle
from portal.accounts.models import ApiToken
from portal.audit import trail

EXPIRY_DAYS = (7, 30, 90, 365)  # a token always ends; a year at most
DEFAULT_EXPIRY_DAYS = 90
# A token's last use is written when the one recorded is older than this: a script's burst of
# a hundred requests wrote its token's row a hundred times, each write waiting its turn for
# SQLite's one writer with the requests' own (BENCHMARKS.md, "A burst of requests").
LAST_USE_PRECISION = timedelta(minutes=1)


class TokenError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def scopes_for(user: Any) -> list[tuple[str, str]]:
    """The scopes ``user`` may give a token: ``admin`` reaches every project, staff only."""
    return [(value, label) for value, label in ApiToken.Scope.choices if user.is_staff or value != "admin"]


def check_issue_token(user: Any, name: str, scopes: list[str], expiry_days: int) -> None:
    allowed = {value for value, _ in scopes_for(user)}
    if not name.strip():
        raise TokenError("name", "Give the token a name, such as the script that will use it.")
    if not scopes:
        raise TokenError("scopes", "Choose at least one scope.")
    if refused := [s for s in scopes if s not in allowed]:
        raise TokenError("scopes", f"You may not give a token {', '.join(refused)}.")
    if expiry_days not in EXPIRY_DAYS:
        raise TokenError("expiry_days", f"Choose one of {', '.join(map(str, EXPIRY_DAYS))} days.")


def do_issue_token(user: Any, name: str, scopes: list[str], expiry_days: int) -> tuple[ApiToken, str]:
    """A token of ``user``'s, and its key (show it once; it is not kept)."""
    check_issue_token(user, name, scopes, expiry_days)
    with transaction.atomic():
        token, key = ApiToken.issue(
            user, name.strip(), sorted(set(scopes)), expires_at=timezone.now() + timedelta(days=expiry_days)
        )
        trail.record(
            user,
            "api_token.created",
            token,
            None,
            {"name": token.name, "scopes": token.scopes, "expires_at": token.expires_at.isoformat()},  # type: ignore[union-attr]
            f"{user.get_username()} made API token {token.key_prefix}…",
        )
    return token, key


def tokens_visible_to(user: Any) -> Any:
    """The tokens ``user`` may list and revoke: their own; staff, everyone's."""
    tokens = ApiToken.objects.select_related("user", "revoked_by")
    return tokens if user.is_staff else tokens.filter(user=user)


def do_revoke_token(actor: Any, token_id: int) -> ApiToken | None:
    """Revoke one of the tokens ``actor`` may see (None when there is none such: a 404).
    Revoking a revoked token changes nothing."""
    with transaction.atomic():
        token = tokens_visible_to(actor).select_for_update(of=("self",)).filter(pk=token_id).first()
        if token is None or token.revoked_at is not None:
            return token
        token.revoked_at = timezone.now()
        token.revoked_by = actor
        token.save(update_fields=["revoked_at", "revoked_by"])
        owner = token.user.get_username()
        trail.record(
            actor,
            "api_token.revoked",
            token,
            {"revoked_at": None},
            {"revoked_at": token.revoked_at.isoformat()},
            f"{actor.get_username()} revoked {owner}'s API token {token.key_prefix}…",
        )
    return token


INVALID = "Invalid or revoked API token."


@dataclass(frozen=True)
class TokenRefusal:
    """Why a key was refused. ``throttled``: its client's address is locked out, so the key
    was not even looked up (429 on the API, 4429 on a socket); otherwise it is no valid
    token (401, 4401), and, for a new request, was counted against the address."""

    reason: str
    throttled: bool = False


def check_api_token(key: str, request: HttpRequest | Request | None) -> ApiToken | TokenRefusal:
    """The token ``key`` belongs to (its user loaded) if it may be used now, else why not.

    With ``request`` (a new API request or socket: its client's address), the key is a guess
    like a password: refused unread while the address is locked out, counted against it when
    refused (``throttle``, scope ``api-token``), its last use recorded when accepted. Without
    (an open socket asking again), none of that: no new guess was made, and another client's
    guessing behind the same address must not close it.

    A deactivated user's token says no more than an unknown key, expired or not.
    """
    if request is not None and throttle.is_blocked(request, scope="api-token"):
        minutes = throttle.lockout_minutes()
        return TokenRefusal(f"Too many invalid API tokens from here: wait {minutes} minutes.", throttled=True)
    token = ApiToken.find(key)
    if token is None or not token.user.is_active or token.state == "revoked":
        return _refused(INVALID, request)
    if token.state == "expired" and token.expires_at is not None:
        when = token.expires_at.astimezone(UTC)
        return _refused(f"This API token expired on {when:%Y-%m-%d %H:%M} UTC: make a new one.", request)
    if request is not None:
        now = timezone.now()
        if token.last_used_at is None or now - token.last_used_at >= LAST_USE_PRECISION:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token


def _refused(reason: str, request: HttpRequest | Request | None) -> TokenRefusal:
    if request is not None:
        throttle.record_failure(request, scope="api-token")
    return TokenRefusal(reason)
