"""Fair share, quotas and guarantees: the ordering and admission half of the live cycle."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from scheduler.cluster import (
    DeviceGrant,
    FairShareState,
    GpuState,
    HostState,
    Pending,
    Place,
    Preempt,
    ProjectShare,
    Request,
    Running,
    Snapshot,
    book,
)
from scheduler.cycle import run_cycle
from scheduler.fairshare import FairOrder, decay, decayed_usage, demand_milli
from scheduler.placement import get_policy

POLICY = get_policy("first-fit")
DAY = 86400.0


def dedicated_fleet(hosts: int, per_host: int = 8) -> Snapshot:
    return Snapshot(
        hosts=[
            HostState(
                f"h{h}",
                True,
                [
                    GpuState(f"GPU-{h}-{i}", f"h{h}", i, "H100-80GB", 81559, "dedicated")
                    for i in range(per_host)
                ],
            )
            for h in range(hosts)
        ]
    )


def req(id: int, project: str, at: float = 0.0, **kw: Any) -> Request:
    kw.setdefault("priority", 100)
    return Request(id=id, project=project, submitted_at=at, mode="dedicated", **kw)


def occupy(snapshot: Snapshot, sandbox_id: int, project: str, gpu: GpuState, **kw: Any) -> Running:
    """Mark ``gpu`` as held by a running sandbox and list that sandbox in the snapshot."""
    grant = DeviceGrant(gpu.uuid, gpu.uuid, "exclusive", 1000)
    book(gpu, grant)
    running = Running(sandbox_id, project, gpu.host, (grant,), **kw)
    snapshot.running.append(running)
    return running


# --- usage and the factor ------------------------------------------------------------------


def test_decay_halves_every_half_life() -> None:
    assert decay(100.0, DAY, DAY) == pytest.approx(50.0)
    assert decay(100.0, 3 * DAY, DAY) == pytest.approx(12.5)
    assert decay(100.0, 0, DAY) == 100.0
    assert decay(100.0, 1, 0) == 0.0


def test_decayed_usage_is_the_integral_of_decayed_gpu_seconds() -> None:
    # 2 GPUs for one hour that ended one half-life ago: 7200 GPU-s, about halved.
    usage = decayed_usage([(-DAY - 3600, -DAY, 2000)], now=0.0, half_life_s=DAY)
    assert usage == pytest.approx(7200 / 2, rel=0.02)
    # A running interval counts up to now only, a future one not at all.
    assert decayed_usage([(-10, 50, 1000), (10, 20, 1000)], now=0.0, half_life_s=1e12) == pytest.approx(10)


def test_demand_counts_milli_gpu_per_mode() -> None:
    assert demand_milli(req(1, "p", gpu_count=3)) == 3000
    assert demand_milli(Request(1, "p", 0, 0, "mig", mig_profile="3g.40gb")) == 428
    assert demand_milli(Request(1, "p", 0, 0, "mps", mps_thread_pct=25)) == 250
    assert demand_milli(Request(1, "p", 0, 0, "timeslice"), timeslice_milli=250) == 250
    assert demand_milli(Request(1, "p", 0, 0, "cpu", cpu_milli=4000), timeslice_milli=250) == 0


# --- ordering ------------------------------------------------------------------------------


def test_priority_class_beats_fair_share_and_fair_share_beats_age() -> None:
    state = FairShareState({"heavy": ProjectShare(usage_gpu_s=1e6), "light": ProjectShare()})
    queue = [req(1, "heavy", at=1), req(2, "light", at=5), req(3, "heavy", at=0, priority=200)]
    order = FairOrder(queue, state, [], now=10)
    taken = []
    while (r := order.next()) is not None:
        taken.append(r.id)
        order.settle(r)
    assert taken == [3, 2, 1]


def test_one_cycle_shares_free_gpus_by_weight() -> None:
    state = FairShareState(
        {"a": ProjectShare(weight=1), "b": ProjectShare(weight=2), "c": ProjectShare(weight=3)}
    )
    queue = [
        req(p * 100 + i, name, at=i, max_duration_s=3600) for p, name in enumerate("abc") for i in range(20)
    ]
    decisions = run_cycle(dedicated_fleet(3, 8), queue, POLICY, 0.0, fairshare=state)
    placed = [d.request_id // 100 for d in decisions if isinstance(d, Place)]
    assert [placed.count(p) for p in range(3)] == [4, 8, 12]


def test_usage_of_running_sandboxes_counts_against_their_project() -> None:
    snapshot = dedicated_fleet(1, 4)
    for i in range(3):
        occupy(snapshot, 900 + i, "busy", snapshot.hosts[0].gpus[i], ends_at=7200.0)
    state = FairShareState({"busy": ProjectShare(), "idle": ProjectShare()})
    queue = [req(1, "busy", at=0), req(2, "idle", at=5)]
    decisions = run_cycle(snapshot, queue, POLICY, 0.0, fairshare=state)
    assert isinstance(decisions[0], Place) and decisions[0].request_id == 2


def test_without_fair_share_the_order_is_priority_then_age() -> None:
    queue = [req(1, "a", at=3), req(2, "b", at=1), req(3, "c", at=2, priority=50)]
    decisions = run_cycle(dedicated_fleet(1, 2), queue, POLICY, 0.0)
    assert [d.request_id for d in decisions if isinstance(d, Place)] == [2, 1]


# --- quotas --------------------------------------------------------------------------------


def test_limit_stops_a_project_and_says_so() -> None:
    state = FairShareState({"a": ProjectShare(limit_milli=2000)})
    decisions = run_cycle(
        dedicated_fleet(1), [req(i, "a", at=i) for i in range(3)], POLICY, 0.0, fairshare=state
    )
    assert [type(d).__name__ for d in decisions] == ["Place", "Place", "Pending"]
    assert decisions[2].reason.startswith("quota: project a holds 2000 of its 2000 milli-GPU limit")  # type: ignore[union-attr]


def test_limit_counts_what_already_runs() -> None:
    snapshot = dedicated_fleet(1)
    occupy(snapshot, 900, "a", snapshot.hosts[0].gpus[0])
    state = FairShareState({"a": ProjectShare(limit_milli=1000)})
    [decision] = run_cycle(snapshot, [req(1, "a")], POLICY, 0.0, fairshare=state)
    assert isinstance(decision, Pending) and "quota" in decision.reason


def test_placements_over_the_guarantee_are_marked_borrowed() -> None:
    state = FairShareState({"a": ProjectShare(guaranteed_milli=2000)})
    decisions = run_cycle(
        dedicated_fleet(1), [req(i, "a", at=i) for i in range(3)], POLICY, 0.0, fairshare=state
    )
    assert [d.borrowed for d in decisions if isinstance(d, Place)] == [False, False, True]
    # A project without a guarantee borrows nothing: the flag means "reclaimable".
    plain = run_cycle(dedicated_fleet(1), [req(1, "b")], POLICY, 0.0, fairshare=state)
    assert plain[0] == Place(1, "h0", plain[0].grants)  # type: ignore[union-attr]


def full_of_borrowers() -> tuple[Snapshot, FairShareState]:
    """Eight GPUs, all held by project b: four within its guarantee, four borrowed."""
    snapshot = dedicated_fleet(1)
    for i, gpu in enumerate(snapshot.hosts[0].gpus):
        occupy(snapshot, 900 + i, "b", gpu, started_at=float(i), borrowed=i >= 4)
    shares = {"a": ProjectShare(guaranteed_milli=4000), "b": ProjectShare(guaranteed_milli=4000)}
    return snapshot, FairShareState(shares)


def test_a_project_under_its_guarantee_reclaims_borrowed_capacity_in_one_cycle() -> None:
    snapshot, state = full_of_borrowers()
    decisions = run_cycle(snapshot, [req(1, "a", gpu_count=2)], POLICY, 0.0, fairshare=state)
    assert [type(d).__name__ for d in decisions] == ["Preempt", "Preempt", "Place"]
    victims = {d.sandbox_id for d in decisions if isinstance(d, Preempt)}
    assert victims == {907, 906}  # borrowed ones, the most recently started first
    assert "reclaimed" in decisions[0].reason  # type: ignore[union-attr]
    freed = {f"GPU-0-{v - 900}" for v in victims}
    assert {g.gpu_uuid for g in decisions[2].grants} == freed  # type: ignore[union-attr]
    assert not decisions[2].borrowed  # type: ignore[union-attr]


def test_reclaim_never_takes_a_borrower_below_its_guarantee() -> None:
    snapshot, state = full_of_borrowers()
    queue = [req(1, "a", gpu_count=4, at=0), req(2, "a", gpu_count=1, at=1)]
    state = FairShareState({**state.projects, "a": ProjectShare(guaranteed_milli=8000)})
    decisions = run_cycle(snapshot, queue, POLICY, 0.0, fairshare=state)
    assert sum(isinstance(d, Preempt) for d in decisions) == 4
    assert isinstance(decisions[-1], Pending)  # b is back at its guarantee: nothing more to take


def test_an_over_quota_request_only_borrows_idle_capacity() -> None:
    snapshot, state = full_of_borrowers()
    state = FairShareState({**state.projects, "a": ProjectShare(guaranteed_milli=0)})
    [decision] = run_cycle(snapshot, [req(1, "a")], POLICY, 0.0, fairshare=state)
    assert isinstance(decision, Pending)
    assert "over its guarantee, so it may only borrow idle capacity" in decision.reason


# --- a simulated week ----------------------------------------------------------------------


def simulate_week(weights: dict[str, float], seed: int) -> dict[str, float]:
    """Saturating projects on 32 GPUs, 5-minute cycles for 7 days; GPU-hours per project."""
    rng = random.Random(seed)
    cycle_s = 300.0
    snapshot = dedicated_fleet(4)
    gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    state = FairShareState(
        {p: ProjectShare(weight=w) for p, w in weights.items()}, half_life_s=DAY, usage_at=0.0
    )
    queue: list[Request] = []
    ends: dict[int, float] = {}  # the actual end, at or before the max duration
    delivered = dict.fromkeys(weights, 0.0)
    next_id = 0
    for step in range(int(7 * DAY / cycle_s)):
        now = step * cycle_s
        for name in weights:  # every project keeps ten requests waiting
            for _ in range(10 - sum(r.project == name for r in queue)):
                next_id += 1
                size = rng.choice((1, 1, 1, 2))
                hours = rng.choice((1, 2, 4, 8))
                queue.append(req(next_id, name, at=now, gpu_count=size, max_duration_s=hours * 3600.0))
                ends[next_id] = rng.uniform(0.25, 1.0) * hours * 3600.0
        decisions = run_cycle(snapshot, queue, POLICY, now, fairshare=state)
        by_id = {r.id: r for r in queue}
        for d in decisions:
            if isinstance(d, Place):
                r = by_id[d.request_id]
                for g in d.grants:
                    book(gpus[g.gpu_uuid], g)
                snapshot.running.append(
                    Running(r.id, r.project, d.host, d.grants, started_at=now, ends_at=now + r.max_duration_s)
                )
                ends[r.id] += now
        placed = {d.request_id for d in decisions if isinstance(d, Place)}
        queue = [r for r in queue if r.id not in placed]
        # The cycle runs: usage accrues, sandboxes that end free their GPUs.
        used = dict.fromkeys(weights, 0.0)
        still = []
        for alloc in snapshot.running:
            until = min(ends[alloc.sandbox_id], now + cycle_s)
            used[alloc.project] += alloc.milli_gpu / 1000 * (until - now)
            if ends[alloc.sandbox_id] <= now + cycle_s:
                for g in alloc.grants:
                    gpus[g.gpu_uuid].exclusive_busy = False
            else:
                still.append(alloc)
        snapshot.running = still
        for name, gpu_s in used.items():
            delivered[name] += gpu_s / 3600
        # Usage decayed over the cycle plus what it used: step by step, the figure the portal
        # rebuilds from the ledger each cycle (decayed_usage, the integral of the same decay).
        projects = {
            p: replace(s, usage_gpu_s=decay(s.usage_gpu_s, cycle_s, DAY) + used[p])
            for p, s in state.projects.items()
        }
        state = replace(state, projects=projects, usage_at=now + cycle_s)
    return delivered


def test_a_simulated_week_delivers_gpu_hours_by_weight() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    hours = simulate_week(weights, seed=7)
    total = sum(hours.values())
    assert total > 0.8 * 32 * 7 * 24  # saturating: the fleet stays busy
    for name, weight in weights.items():
        share = hours[name] / total
        assert math.isclose(share, weight / 6, rel_tol=0.05), (name, share, weight / 6)
