"""Local accounts (a username and a password the portal keeps) for admins only."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.backends import ModelBackend


class StaffOnlyPasswordBackend(ModelBackend):
    """Django's password check for staff accounts only: with ``LOCAL_SIGN_IN=staff`` everyone
    else signs in through the identity provider. (With the default, ``everyone``, Django's
    own ``ModelBackend`` stays in place, so sessions made before single sign-on still hold.)
    Users a provider made have no usable password, so they never pass here either way."""

    def user_can_authenticate(self, user: Any) -> bool:
        return bool(user.is_staff) and super().user_can_authenticate(user)
