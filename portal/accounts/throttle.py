"""Throttling of password guessing: the login pages and invalid API tokens.

Failures are counted in Django's cache (Redis, shared by every ASGI server) in a fixed window
of ``LOGIN_LOCKOUT_SECONDS`` that starts at the first failure. Refused attempts are refused
before the password is checked, so a lucky guess in a locked window gains nothing. The
address is the socket's, or the client a trusted proxy names (``TRUSTED_PROXIES``, applied
in ``portal.asgi``): a client cannot pick its own with a forged ``X-Forwarded-For``.

Counting by username alone would let anyone lock anyone out: five wrong passwords for a
known name, from anywhere, and its owner could not sign in. So (OWASP's "device cookies"):

- a browser that signed in as a user before carries a signed device cookie for that user;
  its attempts for that user count against that cookie only (``LOGIN_FAILURE_LIMIT``), so
  nobody else's failures lock it, and its own never lock anybody else;
- any other attempt counts against its (username, address) pair (``LOGIN_FAILURE_LIMIT``),
  its address (``LOGIN_IP_FAILURE_LIMIT``, a guessing run over many names), and the
  username as tried from untrusted browsers (``LOGIN_USERNAME_FAILURE_LIMIT``, guessing from
  many addresses), which locks out untrusted browsers only.

A successful login clears its pair's or cookie's count; the other counts run out on their own.
Invalid API tokens count per address.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm, PasswordResetForm
from django.contrib.auth.views import LoginView, PasswordResetView
from django.core import signing
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from rest_framework.request import Request

LOCKED_OUT = "Too many failed sign-in attempts. Wait {minutes} minutes and try again."
DEVICE_COOKIE_AGE = 365 * 24 * 3600
_DEVICE_SALT = "portal.accounts.throttle.device"


def client_ip(request: HttpRequest | Request) -> str:
    """The client's address: the socket's, which ``portal.asgi`` has already replaced with
    the client a trusted proxy names. No header is read here."""
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def _key(kind: str, *values: str) -> str:
    # Hashed: usernames and addresses are attacker-chosen text, keys must stay short and plain.
    digest = hashlib.sha256("\0".join(values).encode()).hexdigest()[:32]
    return f"auth-failures:{kind}:{digest}"


def _device(request: HttpRequest | Request, username: str) -> str | None:
    """The device cookie's id when it was issued to this browser for ``username``."""
    raw = request.COOKIES.get(settings.DEVICE_COOKIE_NAME, "")
    try:
        signed = signing.loads(raw, salt=_DEVICE_SALT, max_age=DEVICE_COOKIE_AGE)
    except signing.BadSignature:
        return None
    if isinstance(signed, dict) and signed.get("user") == username.casefold():
        return str(signed.get("device", ""))
    return None


def _limits(request: HttpRequest | Request, username: str | None, scope: str) -> list[tuple[str, int]]:
    """The counters an attempt is judged by, with their limits."""
    if username and scope == "login" and (device := _device(request, username)):
        return [(_key("device", device), settings.LOGIN_FAILURE_LIMIT)]
    address = client_ip(request)
    per_address = (
        settings.PASSWORD_RESET_LIMIT if scope == "password-reset" else settings.LOGIN_IP_FAILURE_LIMIT
    )
    limits = [(_key(f"{scope}-ip", address), per_address)]
    if username:
        name = username.casefold()
        limits.append((_key(f"{scope}-pair", name, address), settings.LOGIN_FAILURE_LIMIT))
        limits.append((_key(f"{scope}-user", name), settings.LOGIN_USERNAME_FAILURE_LIMIT))
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


def clear_success(request: HttpRequest, username: str) -> None:
    """A signed-in browser starts afresh: its pair's or its cookie's failures are forgotten
    (not its address's nor the username's: those count what others tried)."""
    device = _device(request, username)
    name = username.casefold()
    cache.delete(_key("device", device) if device else _key("login-pair", name, client_ip(request)))


