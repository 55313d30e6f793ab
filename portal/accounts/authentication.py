"""DRF authentication by hashed API token: ``Authorization: Bearer gps_...``, checked by
``tokens.check_api_token`` as token WebSockets are."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from portal.accounts import tokens
from portal.accounts.models import ApiToken


class LockedOut(exceptions.Throttled):
    """429 with the token check's reason, which says how long already (DRF would add its own
    "Expected available in ..." to it); Retry-After still tells a client in seconds."""

    def __init__(self, reason: str) -> None:
        super().__init__(detail=reason)
        self.wait: float | None = settings.LOGIN_LOCKOUT_SECONDS


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keywords = ("bearer", "token")

    def authenticate(self, request: Request) -> tuple[Any, ApiToken] | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].decode(errors="replace").lower() not in self.keywords:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'.")
        verdict = tokens.check_api_token(header[1].decode(errors="replace"), request)
        if isinstance(verdict, tokens.TokenRefusal) and verdict.throttled:
            raise LockedOut(verdict.reason)
        if isinstance(verdict, tokens.TokenRefusal):
            raise exceptions.AuthenticationFailed(verdict.reason)
        return verdict.user, verdict

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
