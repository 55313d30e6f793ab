"""A fleet and a history at the scale the portal's page budgets are measured at:
200 GPUs on 25 hosts and 1,000 sandboxes (running, queued and ended), with their
allocations, events, usage and notifications. Written in bulk: seconds, not minutes."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from django.utils import timezone

from portal.accounts.models import Membership
from portal.billing.models import UsageRecord
from portal.fleet.inventory import do_sync_inventory
from portal.fleet.models import Gpu
from portal.sandboxes.models import Allocation, Notification, Sandbox, SandboxEvent
from tests.factories import MembershipFactory, ProjectFactory, UserFactory
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

HOSTS, GPUS_PER_HOST, SANDBOXES = 25, 8, 1000


def seed_scale(people: dict[str, Any], catalog: dict[str, Any]) -> dict[str, Any]:
    for h in range(HOSTS):
        name = f"node{h:02d}"
        infos = SimulatedBackend(name, parse_sim_spec(f"H100-80GB:{GPUS_PER_HOST}")).list_gpus()
        do_sync_inventory(name, "simulated", "docker", [g.to_json() for g in infos])
    projects = [people["project"]] + [ProjectFactory(slug=f"team-{i}") for i in range(4)]
    users = [people["owner"]] + [UserFactory(username=f"scale{i}") for i in range(19)]
    for i, user in enumerate(users[1:], start=1):
        MembershipFactory(user=user, project=projects[i % len(projects)], role=Membership.Role.MEMBER)
    gpus = list(Gpu.objects.select_related("host").order_by("host__name", "index"))
    now = timezone.now()
    tier, image = catalog["dedicated"], catalog["image"]
    rows = []
    for i in range(SANDBOXES):
        state = "running" if i < 150 else "queued" if i < 200 else "stopped"
        started = now - timedelta(minutes=30 + i % 60)
        rows.append(
            Sandbox(
                project=projects[i % len(projects)],
                owner=users[i % len(users)],
                tier=tier,
                image=image,
                isolation="container",
                max_duration=timedelta(hours=8),
                state=state,
                host=gpus[i].host if state == "running" else None,
                allocation_key=uuid.uuid4().hex if state != "queued" else "",
                pending_reason="waiting for 1 free GPU on one host" if state == "queued" else "",
                requested_at=started - timedelta(minutes=1),
                placed_at=started if state != "queued" else None,
                started_at=started if state != "queued" else None,
                ended_at=now - timedelta(minutes=5) if state == "stopped" else None,
                handle={"driver": "docker", "ref": f"c{i}"} if state == "running" else None,
            )
        )
    sandboxes = Sandbox.objects.bulk_create(rows)
    allocations, events, usage, notes = [], [], [], []
    for i, sandbox in enumerate(sandboxes):
        events.append(SandboxEvent(sandbox=sandbox, to_state="requested", message="requested 1 GPU"))
        events.append(SandboxEvent(sandbox=sandbox, from_state="requested", to_state="queued"))
        if sandbox.state == "queued":
            continue
        gpu = gpus[i % len(gpus)]
        live = sandbox.state == "running"
        allocations.append(
            Allocation(
                sandbox=sandbox, gpu=gpu, kind="exclusive", device_uuid=gpu.uuid, milli_gpu=1000, active=live,
                released_at=None if live else sandbox.ended_at,
            )
        )  # fmt: skip
        for to in ("placing", "starting", "running") + (() if live else ("stopping", "stopped")):
            events.append(SandboxEvent(sandbox=sandbox, to_state=to, message=f"{to} on {gpu.host.name}"))
        assert sandbox.started_at is not None
        usage.append(
            UsageRecord(
                sandbox=sandbox, allocation_key=sandbox.allocation_key, project_id=sandbox.project_id,
                user_id=sandbox.owner_id, tier=tier, gpu_model="H100-80GB", milli_gpu=1000,
                price_per_gpu_hour_micros=tier.price_per_gpu_hour_micros, currency="EUR",
                started_at=sandbox.started_at, ended_at=sandbox.ended_at,
                duration=(sandbox.ended_at - sandbox.started_at) if sandbox.ended_at else None,
                cost_micros=1000 if sandbox.ended_at else None,
            )
        )  # fmt: skip
        notes.append(Notification(user=sandbox.owner, sandbox=sandbox, kind="started", message="started"))
    Allocation.objects.bulk_create(allocations)
    SandboxEvent.objects.bulk_create(events)
    UsageRecord.objects.bulk_create(usage)
    Notification.objects.bulk_create(notes)
    return {"sandbox": sandboxes[0], "gpu": gpus[0]}