def remember_device(response: HttpResponse, username: str) -> None:
    """Mark the browser that signed in as ``username``: its later attempts are its own."""
    device = secrets.token_hex(12)
    response.set_cookie(
        settings.DEVICE_COOKIE_NAME,  # __Host- over HTTPS, as the session's
        signing.dumps({"user": username.casefold(), "device": device}, salt=_DEVICE_SALT),
        max_age=DEVICE_COOKIE_AGE,
        secure=settings.SESSION_COOKIE_SECURE,
        httponly=True,
        samesite="Lax",
    )


def lockout_minutes() -> int:
    return max(1, round(settings.LOGIN_LOCKOUT_SECONDS / 60))


def lockout_message() -> str:
    return LOCKED_OUT.format(minutes=lockout_minutes())


class ThrottledAuthenticationForm(AuthenticationForm):
    """Refuses before authenticate() while locked out; counts each wrong password. A right
    password refused for another reason (a non-staff user at the admin's sign-in) is no
    guess: counted, five visits to /admin/login/ locked its owner out of /login/."""

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
            # user_cache is set once authenticate() accepted the password, before
            # confirm_login_allowed() refuses the user.
            if username and self.cleaned_data.get("password") and self.user_cache is None:
                record_failure(request, username)
            raise


class ThrottledAdminAuthenticationForm(ThrottledAuthenticationForm, AdminAuthenticationForm):
    """The admin's sign-in form (staff only) with the same throttle."""


class PortalPasswordResetForm(PasswordResetForm):
    """The reset mail's link on ``PORTAL_URL``'s scheme, host and port, never the request's:
    a Host header names any port on the portal's name (ALLOWED_HOSTS ignores ports), and a
    link built from it would send the reset token wherever the asker pointed it. The path
    still comes from ``{% url %}``, which carries the request's script prefix."""

    def save(self, *args: Any, **kwargs: Any) -> None:
        portal = urlsplit(settings.PORTAL_URL)
        kwargs.update(domain_override=portal.netloc, use_https=portal.scheme == "https")
        super().save(*args, **kwargs)


class ThrottledPasswordResetView(PasswordResetView):
    """Django's reset: the same page whether the address is known or not (no account is
    revealed), and at most PASSWORD_RESET_LIMIT mails per client address in the window, so
    the form cannot be used to flood an inbox or probe the mail server."""

    form_class = PortalPasswordResetForm

    def form_valid(self, form: PasswordResetForm) -> HttpResponse:
        if is_blocked(self.request, scope="password-reset"):
            form.add_error(None, "Too many reset requests from here. Wait and try again.")
            response = self.form_invalid(form)
            response.status_code = 429
            return response
        record_failure(self.request, scope="password-reset")  # every request counts
        return super().form_valid(form)


class ThrottledLoginView(LoginView):
    """The portal's sign-in page: 429 with the form's error while locked out."""

    form_class = ThrottledAuthenticationForm

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        """The single sign-on choices the page offers beside the form (README "Single sign-on")."""
        return {
            **super().get_context_data(**kwargs),
            "oidc_enabled": settings.OIDC_ENABLED,
            "oidc_provider_name": settings.OIDC_PROVIDER_NAME,
            "ldap_enabled": settings.LDAP_ENABLED,
            "sso_failed": self.request.GET.get("sso") == "failed",
        }

    def form_valid(self, form: AuthenticationForm) -> HttpResponse:
        username = form.cleaned_data["username"]
        clear_success(self.request, username)
        response = super().form_valid(form)
        remember_device(response, username)
        return response

    def form_invalid(self, form: AuthenticationForm) -> HttpResponse:
        response = super().form_invalid(form)
        if form.has_error("__all__", code="throttled"):
            response.status_code = 429
            response["Retry-After"] = str(settings.LOGIN_LOCKOUT_SECONDS)
        return response
