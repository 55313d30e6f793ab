"""The scheduling seam: first-fit placement for every sharing mode, and pending reasons."""

from __future__ import annotations

import random
from typing import Any

from scheduler.cluster import GpuState, HostState, MigSlot, Pending, Place, Request, Snapshot, release
from scheduler.cycle import run_cycle
from scheduler.fairshare import FairOrder
from scheduler.placement import get_policy
from scheduler.placement.firstfit import grant_on, takes


def gpu(host: str, index: int, mode: str = "dedicated", **kw: Any) -> GpuState:
    return GpuState(
        uuid=f"GPU-{host}-{index}",
        host=host,
        index=index,
        model="H100-80GB",
        memory_mib=81559,
        mode=mode,
        **kw,
    )


def req(id: int, mode: str = "dedicated", priority: int = 100, at: float = 0.0, **kw: Any) -> Request:
    return Request(id=id, project="p", priority=priority, submitted_at=at, mode=mode, **kw)


def fleet() -> Snapshot:
    return Snapshot(
        hosts=[
            HostState(
                "a",
                True,
                [
                    gpu("a", 0),
                    gpu("a", 1),
                    gpu(
                        "a",
                        2,
                        "mig",
                        mig=[MigSlot("MIG-1", "3g.40gb", 0, 4), MigSlot("MIG-2", "1g.10gb", 4, 1)],
                    ),
                ],
            ),
            HostState("b", True, [gpu("b", 0, "mps"), gpu("b", 1, "timeslice", replicas=2)]),
        ]
    )


POLICY = get_policy("first-fit")


def test_dedicated_takes_free_gpus_on_one_host() -> None:
    decisions = run_cycle(fleet(), [req(1, gpu_count=2)], POLICY, now=0)
    assert decisions == [Place(1, "a", decisions[0].grants)]  # type: ignore[union-attr]
    assert [g.device_uuid for g in decisions[0].grants] == ["GPU-a-0", "GPU-a-1"]  # type: ignore[union-attr]


def test_dedicated_never_spans_hosts() -> None:
    [decision] = run_cycle(fleet(), [req(1, gpu_count=3)], POLICY, now=0)
    assert isinstance(decision, Pending)
    assert "3 free GPUs on one host" in decision.reason


def test_mig_gets_a_free_instance_of_its_profile_and_its_uuid() -> None:
    [decision] = run_cycle(fleet(), [req(1, "mig", mig_profile="1g.10gb")], POLICY, now=0)
    assert isinstance(decision, Place)
    assert decision.grants[0].device_uuid == "MIG-2"
    assert decision.grants[0].milli_gpu == 142  # 1 of 7 compute slices


def test_mig_profile_missing_says_so() -> None:
    [decision] = run_cycle(fleet(), [req(1, "mig", mig_profile="7g.80gb")], POLICY, now=0)
    assert isinstance(decision, Pending)
    assert "no MIG instance of profile 7g.80gb" in decision.reason


def test_mps_shares_stay_within_memory_and_threads() -> None:
    queue = [req(i, "mps", at=i, mps_memory_mib=20000, mps_thread_pct=40) for i in range(1, 4)]
    decisions = run_cycle(fleet(), queue, POLICY, now=0)
    assert [type(d).__name__ for d in decisions] == ["Place", "Place", "Pending"]
    assert "40% threads free" in decisions[2].reason  # type: ignore[union-attr]


