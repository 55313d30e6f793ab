"""What the test provider says about a user: the standard profile claims and ``groups``
(the names of the user's Django groups here), as institutional providers send them."""

from typing import Any

from oidc_provider.lib.claims import ScopeClaims


def userinfo(claims: dict[str, Any], user: Any) -> dict[str, Any]:
    claims.update(
        preferred_username=user.username,
        given_name=user.first_name,
        family_name=user.last_name,
        email=user.email,
        email_verified=True,
    )
    return claims


class GroupsScope(ScopeClaims):
    def scope_groups(self) -> dict[str, Any]:
        return {"groups": sorted(self.user.groups.values_list("name", flat=True))}
