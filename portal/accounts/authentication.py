"""DRF authentication by hashed API token: ``Authorization: Bearer gps_...``."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

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
        token = ApiToken.find(key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked API token.")
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'
