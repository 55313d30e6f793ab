"""One permission path per resource, shared by HTML views, the API and WebSocket consumers."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from django.db.models import QuerySet

from portal.accounts.models import Membership, Project


def visible_projects(user: Any) -> QuerySet[Project]:
    if not user.is_authenticated:
        return Project.objects.none()
    if user.is_staff:
        return Project.objects.all()
    return Project.objects.filter(memberships__user=user)


def can_manage_sandbox(user: Any, sandbox: Any) -> bool:
    """Stop/extend: the owner, the project's managers and admins."""
    if not user.is_authenticated:
        return False
    if user.is_staff or sandbox.owner_id == user.pk:
        return True
    return Membership.objects.filter(
        user=user, project_id=sandbox.project_id, role=Membership.Role.MANAGER
    ).exists()


def can_manage_sandbox_by_token(user: Any, sandbox: Any, scopes: Collection[str]) -> bool:
    """``can_manage_sandbox`` for a caller holding an API token with ``scopes`` (the API and
    token-authenticated WebSockets): a staff user's token without the ``admin`` scope has the
    rights of a plain member, so it reaches only their own and their managed projects' sandboxes."""
    if not user.is_staff or "admin" in scopes:
        return can_manage_sandbox(user, sandbox)
    return (
        sandbox.owner_id == user.pk
        or Membership.objects.filter(
            user=user, project_id=sandbox.project_id, role=Membership.Role.MANAGER
        ).exists()
    )


def memberships_among(
    user_ids: Collection[int], project_ids: Collection[int], role: str | None = None
) -> set[tuple[int, int]]:
    """The (user id, project id) pairs with a membership (of ``role`` when given) among these,
    in one query: the bulk form of the membership rules above, for asking about many open
    streams at once (``portal.accounts.streams``)."""
    if not user_ids or not project_ids:
        return set()
    memberships = Membership.objects.filter(user_id__in=set(user_ids), project_id__in=set(project_ids))
    if role is not None:
        memberships = memberships.filter(role=role)
    return set(memberships.values_list("user_id", "project_id"))