def test_an_mps_gpu_held_to_one_size_takes_only_shares_of_that_size() -> None:
    """Its server's limits bind each process and the largest share's are the ceiling, so beside
    a 40 GiB share a 10 GiB share's process could take 40 GiB: one size per GPU, as NVIDIA's
    device plugin gives every MPS replica an equal fraction."""
    big = req(1, "mps", at=1, mps_memory_mib=40000, mps_thread_pct=40)
    same = req(2, "mps", at=2, mps_memory_mib=40000, mps_thread_pct=40)
    small = req(3, "mps", at=3, mps_memory_mib=10240, mps_thread_pct=10)
    snapshot = fleet()
    [mixed] = run_cycle(snapshot, [big, small], POLICY, now=0)[1:]
    assert isinstance(mixed, Place)  # by default shares of any size pack together
    snapshot.hosts[1].gpus[0].mps_one_size = True  # MPS_ONE_SIZE_PER_GPU
    decisions = run_cycle(snapshot, [big, same, small], POLICY, now=0, in_place=True)
    assert [type(d).__name__ for d in decisions] == ["Place", "Place", "Pending"]
    assert "beside shares of that size" in decisions[2].reason  # type: ignore[union-attr]
    gpu = snapshot.hosts[1].gpus[0]
    assert gpu.mps_share == (40000, 40) and gpu.mps_used_mib == 80000
    for decision in decisions[:2]:
        release(gpu, decision.grants[0])  # type: ignore[union-attr]
    assert gpu.mps_share is None  # empty again: the next share sets the size
    [placed] = run_cycle(snapshot, [small], POLICY, now=0)
    assert isinstance(placed, Place)


def test_timeslice_replicas_run_out() -> None:
    decisions = run_cycle(fleet(), [req(i, "timeslice", at=i) for i in range(1, 4)], POLICY, now=0)
    assert [getattr(d, "grants", (None,))[0] and d.grants[0].replica for d in decisions[:2]] == [0, 1]  # type: ignore[union-attr]
    assert isinstance(decisions[2], Pending)


def test_booked_devices_are_not_given_twice_in_one_cycle() -> None:
    decisions = run_cycle(fleet(), [req(1, at=1), req(2, at=2), req(3, at=3)], POLICY, now=0)
    placed = [g.device_uuid for d in decisions if isinstance(d, Place) for g in d.grants]
    assert len(placed) == len(set(placed)) == 2
    assert isinstance(decisions[2], Pending)


def test_the_given_snapshot_is_not_modified() -> None:
    snapshot = fleet()
    run_cycle(snapshot, [req(1, gpu_count=2)], POLICY, now=0)
    assert all(g.idle for h in snapshot.hosts for g in h.gpus)


def test_drained_and_lost_capacity_is_not_used() -> None:
    snapshot = fleet()
    snapshot.hosts[0].gpus[0].available = False
    snapshot.hosts[1].up = False
    [decision] = run_cycle(snapshot, [req(1, gpu_count=2)], POLICY, now=0)
    assert isinstance(decision, Pending)
    [mps] = run_cycle(snapshot, [req(2, "mps", mps_memory_mib=1000, mps_thread_pct=10)], POLICY, now=0)
    assert isinstance(mps, Pending) and "no GPU in the fleet offers mps" in mps.reason


def test_queue_order_is_priority_then_age_then_id() -> None:
    """Without fair-share state (no quotas): what the cycle's FairOrder hands out."""
    queue = [req(3, at=5), req(1, priority=50, at=1), req(2, at=5), req(4, priority=200, at=9)]
    order, taken = FairOrder(queue, None, [], now=0), []
    while (head := order.next()) is not None:
        taken.append(head.id)
        order.settle(head)  # waits (nothing placed): its project's next request comes up
    assert taken == [4, 2, 3, 1]


def test_unknown_policy_names_the_known_ones() -> None:
    import pytest

    with pytest.raises(ValueError, match="first-fit"):
        get_policy("nope")


