"""Local accounts (a username and a password kept by the portal)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.backends import ModelBackend


class LocalAccountBackend(ModelBackend):
    """Django's password check; with ``LOCAL_SIGN_IN=staff`` (everyone else signs in through
    the identity provider) only staff accounts may use it. Users a provider made have no
    usable password, so they never pass here."""

    def user_can_authenticate(self, user: Any) -> bool:
        if settings.LOCAL_SIGN_IN == "staff" and not user.is_staff:
            return False
        return super().user_can_authenticate(user)
