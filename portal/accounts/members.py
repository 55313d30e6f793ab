"""Project membership changes, as ``check``-free ``do_*`` functions that say what is wrong.

Project managers (and admins) add people by username, change their role and remove them.
A project always keeps at least one manager, so nobody locks a project out of its own
administration. Every change is in the audit log (``Membership`` is watched by
``portal.audit.trail``).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from portal.accounts.models import Membership, Project


class MembershipError(Exception):
    """A membership change that cannot be made; the message says why."""


def can_manage_members(user: Any, project: Project) -> bool:
    if not user.is_authenticated:
        return False
    return (
        bool(user.is_staff)
        or Membership.objects.filter(user=user, project=project, role=Membership.Role.MANAGER).exists()
    )


def _last_manager(membership: Membership) -> bool:
    others = Membership.objects.filter(project_id=membership.project_id, role=Membership.Role.MANAGER)
    return membership.role == Membership.Role.MANAGER and not others.exclude(pk=membership.pk).exists()


def do_add_member(project: Project, username: str, role: str) -> Membership:
    if role not in Membership.Role.values:
        raise MembershipError(f"Unknown role {role!r}.")
    user = get_user_model().objects.filter(username=username.strip()).first()
    if user is None:
        raise MembershipError(f"No user is called {username.strip()!r}.")
    with transaction.atomic():
        if Membership.objects.filter(project=project, user=user).exists():
            raise MembershipError(f"{user.get_username()} is already in {project.name}.")
        return Membership.objects.create(project=project, user=user, role=role)


def do_change_role(project: Project, membership_id: int, role: str) -> Membership:
    if role not in Membership.Role.values:
        raise MembershipError(f"Unknown role {role!r}.")
    with transaction.atomic():
        membership = Membership.objects.select_for_update().filter(pk=membership_id, project=project).first()
        if membership is None:
            raise MembershipError("No such member.")
        if role != Membership.Role.MANAGER and _last_manager(membership):
            raise MembershipError(f"{membership.user.get_username()} is the project's last manager.")
        membership.role = role
        membership.save(update_fields=["role"])
        return membership


MAX_MEMBER_GPUS = 1000


def do_set_member_limit(project: Project, membership_id: int, max_gpus: int | None) -> Membership:
    """Cap what one member's sandboxes in the project hold or wait for, in whole-GPU
    equivalents (None: no cap of their own). Sandboxes already running are left alone."""
    if max_gpus is not None and not 0 <= max_gpus <= MAX_MEMBER_GPUS:
        raise MembershipError(f"A member's GPU limit is 0 to {MAX_MEMBER_GPUS}, or empty for none.")
    with transaction.atomic():
        membership = Membership.objects.select_for_update().filter(pk=membership_id, project=project).first()
        if membership is None:
            raise MembershipError("No such member.")
        membership.max_gpus = max_gpus
        membership.save(update_fields=["max_gpus"])
        return membership


def do_remove_member(project: Project, membership_id: int) -> None:
    with transaction.atomic():
        membership = Membership.objects.select_for_update().filter(pk=membership_id, project=project).first()
        if membership is None:
            raise MembershipError("No such member.")
        if _last_manager(membership):
            raise MembershipError(f"{membership.user.get_username()} is the project's last manager.")
        membership.delete()
