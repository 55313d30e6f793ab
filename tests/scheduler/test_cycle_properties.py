"""Properties of the live cycle over random fleets, running sandboxes, quotas and queues.

Each example is drawn from one seed, so a failure names the seed that reproduces it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cluster import (
    DeviceGrant,
    FairShareState,
    GpuState,
    HostState,
    MigSlot,
    Pending,
    Place,
    Preempt,
    ProjectShare,
    Request,
    Reserve,
    Running,
    Snapshot,
    book,
    release,
)
from scheduler.cycle import run_cycle
from scheduler.gpus import MODELS
from scheduler.placement import get_policy

POLICY = get_policy("first-fit")  # fills the fleet before each property is checked
LIVE_POLICIES = ("first-fit", "gpushare")
H100 = MODELS["H100-80GB"]
MODES = ("dedicated", "mig", "mps", "timeslice")
LAYOUTS = (
    [("3g.40gb", 0), ("3g.40gb", 4)],
    [("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)],
    [("7g.80gb", 0)],
)
NOW = 10_000.0


def random_fleet(rng: random.Random) -> Snapshot:
    snapshot = Snapshot(hosts=[])
    for h in range(rng.randint(1, 3)):
        host = HostState(
            f"h{h}",
            rng.random() > 0.1,
            cpu_milli=rng.choice((0, 4000, 8000, 32000)),  # 0: not tracked
            memory_mib=rng.choice((0, 8192, 65536)),
        )
        for i in range(rng.randint(1, 4)):
            mode = rng.choice(MODES)
            uuid = f"GPU-{h}-{i}"
            layout = rng.choice(LAYOUTS)
            host.gpus.append(
                GpuState(
                    uuid,
                    host.name,
                    i,
                    H100.name,
                    H100.memory_mib,
                    mode,
                    available=rng.random() > 0.1,
                    mig=[MigSlot(f"MIG-{h}-{i}-{s}", p, s, H100.profile(p).memory_slices) for p, s in layout]
                    if mode == "mig"
                    else [],
                    replicas=rng.randint(2, 4) if mode == "timeslice" else 0,
                )
            )
        snapshot.hosts.append(host)
    return snapshot


def random_request(rng: random.Random, id: int, at: float) -> Request:
    return Request(
        id=id,
        project=rng.choice("abc"),
        priority=rng.choice((50, 100, 200)),
        submitted_at=at,
        mode=rng.choice(MODES),
        gpu_count=rng.choice((1, 1, 2, 3)),
        mig_profile=rng.choice(("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb")),
        mps_memory_mib=rng.choice((10000, 30000, 50000)),
        mps_thread_pct=rng.choice((10, 30, 60)),
        max_duration_s=rng.choice((0.0, 600.0, 3600.0, 7200.0)),
        cpu_milli=rng.choice((0, 1000, 2000, 4000)),
        memory_mib=rng.choice((0, 1024, 4096)),
    )


def random_cluster(seed: int) -> tuple[Snapshot, list[Request], FairShareState | None]:
    """A fleet partly filled by running sandboxes, a queue, and maybe shares and quotas."""
    rng = random.Random(seed)
    snapshot = random_fleet(rng)
    fill = [random_request(rng, 1000 + i, 0.0) for i in range(rng.randint(0, 12))]
    gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    for d in run_cycle(snapshot, fill, POLICY, 0.0):
        if isinstance(d, Place):
            r = next(f for f in fill if f.id == d.request_id)
            for g in d.grants:
                book(gpus[g.gpu_uuid], g)
            next(h for h in snapshot.hosts if h.name == d.host).take(r.cpu_milli, r.memory_mib)
            ends = rng.choice((None, NOW + rng.uniform(0, 7200)))
            snapshot.running.append(
                Running(
                    r.id,
                    r.project,
                    d.host,
                    d.grants,
                    priority=r.priority,
                    started_at=rng.uniform(0, NOW),
                    ends_at=ends,
                    preemptible=rng.random() < 0.5,
                    borrowed=rng.random() < 0.3,
                    cpu_milli=r.cpu_milli,
                    memory_mib=r.memory_mib,
                )
            )
    queue = [random_request(rng, i, rng.uniform(0, NOW)) for i in range(rng.randint(1, 15))]
    fairshare = None
    if rng.random() < 0.7:
        fairshare = FairShareState(
            {
                p: ProjectShare(
                    weight=rng.choice((1.0, 2.0, 3.0)),
                    guaranteed_milli=rng.choice((None, 0, 1000, 3000)),
                    limit_milli=rng.choice((None, 2000, 6000)),
                    usage_gpu_s=rng.uniform(0, 1e5),
                )
                for p in "abc"
            },
            half_life_s=3600.0,
            usage_at=NOW - 300,
        )
    return snapshot, queue, fairshare


def takes(gpu: GpuState, grant: DeviceGrant) -> bool:
    """Whether ``grant`` is free to take on ``gpu`` as it stands."""
    if not gpu.available:
        return False
    if grant.kind == "exclusive":
        return gpu.mode == "dedicated" and gpu.idle
    if grant.kind == "mig":
        return gpu.mode == "mig" and any(s.uuid == grant.mig_uuid and not s.busy for s in gpu.mig)
    if grant.kind == "mps":
        return (
            gpu.mode == "mps"
            and gpu.mps_used_mib + grant.mps_memory_mib <= gpu.memory_mib
            and gpu.mps_used_threads + grant.mps_thread_pct <= 100
        )
    return gpu.mode == "timeslice" and grant.replica in set(range(gpu.replicas)) - gpu.replicas_used


def no_mig_overlap(gpu: GpuState) -> bool:
    slices = [i for s in gpu.mig if s.busy for i in range(s.start, s.start + s.memory_slices)]
    return len(slices) == len(set(slices))


def replay(
    snapshot: Snapshot, queue: list[Request], decisions: Sequence[object]
) -> tuple[Snapshot, list[Running]]:
    """Commit the decisions in order, checking each placement against what is free then."""
    state = snapshot.copy()
    gpus = {g.uuid: g for h in state.hosts for g in h.gpus}
    hosts = {h.name: h for h in state.hosts}
    running = {r.sandbox_id: r for r in state.running}
    by_id = {r.id: r for r in queue}
    for d in decisions:
        if isinstance(d, Preempt):
            victim = running.pop(d.sandbox_id)
            assert victim.preemptible or victim.borrowed, d
            for g in victim.grants:
                release(gpus[g.gpu_uuid], g)
            hosts[victim.host].take(victim.cpu_milli, victim.memory_mib, -1)
        elif isinstance(d, Place):
            assert hosts[d.host].up
            for g in d.grants:
                gpu = gpus[g.gpu_uuid]
                assert gpu.host == d.host
                assert takes(gpu, g), (d, gpu)
                book(gpu, g)
                assert no_mig_overlap(gpu)
                assert gpu.mps_used_mib <= gpu.memory_mib and gpu.mps_used_threads <= 100
            r = by_id[d.request_id]
            host = hosts[d.host]
            host.take(r.cpu_milli, r.memory_mib)
            assert not host.cpu_milli or host.cpu_used_milli <= host.cpu_milli, (d, host)
            assert not host.memory_mib or host.memory_used_mib <= host.memory_mib, (d, host)
            ends = NOW + r.max_duration_s if r.max_duration_s else None
            running[r.id] = Running(
                r.id,
                r.project,
                d.host,
                d.grants,
                ends_at=ends,
                cpu_milli=r.cpu_milli,
                memory_mib=r.memory_mib,
            )
    return state, list(running.values())


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_placements_respect_capacity_and_every_request_is_answered(seed: int, policy: str) -> None:
    snapshot, queue, fairshare = random_cluster(seed)
    decisions = run_cycle(snapshot, queue, get_policy(policy), NOW, fairshare=fairshare)
    replay(snapshot, queue, decisions)
    answered = sorted(d.request_id for d in decisions if isinstance(d, Place | Pending))
    assert answered == sorted(r.id for r in queue)
    assert all(d.reason for d in decisions if isinstance(d, Pending))
    preempted = [d.sandbox_id for d in decisions if isinstance(d, Preempt)]
    assert len(preempted) == len(set(preempted))
    if fairshare is not None:
        _, running = replay(snapshot, queue, decisions)
        placed = {d.request_id for d in decisions if isinstance(d, Place)}
        for project, share in fairshare.projects.items():
            use = sum(r.milli_gpu for r in running if r.project == project)
            if share.limit_milli is not None and any(
                r.project == project and r.sandbox_id in placed for r in running
            ):
                assert use <= share.limit_milli, (project, use, share)


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_reserved_head_is_never_delayed_by_backfill(seed: int, policy: str) -> None:
    snapshot, queue, fairshare = random_cluster(seed)
    decisions = run_cycle(snapshot, queue, get_policy(policy), NOW, fairshare=fairshare)
    reserves = [d for d in decisions if isinstance(d, Reserve)]
    assert len(reserves) <= 1
    if not reserves:
        return
    [reserve] = reserves
    assert reserve.at >= NOW
    assert not any(isinstance(d, Place) and d.request_id == reserve.request_id for d in decisions)
    state, running = replay(snapshot, queue, decisions)
    gpus = {g.uuid: g for h in state.hosts for g in h.gpus}
    # Everything due to end by the reservation ends (placements of this cycle included)...
    for alloc in running:
        if alloc.ends_at is not None and alloc.ends_at <= reserve.at:
            for g in alloc.grants:
                release(gpus[g.gpu_uuid], g)
    # ...and then the head's devices are free.
    for g in reserve.grants:
        assert takes(gpus[g.gpu_uuid], g), (reserve, gpus[g.gpu_uuid])
        book(gpus[g.gpu_uuid], g)


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shuffler=st.randoms(use_true_random=False))
def test_decisions_are_deterministic_whatever_the_input_order(
    seed: int, shuffler: random.Random, policy: str
) -> None:
    snapshot, queue, fairshare = random_cluster(seed)
    first = run_cycle(snapshot, queue, get_policy(policy), NOW, fairshare=fairshare)
    assert run_cycle(snapshot, queue, get_policy(policy), NOW, fairshare=fairshare) == first
    shuffled_queue = list(queue)
    shuffler.shuffle(shuffled_queue)
    shuffled = replace(snapshot, running=list(snapshot.running))
    shuffler.shuffle(shuffled.running)
    assert run_cycle(shuffled, shuffled_queue, get_policy(policy), NOW, fairshare=fairshare) == first
