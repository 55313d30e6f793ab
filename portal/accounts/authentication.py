"""DRF authentication by hashed API token: ``Authorization: Bearer gps_...``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from portal.accounts import throttle
from portal.accounts.models import ApiToken


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keywords = ("bearer", "token")

    def authenticate(self, request: Request) -> tuple[Any, ApiToken] | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].decode(errors="replace").lower() not in self.keywords:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'.")
        key = header[1].decode(errors="replace")
        # Checked before the lookup, so guessing on from a blocked address learns nothing.
        if throttle.is_blocked(request, scope="api-token"):
            raise exceptions.Throttled(settings.LOGIN_LOCKOUT_SECONDS, "Too many invalid API tokens.")
        token = ApiToken.find(key)
        if token is None or not token.user.is_active or token.state == "revoked":
            throttle.record_failure(request, scope="api-token")
            raise exceptions.AuthenticationFailed("Invalid or revoked API token.")
        if token.state == "expired":
            throttle.record_failure(request, scope="api-token")
            when = token.expires_at.strftime("%Y-%m-%d %H:%M UTC") if token.expires_at else ""
            raise exceptions.AuthenticationFailed(f"This API token expired on {when}: make a new one.")
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'


class ApiTokenScheme(OpenApiAuthenticationExtension):
    """Describes the token to drf-spectacular (and so to Swagger UI's Authorize button)."""

    target_class = ApiTokenAuthentication
    name = "tokenAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "gps_...",
            "description": "An API token: its scopes are read:usage, write:sandboxes and admin.",
        }
