"""Throttling of password guessing: the login pages and invalid API tokens.

Failures are counted in Django's cache (Redis, shared by every ASGI server) per username
and per client address, in a fixed window of ``LOGIN_LOCKOUT_SECONDS`` that starts at the
first failure. At ``LOGIN_FAILURE_LIMIT`` failures for a username, or
``LOGIN_IP_FAILURE_LIMIT`` from one address, further attempts are refused before the
password is checked (so a lucky guess in the locked window gains nothing) until the
window ends. A successful login clears its username's count; the address's count runs
out on its own, so one valid account cannot reset a guessing run against the others.
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from rest_framework.request import Request

LOCKED_OUT = "Too many failed sign-in attempts. Wait {minutes} minutes and try again."


def client_ip(request: HttpRequest | Request) -> str:
    """The client's address: from ``CLIENT_IP_HEADER`` when configured (set by the reverse
    proxy), else the socket's. For X-Forwarded-For the last entry is the one our proxy
    appended; earlier ones are whatever the client sent."""
    header = settings.CLIENT_IP_HEADER
    if header:
        value = request.headers.get(header, "")
        last = value.rsplit(",", 1)[-1].strip()
        if last:
            return last
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def _key(kind: str, value: str) -> str:
    # Hashed: usernames and addresses are attacker-chosen text, keys must stay short and plain.
    return f"auth-failures:{kind}:{hashlib.sha256(value.encode()).hexdigest()[:32]}"


def _limits(request: HttpRequest | Request, username: str | None, scope: str) -> list[tuple[str, int]]:
    limits = [(_key(f"{scope}-ip", client_ip(request)), settings.LOGIN_IP_FAILURE_LIMIT)]
    if username:
        limits.append((_key(f"{scope}-user", username.casefold()), settings.LOGIN_FAILURE_LIMIT))
    return limits


def is_blocked(request: HttpRequest | Request, username: str | None = None, scope: str = "login") -> bool:
    limits = _limits(request, username, scope)
    counts = cache.get_many([key for key, _ in limits])
    return any(counts.get(key, 0) >= limit for key, limit in limits)


def record_failure(request: HttpRequest | Request, username: str | None = None, scope: str = "login") -> None:
    for key, _ in _limits(request, username, scope):
        # add() starts the window (no-op when it runs); incr() is atomic in Redis and keeps the TTL.
        cache.add(key, 0, timeout=settings.LOGIN_LOCKOUT_SECONDS)
        try:
            cache.incr(key)
        except ValueError:  # expired between add() and incr(): this failure opens a new window
            cache.add(key, 1, timeout=settings.LOGIN_LOCKOUT_SECONDS)


def clear_username(username: str, scope: str = "login") -> None:
    cache.delete(_key(f"{scope}-user", username.casefold()))


def lockout_message() -> str:
    return LOCKED_OUT.format(minutes=max(1, round(settings.LOGIN_LOCKOUT_SECONDS / 60)))


class ThrottledAuthenticationForm(AuthenticationForm):
    """Refuses before authenticate() while locked out; counts each refusal of credentials."""

    def clean(self) -> dict[str, Any]:
        request = self.request
        username = str(self.cleaned_data.get("username") or "")
        if request is None:  # built outside a request (never by the login views)
            return super().clean()
        if is_blocked(request, username):
            raise ValidationError(lockout_message(), code="throttled")
        try:
            return super().clean()
        except ValidationError:
            if username and self.cleaned_data.get("password"):
                record_failure(request, username)
            raise


class ThrottledAdminAuthenticationForm(ThrottledAuthenticationForm, AdminAuthenticationForm):
    """The admin's sign-in form (staff only) with the same throttle."""


class ThrottledLoginView(LoginView):
    """The portal's sign-in page: 429 with the form's error while locked out."""

    form_class = ThrottledAuthenticationForm

    def form_valid(self, form: AuthenticationForm) -> HttpResponse:
        clear_username(form.cleaned_data["username"])
        return super().form_valid(form)

    def form_invalid(self, form: AuthenticationForm) -> HttpResponse:
        response = super().form_invalid(form)
        if form.has_error("__all__", code="throttled"):
            response.status_code = 429
            response["Retry-After"] = str(settings.LOGIN_LOCKOUT_SECONDS)
        return response
