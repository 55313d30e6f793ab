"""Properties of GPUs whose sharing mode follows demand, over random arrivals and departures.

A fleet of GPUs that follow demand (AUTO) and GPUs an admin pinned to a mode takes cycles
of random requests, dedicated, MPS, time-slice and CPU-only, in place, with random
departures between cycles. After every cycle: no GPU holds two modes at once or more than
it has, a pinned GPU holds only its own mode, an emptied GPU is idle again, and no host
gives out more CPU or memory than it has.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cluster import (
    AUTO,
    CPU_ONLY,
    DEDICATED,
    MPS,
    TIMESLICE,
    DeviceGrant,
    GpuState,
    HostState,
    Pending,
    Place,
    Request,
    Snapshot,
    book,
    release,
)
from scheduler.cycle import run_cycle
from scheduler.placement import get_policy
from scheduler.placement.firstfit import hosts_with_room, why_not
from scheduler.placement.gpushare import GpusharePolicy
from scheduler.placement.workload import WorkloadModel, observed_shape

KIND_MODE = {"exclusive": DEDICATED, "mps": MPS, "timeslice": TIMESLICE}


def current_mode(gpu: GpuState) -> str:
    """The mode it is in now: its pinned one, else what holds it; AUTO when idle."""
    if gpu.mode != AUTO:
        return gpu.mode
    if gpu.exclusive_busy:
        return DEDICATED
    if gpu.mps_used_threads or gpu.mps_used_mib:
        return MPS
    if gpu.replicas_used:
        return TIMESLICE
    return AUTO


GPU_MIB = 40000


def fleet(rng: random.Random) -> Snapshot:
    hosts = []
    for h in range(rng.randint(2, 6)):  # more than 4: the policy remembers scores between calls
        gpus = [
            GpuState(
                f"GPU-{h}-{i}",
                f"h{h}",
                i,
                "A100-40GB",
                GPU_MIB,
                rng.choice((AUTO, AUTO, AUTO, DEDICATED, MPS, TIMESLICE)),
                replicas=rng.randint(2, 4),
            )
            for i in range(rng.randint(1, 4))
        ]
        hosts.append(
            HostState(
                f"h{h}", True, gpus, cpu_milli=rng.choice((0, 8000, 32000)), memory_mib=rng.choice((0, 65536))
            )
        )
    return Snapshot(hosts=hosts)


def request(rng: random.Random, rid: int) -> Request:
    return Request(
        id=rid,
        project="p",
        priority=0,
        submitted_at=float(rid),
        mode=rng.choice((DEDICATED, MPS, MPS, TIMESLICE, CPU_ONLY)),
        gpu_count=rng.choice((1, 1, 2)),
        mps_memory_mib=rng.choice((5000, 15000, 30000)),
        mps_thread_pct=rng.choice((10, 30, 60)),
        cpu_milli=rng.choice((0, 1000, 4000)),
        memory_mib=rng.choice((0, 4096, 16384)),
    )


def check(snapshot: Snapshot, holding: dict[int, tuple[str, tuple[DeviceGrant, ...], Request]]) -> None:
    by_gpu: dict[str, list[DeviceGrant]] = {}
    for _, held, _ in holding.values():
        for grant in held:
            by_gpu.setdefault(grant.gpu_uuid, []).append(grant)
    for host in snapshot.hosts:
        if host.cpu_milli:
            assert host.cpu_used_milli <= host.cpu_milli, host.name
        if host.memory_mib:
            assert host.memory_used_mib <= host.memory_mib, host.name
        assert host.cpu_used_milli == sum(r.cpu_milli for h, _, r in holding.values() if h == host.name)
        for gpu in host.gpus:
            on_gpu = by_gpu.get(gpu.uuid, [])
            modes = {KIND_MODE[g.kind] for g in on_gpu}
            assert len(modes) <= 1, f"{gpu.uuid} holds {modes}"
            if gpu.mode != AUTO:
                assert modes <= {gpu.mode}, f"{gpu.uuid} is pinned to {gpu.mode} but holds {modes}"
            if DEDICATED in modes:
                assert len(on_gpu) == 1
            assert sum(g.mps_thread_pct for g in on_gpu) <= 100
            assert sum(g.mps_memory_mib for g in on_gpu) <= gpu.memory_mib
            replicas = [g.replica for g in on_gpu if g.kind == "timeslice"]
            assert len(replicas) == len(set(replicas)) and all(
                0 <= r < gpu.replicas for r in replicas if r is not None
            )
            if not on_gpu:
                assert gpu.idle and current_mode(gpu) == (AUTO if gpu.mode == AUTO else gpu.mode)


@pytest.mark.parametrize("policy", ["gpushare", "first-fit"])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_modes_follow_demand_without_over_committing(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    snapshot = fleet(rng)
    gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    hosts = {h.name: h for h in snapshot.hosts}
    chosen = get_policy(policy)
    holding: dict[int, tuple[str, tuple[DeviceGrant, ...], Request]] = {}
    next_id = 0
    for cycle in range(6):
        queue = [request(rng, next_id + i) for i in range(rng.randint(1, 12))]
        next_id += len(queue)
        asked = {r.id: r for r in queue}
        for decision in run_cycle(snapshot, queue, chosen, float(cycle), in_place=True):
            if isinstance(decision, Place):
                holding[decision.request_id] = (decision.host, decision.grants, asked[decision.request_id])
        check(snapshot, holding)
        for rid in [r for r in holding if rng.random() < 0.4]:  # departures
            host, grants, req = holding.pop(rid)
            for grant in grants:
                release(gpus[grant.gpu_uuid], grant)
            hosts[host].take(req.cpu_milli, req.memory_mib, -1)
            snapshot.changed(host)
        check(snapshot, holding)


def test_an_emptied_gpu_takes_another_mode() -> None:
    gpu = GpuState("g", "h", 0, "A100-40GB", GPU_MIB, AUTO, replicas=4)
    snapshot = Snapshot([HostState("h", True, [gpu])])
    policy = get_policy("gpushare")
    mps = Request(1, "p", 0, 0.0, MPS, mps_memory_mib=1000, mps_thread_pct=50)
    (placed,) = run_cycle(snapshot, [mps], policy, 0.0, in_place=True)
    assert isinstance(placed, Place) and current_mode(gpu) == MPS
    whole = Request(2, "p", 0, 1.0, DEDICATED)
    assert not isinstance(run_cycle(snapshot, [whole], policy, 1.0)[0], Place)
    release(gpu, placed.grants[0])
    snapshot.changed("h")
    assert current_mode(gpu) == AUTO
    assert isinstance(run_cycle(snapshot, [whole], policy, 2.0)[0], Place)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_policy_that_remembers_hosts_decides_as_a_fresh_one(seed: int) -> None:
    """gpushare remembers ranks by host state and request shape between calls and across
    snapshots (``host_state``): every decision must be the one a policy that has seen
    nothing before would make."""
    rng = random.Random(seed)
    snapshot = fleet(rng)
    while len(snapshot.hosts) <= 4:  # fewer hosts are scored afresh every call
        snapshot = fleet(rng)
    workload = WorkloadModel()
    kept = GpusharePolicy(workload)
    for rid in range(60):
        asked = request(rng, rid)
        workload.observe(rid, observed_shape(asked) or (0, 0, 0, ()))
        if rid in (20, 40):  # new typical requests: every remembered rank is void
            workload.publish()
        decision = kept.place(snapshot, asked)
        assert decision == GpusharePolicy(workload).place(snapshot, asked)
        if isinstance(decision, Pending):  # the reason, remembered by host state, is first-fit's
            refusal = hosts_with_room(snapshot, asked)
            said = refusal.reason if isinstance(refusal, Pending) else why_not(snapshot, asked)
            assert decision.reason == said
        if isinstance(decision, Place):
            gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
            for grant in decision.grants:
                book(gpus[grant.gpu_uuid], grant)
            next(h for h in snapshot.hosts if h.name == decision.host).take(asked.cpu_milli, asked.memory_mib)
            snapshot.changed(decision.host)
        if rng.random() < 0.1:  # what the control worker does each cycle: a fresh snapshot
            snapshot = snapshot.copy()
