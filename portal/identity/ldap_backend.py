"""Sign-in with a directory password (django-auth-ldap): the user is searched for under
``LDAP_USER_SEARCH_BASE``, their password checked by binding as them, and their groups read
under ``LDAP_GROUP_SEARCH_BASE`` at every sign-in (no cache: the rules use what the
directory says now).

django-auth-ldap links a directory entry to the portal user of the same username; here it
is linked by its DN (``ExternalIdentity``), so a directory entry that happens to share a
local account's name (``admin``) gets an account of its own instead of that one.
"""

from __future__ import annotations

import logging
from typing import Any

from django.contrib.auth import get_user_model
from django_auth_ldap.backend import LDAPBackend, ldap_error

from portal.identity.models import Source
from portal.identity.sign_in import Profile, free_username, known_user, signed_in

log = logging.getLogger(__name__)


class PortalLDAPBackend(LDAPBackend):
    def get_or_build_user(self, username: str, ldap_user: Any) -> tuple[Any, bool]:
        user = known_user(Source.LDAP, ldap_user.dn.lower())
        if user is not None:
            return user, False
        return get_user_model()(username=free_username(username, Source.LDAP)), True

    def authenticate_ldap_user(self, ldap_user: Any, password: str) -> Any:
        user = super().authenticate_ldap_user(ldap_user, password)
        if user is None:
            return None
        profile = Profile(
            source=Source.LDAP,
            subject=ldap_user.dn.lower(),
            username=user.get_username(),
            groups=sorted(ldap_user.group_names),
        )
        return signed_in(user, profile)


def _log_directory_error(
    sender: Any, context: str, user: Any, request: Any, exception: Exception, **_: Any
) -> None:
    # django-auth-ldap turns a directory it cannot reach into a plain failed sign-in: the
    # operator needs to see why (the server, the bind DN, TLS), the user only "wrong password".
    log.error("LDAP %s failed for %s: %s", context, getattr(user, "username", user) or "?", exception)


def connect_error_log() -> None:
    ldap_error.connect(_log_directory_error, dispatch_uid="gpushare-ldap-error-log")
