"""Who may watch what: one rule per stream, shared by the WebSocket consumers and the
history/alert endpoints so a chart's history and its live samples are never granted apart."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from django.db.models import Q

from portal.accounts.access import memberships_among, visible_projects
from portal.fleet.models import Gpu, Host
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


# The same rules for many open streams at once (portal/accounts/streams.py asks them for every
# open socket each period): a fixed number of queries whatever the number of (user, object)
# pairs. Users come from ``streams.current_users``: signed in and active.


def watchable_sandboxes(asks: Sequence[tuple[Any, int]]) -> list[bool]:
    """``may_watch_sandbox`` for each (user, sandbox id), in two queries."""
    project_of = dict(Sandbox.objects.filter(pk__in={pk for _, pk in asks}).values_list("pk", "project_id"))
    members = memberships_among({user.pk for user, _ in asks if not user.is_staff}, set(project_of.values()))
    return [pk in project_of and (user.is_staff or (user.pk, project_of[pk]) in members) for user, pk in asks]


def sandboxes_seen_on_gpus(asks: Sequence[tuple[Any, str]]) -> list[frozenset[int] | None]:
    """``sandboxes_seen_on_gpu`` for each (user, GPU uuid), in two queries: None for admins
    (every tenant's), else the sandboxes of theirs on it, and an empty set means they may no
    longer watch it (``may_watch_gpu``: a sandbox of their projects must hold it)."""
    uuids = {uuid for user, uuid in asks if not user.is_staff}
    holders: dict[str, set[tuple[int, int]]] = {}  # uuid -> {(sandbox id, project id)}
    if uuids:
        allocations = Allocation.objects.filter(
            Q(device_uuid__in=uuids) | Q(gpu__uuid__in=uuids), active=True
        )
        for device, gpu, sandbox, project in allocations.values_list(
            "device_uuid", "gpu__uuid", "sandbox_id", "sandbox__project_id"
        ):
            for uuid in {device, gpu} & uuids:
                holders.setdefault(uuid, set()).add((sandbox, project))
    members = memberships_among(
        {user.pk for user, _ in asks if not user.is_staff},
        {project for held in holders.values() for _, project in held},
    )
    return [
        None
        if user.is_staff
        else frozenset(sandbox for sandbox, project in holders.get(uuid, ()) if (user.pk, project) in members)
        for user, uuid in asks
    ]


# Which host's agent publishes what a stream shows (wire.telemetry names its groups by host).


def hosts_of_sandboxes(ids: Collection[int]) -> dict[int, str]:
    """The host each placed sandbox is on, in one query."""
    placed = Sandbox.objects.filter(pk__in=set(ids), host__isnull=False)
    return dict(placed.values_list("pk", "host__name"))


def hosts_of_devices(uuids: Collection[str]) -> dict[str, str]:
    """The host of each GPU or MIG device, by its uuid, in one query."""
    wanted = set(uuids)
    rows = Gpu.objects.filter(Q(uuid__in=wanted) | Q(mig_instances__uuid__in=wanted)).values_list(
        "uuid", "mig_instances__uuid", "host__name"
    )
    hosts: dict[str, str] = {}
    for gpu, mig, host in rows:
        for uuid in (gpu, mig):
            if uuid in wanted:
                hosts[uuid] = host
    return hosts


def fleet_hosts() -> list[str]:
    return list(Host.objects.values_list("name", flat=True))
