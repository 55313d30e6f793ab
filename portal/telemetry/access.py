"""Who may watch what: one rule per stream, shared by the WebSocket consumers and the
history/alert endpoints so a chart's history and its live samples are never granted apart."""

from __future__ import annotations

from typing import Any

from django.db.models import Q

from portal.accounts.access import visible_projects
from portal.sandboxes.models import Allocation, Sandbox


def may_watch_sandbox(user: Any, sandbox_id: int | str) -> bool:
    """Members of the sandbox's project and admins."""
    if user is None or not user.is_authenticated:
        return False
    return Sandbox.objects.filter(pk=sandbox_id, project__in=visible_projects(user)).exists()


def may_watch_gpu(user: Any, uuid: str) -> bool:
    """Admins; a member while a sandbox of one of their projects holds the GPU or one of its
    MIG devices (the GPU's figures say nothing about other projects' work beyond that)."""
    if user is None or not user.is_authenticated:
        return False
    if user.is_staff:
        return True
    return Allocation.objects.filter(
        Q(device_uuid=uuid) | Q(gpu__uuid=uuid),
        active=True,
        sandbox__project__in=visible_projects(user),
    ).exists()


def sandboxes_seen_on_gpu(user: Any, uuid: str) -> set[int] | None:
    """The sandboxes on this GPU (or its MIG devices) whose own figures ``user`` may see: those
    of their projects. None for admins, who see every tenant's."""
    if user.is_staff:
        return None
    return set(
        Allocation.objects.filter(
            Q(device_uuid=uuid) | Q(gpu__uuid=uuid), active=True, sandbox__project__in=visible_projects(user)
        ).values_list("sandbox_id", flat=True)
    )


def may_watch_fleet(user: Any) -> bool:
    return user is not None and user.is_authenticated and user.is_staff
