"""The openb cluster in the portal's database, as the control worker would find it.

1,213 hosts (the trace's GPU nodes, 6,212 GPUs), filled by the default trace (seed 42)
to arrived 100 % as the product's policy places it, with one running sandbox, its
allocations and its open usage interval per placed pod; then the next 1,000 of the
trace's pods as queued requests. Written in bulk: seconds, not the hours that thousands
of ``do_request_sandbox``/``do_place`` calls would take.

Every GPU follows demand, as agents report them; the trace's CPU-only pods are CPU-only
sandboxes (no allocation, their host's CPU and memory). A pod's CPU and memory come from
its tier in the portal, so each (mode, CPU, memory) the trace uses gets a tier of its own.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from portal.accounts.models import Membership, Project
from portal.billing.models import UsageRecord
from portal.catalog.models import PriorityClass, SandboxImage, SharingMode, Tier
from portal.fleet.models import Gpu, GpuMode, Host
from portal.sandboxes.models import Allocation, Sandbox
from scheduler.cluster import Place
from scheduler.gpus import CATALOG
from scheduler.placement import DEFAULT_POLICY, get_policy
from scheduler.research.bench_trace import TRACES
from scheduler.research.live_replay import mirror_snapshot, pod_request, replay_offline_on
from scheduler.research.trace import PodSpec, build_workload, load_nodes, load_pods
from tests.factories import UserFactory

# What an openb bench module marks itself with: a bench, committed data, PostgreSQL only.
OPENB_BENCH = [
    pytest.mark.bench,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql",
        reason="measured on PostgreSQL, as deployed at this size",
    ),
]
WRITES = ("INSERT", "UPDATE", "DELETE")  # the statements a bench counts as writes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


SEED, TUNE = 42, 1.3
PENDING = 1000
PROJECTS, USERS = 20, 60
MAX_DURATION = timedelta(hours=8)


@dataclass
class Seeded:
    hosts: int = 0
    gpus: int = 0
    running: int = 0
    queued: list[int] = field(default_factory=list)  # sandbox ids, oldest first
    cpu_only: int = 0  # running CPU-only sandboxes
    failed: int = 0  # pods the replay could not place before arrived 100 %
    users: list[Any] = field(default_factory=list)
    # Queues the trace's next ``n`` pods as new requests (for cycles with arrivals): their ids.
    enqueue: Callable[[int], list[int]] = lambda n: []


def _cpu_only(pod: PodSpec) -> bool:
    return not (pod.num_gpu and pod.gpu_milli)


def seed_openb(pending: int = PENDING) -> Seeded:
    nodes = load_nodes(TRACES / "openb_node_list_gpu_node.csv")
    workload = build_workload(nodes, load_pods(TRACES / "openb_pod_list_default.csv"), SEED, TUNE)
    pods = workload.pods
    arrived, fill = 0, 0
    while fill < len(pods) and arrived < workload.capacity_milli:
        arrived += pods[fill].total_gpu_milli
        fill += 1
    placements: list[tuple[PodSpec, Place]] = []
    snapshot = mirror_snapshot(workload.nodes)

    def record(pod: PodSpec, place: Place | None, _seconds: float) -> None:
        if place is not None:
            placements.append((pod, place))

    replay_offline_on(snapshot, get_policy(DEFAULT_POLICY), pods[:fill], record)
    seeded = Seeded(failed=fill - len(placements))
    seeded.cpu_only = sum(1 for pod, _ in placements if _cpu_only(pod))

    Host.objects.bulk_create(
        Host(
            name=n.name, backend="simulated", driver="docker", cpu_cores=n.cpu_milli // 1000,
            memory_mib=n.memory_mib, last_heartbeat_at=timezone.now(),
        )
        for n in workload.nodes
    )  # fmt: skip
    host_ids = dict(Host.objects.values_list("name", "pk"))
    gpu_rows = [
        Gpu(
            host_id=host_ids[h.name], index=g.index, uuid=g.uuid, name=f"openb {g.model}", model=g.model,
            memory_mib=CATALOG[g.model].memory_mib,
            sharing_mode=GpuMode.AUTO,
        )
        for h in snapshot.hosts
        for g in h.gpus
    ]  # fmt: skip
    Gpu.objects.bulk_create(gpu_rows, batch_size=2000)
    gpu_ids = dict(Gpu.objects.values_list("uuid", "pk"))
    seeded.hosts, seeded.gpus = len(host_ids), len(gpu_ids)

    projects = Project.objects.bulk_create(
        Project(name=f"Trace team {i}", slug=f"trace-{i}") for i in range(PROJECTS)
    )
    users: list[Any] = [UserFactory(username=f"trace{i}") for i in range(USERS)]
    Membership.objects.bulk_create(
        Membership(user=u, project=projects[i % PROJECTS], role=Membership.Role.MANAGER)
        for i, u in enumerate(users)
    )
    seeded.users = users
    image, _ = SandboxImage.objects.get_or_create(
        name="busybox", defaults={"reference": "gpushare/sandbox-base:1", "command": ["sleep", "infinity"]}
    )
    priority, _ = PriorityClass.objects.get_or_create(name="standard", defaults={"value": 100})
    tiers: dict[tuple[str, int, int], Tier] = {}

    def tier_for(pod: PodSpec) -> Tier:
        mode = SharingMode.MPS if pod.sharing else SharingMode.DEDICATED
        if _cpu_only(pod):
            mode = SharingMode.CPU
        key = (str(mode), pod.cpu_milli, pod.memory_mib)
        if key not in tiers:
            tiers[key] = Tier.objects.create(
                name=f"trace {mode} {pod.cpu_milli}m {pod.memory_mib}MiB",
                slug=f"trace-{mode}-{pod.cpu_milli}-{pod.memory_mib}",
                sharing_mode=mode, isolation_levels=["container"], price_per_gpu_hour_micros=1_000_000,
                priority_class=priority, max_duration=MAX_DURATION, max_gpus=8,
                cpu_limit=pod.cpu_milli / 1000, memory_limit_mib=pod.memory_mib,
            )  # fmt: skip
        return tiers[key]

    rng = random.Random(SEED)
    now = timezone.now()

    def sandbox(seq: int, pod: PodSpec, host: str = "", waited_s: float = 0.0) -> Sandbox:
        request = pod_request(seq, pod)
        started = now - timedelta(seconds=rng.uniform(60, MAX_DURATION.total_seconds() - 600))
        user = users[seq % USERS]
        return Sandbox(
            project=projects[(seq % USERS) % PROJECTS], owner=user, tier=tier_for(pod), image=image,
            isolation="container", gpu_count=request.gpu_count, mps_thread_pct=request.mps_thread_pct,
            max_duration=MAX_DURATION, state="running" if host else "queued",
            host_id=host_ids[host] if host else None, allocation_key=uuid.uuid4().hex if host else "",
            requested_at=started - timedelta(seconds=5) if host else now - timedelta(seconds=waited_s),
            placed_at=started if host else None, started_at=started if host else None,
            handle={"driver": "docker", "ref": f"trace-{seq}"} if host else None,
        )  # fmt: skip

    running = Sandbox.objects.bulk_create(
        (sandbox(seq, pod, place.host) for seq, (pod, place) in enumerate(placements)), batch_size=2000
    )
    allocations, usage = [], []
    for row, (_pod, place) in zip(running, placements, strict=True):
        for grant in place.grants:
            allocations.append(
                Allocation(
                    sandbox=row, gpu_id=gpu_ids[grant.gpu_uuid], kind=grant.kind,
                    device_uuid=grant.device_uuid, milli_gpu=grant.milli_gpu,
                    mps_thread_pct=grant.mps_thread_pct, created_at=row.placed_at or now,
                )
            )  # fmt: skip
        assert row.started_at is not None
        usage.append(
            UsageRecord(
                sandbox=row, allocation_key=row.allocation_key, project_id=row.project_id,
                user_id=row.owner_id, tier=row.tier, gpu_model="trace",
                milli_gpu=sum(g.milli_gpu for g in place.grants),
                billed_milli=1000 if not place.grants else None,  # CPU-only: per sandbox-hour
                price_per_gpu_hour_micros=1_000_000, currency="EUR", started_at=row.started_at,
            )
        )  # fmt: skip
    Allocation.objects.bulk_create(allocations, batch_size=2000)
    UsageRecord.objects.bulk_create(usage, batch_size=2000)
    seeded.running = len(running)

    later = iter(pods[fill:])
    sequence = itertools.count(len(placements))

    def enqueue(count: int, waited_s: float = 0.0) -> list[int]:
        """The trace's next ``count`` pods as queued requests, the first ``waited_s`` ago."""
        rows = [
            sandbox(next(sequence), pod, waited_s=waited_s * (1 - i / count))
            for i, pod in enumerate(itertools.islice(later, count))
        ]
        return [row.pk for row in Sandbox.objects.bulk_create(rows)]

    seeded.queued = enqueue(pending, waited_s=pending)
    seeded.enqueue = enqueue
    if connection.vendor == "postgresql":
        # Statistics, as autovacuum gathers them soon after a bulk load, and the load's WAL
        # written out: otherwise the first cycle's time depended on whether autovacuum or a
        # checkpoint happened to run beside it (1.4-1.6 s between identical runs).
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
            cursor.execute("CHECKPOINT")
    return seeded
