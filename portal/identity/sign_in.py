"""A sign-in through an identity provider, whichever protocol brought it: the user found by
the provider's subject (made at the first sign-in), their details refreshed, and the group
rules applied to their project memberships.

``apply_group_rules`` is the one place groups become memberships. For each project the
provider's groups reach (the highest role when several rules reach one), a membership the
rules made earlier has its role set, a missing one is made and marked as the rules';
memberships the rules made earlier that no group reaches any more are removed. A membership
a project manager added by hand is left as it is: the rules neither change nor remove it.
Every change is in the audit log, under the user who signed in.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from portal.accounts.models import Membership
from portal.audit import trail
from portal.identity.models import ExternalIdentity, GroupRule, MappedMembership

log = logging.getLogger(__name__)

# The highest role wins when several of a user's groups reach one project.
_RANK = {Membership.Role.BILLING: 0, Membership.Role.MEMBER: 1, Membership.Role.MANAGER: 2}
_NOT_IN_USERNAMES = re.compile(r"[^\w.@+-]")


@dataclass
class Profile:
    """What a provider says about a user at sign-in."""

    source: str
    subject: str
    username: str  # a wish: the portal's username may differ when this one is taken
    email: str = ""
    first_name: str = ""
    last_name: str = ""
    groups: list[str] = field(default_factory=list)


@dataclass
class MembershipChanges:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def free_username(wish: str, source: str) -> str:
    """``wish`` when nobody has it, else ``wish-<source>``, ``wish-<source>-2``...: a
    provider's user never takes over a local account that happens to share their name."""
    base = _NOT_IN_USERNAMES.sub("", wish)[:120] or source
    users = get_user_model().objects
    candidates = [base, f"{base}-{source}", *(f"{base}-{source}-{n}" for n in range(2, 1000))]
    for name in candidates:
        if not users.filter(username__iexact=name).exists():
            return name
    raise ValueError(f"no free username for {wish!r}")


def roles_for(source: str, groups: list[str]) -> dict[int, str]:
    """Project id → role that ``groups`` at ``source`` give, by the active rules."""
    wanted: dict[int, str] = {}
    rules = GroupRule.objects.filter(source=source, group__in=groups, active=True)
    for project_id, role in rules.values_list("project_id", "role"):
        if (
            project_id not in wanted
            or _RANK[Membership.Role(role)] > _RANK[Membership.Role(wanted[project_id])]
        ):
            wanted[project_id] = role
    return wanted


def apply_group_rules(user: Any, source: str, groups: list[str]) -> MembershipChanges:
    changes = MembershipChanges()
    with transaction.atomic():
        wanted = roles_for(source, groups)
        held = {
            m.project_id: m for m in Membership.objects.filter(user=user).select_related("project", "mapping")
        }
        for project_id, role in wanted.items():
            membership = held.get(project_id)
            if membership is None:
                membership = Membership.objects.create(user=user, project_id=project_id, role=role)
                MappedMembership.objects.create(membership=membership, source=source)
                changes.added.append(f"{membership.project.name} ({role})")
                continue
            mapping = getattr(membership, "mapping", None)
            if mapping is not None and mapping.source == source and membership.role != role:
                membership.role = role
                membership.save(update_fields=["role"])
                changes.changed.append(f"{membership.project.name} ({role})")
        for project_id, membership in held.items():
            mapping = getattr(membership, "mapping", None)
            if project_id not in wanted and mapping is not None and mapping.source == source:
                changes.removed.append(membership.project.name)
                membership.delete()
        if changes:
            trail.record(
                user,
                "identity.groups_applied",
                user,
                None,
                {"source": source, "groups": groups, **changes.__dict__},
                f"{user.get_username()} signed in through {source}: "
                + "; ".join(
                    f"{what} {', '.join(names)}"
                    for what, names in (("added to", changes.added), ("now", changes.changed),
                                        ("removed from", changes.removed))
                    if names
                ),
            )  # fmt: skip
    return changes


def known_user(source: str, subject: str) -> Any | None:
    """The user who signed in before as ``subject`` at ``source``, if any."""
    identity = ExternalIdentity.objects.select_related("user").filter(source=source, subject=subject).first()
    return identity.user if identity is not None else None


def sign_in(profile: Profile) -> Any | None:
    """The portal user for ``profile`` (made at the first sign-in), with their details and
    memberships brought up to date; None for a user an admin deactivated."""
    with transaction.atomic():
        user = known_user(profile.source, profile.subject)
        if user is None:
            user = get_user_model()(username=free_username(profile.username, profile.source))
            user.set_unusable_password()  # signs in through the provider only
            user.save()
        return signed_in(user, profile)


def signed_in(user: Any, profile: Profile) -> Any | None:
    """Record ``user``'s sign-in as ``profile``: their identity (made the first time), the
    details the provider gave, their groups, and the memberships the rules make of them.
    None (nothing recorded) for a user an admin deactivated."""
    if not user.is_active:
        log.warning("%s sign-in refused: %s is deactivated", profile.source, user)
        return None
    with transaction.atomic():
        identity, made = ExternalIdentity.objects.get_or_create(
            source=profile.source, subject=profile.subject, defaults={"user": user}
        )
        if identity.user_id != user.pk:
            raise ValueError(f"{profile.source} subject {profile.subject} belongs to another user")
        if made:
            log.info("%s user %s (%s) signed in for the first time", profile.source, user, profile.subject)
        details = {"email": profile.email, "first_name": profile.first_name, "last_name": profile.last_name}
        changed = [name for name, value in details.items() if value and getattr(user, name) != value]
        for name in changed:
            setattr(user, name, details[name][: user._meta.get_field(name).max_length])
        if changed:
            user.save(update_fields=changed)
        identity.groups = sorted(set(profile.groups))
        identity.signed_in_at = timezone.now()
        identity.save(update_fields=["groups", "signed_in_at"])
        apply_group_rules(user, profile.source, identity.groups)
    return user
