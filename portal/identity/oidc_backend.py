"""Sign-in through an OpenID Connect provider (mozilla-django-oidc's authorization-code flow,
with PKCE and a nonce), the user found by the provider's ``sub``.

mozilla-django-oidc matches users by email by default; here the ``sub`` of the ID token
(which the userinfo answer must repeat, as the spec requires) is the identity, the
username is the ``preferred_username`` claim when free, and the groups come from the claim
``OIDC_GROUPS_CLAIM``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from portal.identity.models import Source
from portal.identity.sign_in import Profile, sign_in


def groups_claim(claims: dict[str, Any]) -> list[str]:
    """The groups claim as a list of names: providers send a list, some a lone string."""
    value = claims.get(settings.OIDC_GROUPS_CLAIM, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        return []
    return [str(v) for v in value if isinstance(v, str | int)]


def profile_from_claims(claims: dict[str, Any]) -> Profile:
    email = str(claims.get("email") or "")
    wish = str(claims.get("preferred_username") or email.partition("@")[0] or claims["sub"])
    return Profile(
        source=Source.OIDC,
        subject=str(claims["sub"]),
        username=wish,
        email=email if claims.get("email_verified", True) else "",
        first_name=str(claims.get("given_name") or ""),
        last_name=str(claims.get("family_name") or ""),
        groups=groups_claim(claims),
    )


class PortalOIDCBackend(OIDCAuthenticationBackend):
    def verify_claims(self, claims: dict[str, Any]) -> bool:
        return bool(claims.get("sub"))

    def get_or_create_user(self, access_token: str, id_token: str, payload: dict[str, Any]) -> Any:
        claims = self.get_userinfo(access_token, id_token, payload)
        if not self.verify_claims(claims):
            raise SuspiciousOperation("the provider's userinfo has no sub")
        # A userinfo answer for somebody else than the ID token names is a substitution.
        if str(claims["sub"]) != str(payload.get("sub")):
            raise SuspiciousOperation("the userinfo's sub is not the ID token's")
        return sign_in(profile_from_claims(claims))