def test_every_reason_to_wait_names_what_is_missing() -> None:
    """``why_not`` (one pass over a fleet of thousands of hosts) for each kind of shortage."""
    from dataclasses import replace

    from scheduler.cluster import AUTO, CPU_ONLY
    from scheduler.placement.firstfit import why_not

    def full() -> Snapshot:
        snapshot = fleet()
        for g in snapshot.hosts[0].gpus[:2]:
            g.exclusive_busy = True
        return snapshot

    tight = fleet()
    tight.hosts[0].cpu_milli, tight.hosts[0].cpu_used_milli = 4000, 3500
    assert why_not(tight, req(1, cpu_milli=1000)) == (
        "the GPUs it needs are free on a, but without 1 CPU cores and 0 MiB of memory to spare"
    )
    assert why_not(tight, req(1, CPU_ONLY, cpu_milli=1000)) == (
        "the GPUs it needs are free on a, but without 1 CPU cores and 0 MiB of memory to spare"
    )
    tight.hosts[1].cpu_milli, tight.hosts[1].cpu_used_milli = 4000, 3500
    assert why_not(tight, req(1, CPU_ONLY, cpu_milli=1000)).startswith("the GPUs it needs are free on a, b")
    assert why_not(full(), req(1)) == "waiting for 1 free GPU on one host (at most 0 free now)"
    assert why_not(fleet(), req(1, gpu_count=3)) == "waiting for 3 free GPUs on one host (at most 2 free now)"
    assert why_not(full(), req(1, gpu_models=("T4",))) == "no GPU of model T4 offers dedicated sharing"
    drained = full()
    for g in drained.hosts[0].gpus[:2]:
        g.available = False
    assert why_not(drained, req(1)) == "every dedicated GPU is drained or unavailable"
    containers = Snapshot([replace(h, isolation_levels=("container",)) for h in fleet().hosts])
    assert why_not(containers, req(1, isolation="vm")) == "no GPU in the fleet offers dedicated sharing"
    following = Snapshot([HostState("c", True, [gpu("c", 0, AUTO, exclusive_busy=True), gpu("c", 1, AUTO)])])
    following.hosts[0].gpus[1].mps_used_threads = 50
    assert why_not(following, req(1)) == "waiting for 1 free GPU on one host (at most 0 free now)"
    assert (
        why_not(following, req(1, "mig", mig_profile="1g.10gb")) == "no GPU in the fleet offers mig sharing"
    )
    assert why_not(fleet(), req(1, "mig", mig_profile="7g.80gb")) == (
        "no MIG instance of profile 7g.80gb exists in the fleet"
    )
    busy = fleet()
    for slot in busy.hosts[0].gpus[2].mig:
        slot.busy = True
    assert why_not(busy, req(1, "mig", mig_profile="1g.10gb")) == "every 1g.10gb MIG slice is in use"
    assert why_not(fleet(), req(1, "mps", mps_memory_mib=90000, mps_thread_pct=10)) == (
        "no MPS GPU has 90000 MiB and 10% threads free"
    )
    assert (
        why_not(fleet(), req(1, "timeslice", isolation="container")) == "every time-slice replica is in use"
    )
    down = Snapshot([replace(h, up=False) for h in fleet().hosts])
    assert why_not(down, req(1)) == "no GPU in the fleet offers dedicated sharing"


def test_takes_says_whether_grant_on_would_grant() -> None:
    """``takes`` spares the searches building grants: it must agree with ``grant_on``."""
    rng = random.Random(3)
    for _ in range(3000):
        g = gpu("a", 0, rng.choice(("mps", "timeslice", "auto", "dedicated")), replicas=rng.randint(0, 4))
        g.mps_used_threads = rng.choice((0, 30, 70, 100))
        g.mps_used_mib = rng.choice((0, 20000, 80000))
        g.mps_one_size = rng.random() < 0.3
        g.mps_share = rng.choice((None, (20000, 30), (10000, 10)))
        g.replicas_used = set(rng.sample(range(4), rng.randint(0, 3)))
        asked = req(
            1,
            rng.choice(("mps", "timeslice")),
            mps_memory_mib=rng.choice((10000, 20000, 70000)),
            mps_thread_pct=rng.choice((10, 30, 80)),
        )
        assert takes(g, asked) == (grant_on(g, asked) is not None)
