"""The live cycle: backfill behind a reserved head, preemption plans and pending reasons."""

from __future__ import annotations

import copy
from typing import Any

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
)
from scheduler.cycle import revert, run_cycle
from scheduler.placement import get_policy
from scheduler.preemption import plan_preemption, victim_order

POLICY = get_policy("first-fit")


def host(name: str, gpus: int, mode: str = "dedicated", **kw: Any) -> HostState:
    return HostState(
        name,
        True,
        [GpuState(f"GPU-{name}-{i}", name, i, "H100-80GB", 81559, mode, **kw) for i in range(gpus)],
    )


def req(id: int, at: float = 0.0, project: str = "p", **kw: Any) -> Request:
    kw.setdefault("priority", 100)
    kw.setdefault("mode", "dedicated")
    return Request(id=id, project=project, submitted_at=at, **kw)


def hold(snapshot: Snapshot, sandbox_id: int, gpus: list[GpuState], **kw: Any) -> None:
    """A running sandbox of project ``q`` (unless told) on whole ``gpus``."""
    grants = tuple(DeviceGrant(g.uuid, g.uuid, "exclusive", 1000) for g in gpus)
    for g, grant in zip(gpus, grants, strict=True):
        book(g, grant)
    kw.setdefault("project", "q")
    snapshot.running.append(Running(sandbox_id, host=gpus[0].host, grants=grants, **kw))


def kinds(decisions: list[Any]) -> list[str]:
    return [type(d).__name__ for d in decisions]


# --- reservation and backfill --------------------------------------------------------------


def staggered() -> Snapshot:
    """Four GPUs: three held until 1000, 5000 and 9000, one free."""
    snapshot = Snapshot([host("a", 4)])
    gpus = snapshot.hosts[0].gpus
    for i, end in enumerate((1000.0, 5000.0, 9000.0)):
        hold(snapshot, 900 + i, [gpus[i]], ends_at=end)
    return snapshot


def test_the_head_gets_a_reservation_at_the_first_time_it_fits() -> None:
    decisions = run_cycle(staggered(), [req(1, gpu_count=2)], POLICY, now=0.0)
    assert kinds(decisions) == ["Reserve", "Pending"]
    reserve = decisions[0]
    assert isinstance(reserve, Reserve)
    assert (reserve.request_id, reserve.host, reserve.at) == (1, "a", 1000.0)
    assert {g.gpu_uuid for g in reserve.grants} == {"GPU-a-0", "GPU-a-3"}
    assert isinstance(decisions[1], Pending)
    assert "a is reserved for it from 1970-01-01 00:16 UTC" in decisions[1].reason


def test_a_head_that_could_start_only_beyond_the_backfill_window_holds_nothing_back() -> None:
    """GPU-a-0 frees at 1000 s: inside a 1000 s window the head reserves it, inside 999 s
    it does not, and a later request may take what it would have held."""
    queue = [req(1, gpu_count=2), req(2, at=1)]
    assert kinds(run_cycle(staggered(), queue, POLICY, now=0.0, backfill_window_s=1000)) == [
        "Reserve", "Pending", "Pending",
    ]  # fmt: skip
    decisions = run_cycle(staggered(), queue, POLICY, now=0.0, backfill_window_s=999)
    assert kinds(decisions) == ["Pending", "Place"]
    assert "reserved" not in decisions[0].reason  # type: ignore[union-attr]


def test_backfill_runs_only_what_ends_before_the_reservation() -> None:
    short = req(2, at=1, max_duration_s=600)  # ends at 600, before 1000: may use GPU-a-3
    decisions = run_cycle(staggered(), [req(1, gpu_count=2), short], POLICY, now=0.0)
    assert kinds(decisions) == ["Reserve", "Pending", "Place"]
    assert decisions[2].grants[0].gpu_uuid == "GPU-a-3"  # type: ignore[union-attr]
    longer = req(3, at=2, max_duration_s=5000)  # would hold GPU-a-3 past 1000
    unknown = req(4, at=3)  # no known end: never on reserved devices
    decisions = run_cycle(staggered(), [req(1, gpu_count=2), longer, unknown], POLICY, now=0.0)
    assert kinds(decisions) == ["Reserve", "Pending", "Pending", "Pending"]
    for late in decisions[2:]:
        assert late.reason.startswith("reserved: the capacity that fits it is held for the older request #1")  # type: ignore[union-attr]


def test_a_held_reservation_binds_a_later_request_as_if_this_cycle_had_made_it() -> None:
    """The preview asks about one request behind the last cycle's head: it keeps off the
    head's devices unless it ends before the head starts, and gets no reservation itself."""
    first = run_cycle(staggered(), [req(1, gpu_count=2)], POLICY, now=0.0)
    reserve = first[0]
    assert isinstance(reserve, Reserve)
    held = (req(1, gpu_count=2), reserve)
    decisions = run_cycle(staggered(), [req(2, at=1)], POLICY, now=0.0, held=held)
    assert kinds(decisions) == ["Reserve", "Pending"] and decisions[0] == reserve
    assert decisions[1].reason.startswith("reserved: the capacity that fits it is held for the older")  # type: ignore[union-attr]
    short = run_cycle(staggered(), [req(2, at=1, max_duration_s=600)], POLICY, now=0.0, held=held)
    assert kinds(short) == ["Reserve", "Place"] and short[1].grants[0].gpu_uuid == "GPU-a-3"  # type: ignore[union-attr]
    alone = run_cycle(staggered(), [req(2, at=1)], POLICY, now=0.0)
    assert kinds(alone) == ["Place"]


def test_backfill_may_use_devices_outside_the_reservation() -> None:
    snapshot = staggered()
    snapshot.hosts.append(host("b", 1))
    queue = [req(1, at=0, gpu_count=2), req(2, at=1), req(3, at=2)]
    decisions = run_cycle(snapshot, queue, POLICY, now=0.0)
    placed = [d for d in decisions if isinstance(d, Place)]
    assert [(p.request_id, p.host) for p in placed] == [(2, "b")]
    assert "reserved" in decisions[-1].reason  # type: ignore[union-attr]


def test_a_mig_reservation_holds_back_only_its_instance() -> None:
    gpu = GpuState(
        "GPU-m",
        "m",
        0,
        "H100-80GB",
        81559,
        "mig",
        mig=[MigSlot("MIG-0", "3g.40gb", 0, 4), MigSlot("MIG-4", "3g.40gb", 4, 4)],
    )
    snapshot = Snapshot([HostState("m", True, [gpu])])
    grant = DeviceGrant("GPU-m", "MIG-0", "mig", 428, mig_uuid="MIG-0")
    book(gpu, grant)
    snapshot.running.append(Running(900, "q", "m", (grant,), ends_at=100.0))
    busy = DeviceGrant("GPU-m", "MIG-4", "mig", 428, mig_uuid="MIG-4")
    book(gpu, busy)
    snapshot.running.append(Running(901, "q", "m", (busy,), ends_at=50.0))
    queue = [req(1, mode="mig", mig_profile="3g.40gb"), req(2, at=1, mode="mig", mig_profile="3g.40gb")]
    decisions = run_cycle(snapshot, queue, POLICY, now=0.0)
    assert kinds(decisions) == ["Reserve", "Pending", "Pending"]
    assert decisions[0].grants[0].mig_uuid == "MIG-4"  # type: ignore[union-attr]
    assert decisions[0].at == 50.0  # type: ignore[union-attr]


def test_backfill_does_not_reclaim_its_way_onto_reserved_devices() -> None:
    gpu = GpuState("GPU-m", "m", 0, "H100-80GB", 81559, "mig", mig=[MigSlot("MIG-0", "7g.80gb", 0, 8)])
    snapshot = Snapshot([HostState("m", True, [gpu])])
    grant = DeviceGrant("GPU-m", "MIG-0", "mig", 1000, mig_uuid="MIG-0")
    book(gpu, grant)
    snapshot.running.append(Running(900, "b", "m", (grant,), ends_at=100.0, borrowed=True))
    state = FairShareState({"a": ProjectShare(guaranteed_milli=1000), "b": ProjectShare(guaranteed_milli=0)})
    # c has no guarantee, so its request (the head) cannot reclaim and reserves the slot
    # from 100; a's request behind it could reclaim b's borrowed sandbox, but not that one.
    queue = [
        req(1, project="c", mode="mig", mig_profile="7g.80gb"),
        req(2, at=1, project="a", mode="mig", mig_profile="7g.80gb"),
    ]
    decisions = run_cycle(snapshot, queue, POLICY, now=0.0, fairshare=state)
    assert kinds(decisions) == ["Reserve", "Pending", "Pending"]
    assert decisions[0].request_id == 1  # type: ignore[union-attr]


def test_no_reservation_without_known_end_times() -> None:
    snapshot = Snapshot([host("a", 2)])
    hold(snapshot, 900, snapshot.hosts[0].gpus)
    assert kinds(run_cycle(snapshot, [req(1)], POLICY, now=0.0)) == ["Pending"]


# --- preemption plans ----------------------------------------------------------------------


def test_preemption_takes_the_fewest_victims() -> None:
    snapshot = Snapshot([host("a", 4)])
    gpus = snapshot.hosts[0].gpus
    hold(snapshot, 900, gpus[0:2], priority=50, preemptible=True)
    hold(snapshot, 901, [gpus[2]], priority=10, preemptible=True)
    hold(snapshot, 902, [gpus[3]], priority=10, preemptible=True)
    decisions = run_cycle(snapshot, [req(1, gpu_count=2, priority=200)], POLICY, now=0.0)
    assert decisions[:-1] == [Preempt(900, decisions[0].reason)]  # type: ignore[union-attr]
    assert "higher priority (200 > 50)" in decisions[0].reason  # type: ignore[union-attr]
    assert isinstance(decisions[-1], Place)


def test_revert_undoes_what_a_cycle_in_place_applied() -> None:
    snapshot = Snapshot([host("a", 4), host("b", 1)])
    gpus = snapshot.hosts[0].gpus
    hold(snapshot, 900, gpus[0:2], priority=50, preemptible=True)
    hold(snapshot, 901, gpus[2:4], priority=10, preemptible=True)
    before = copy.deepcopy(snapshot.hosts)
    queue = [req(1, gpu_count=2, priority=200, cpu_milli=500), req(2, at=1, cpu_milli=250)]
    decisions = run_cycle(snapshot, queue, POLICY, now=0.0, in_place=True)
    assert kinds(decisions) == ["Preempt", "Place", "Place"] and snapshot.hosts != before
    revert(snapshot, decisions, queue)
    assert snapshot.hosts == before
    assert set(snapshot.changes) == {"a", "b"}  # a policy's remembered scores are dropped


def test_borrowers_go_first_then_lowest_priority_then_youngest() -> None:
    victims = [
        Running(1, "q", "a", (), priority=10, started_at=5),
        Running(2, "q", "a", (), priority=50, borrowed=True),
        Running(3, "q", "a", (), priority=10, started_at=9),
        Running(4, "q", "a", (), priority=30),
    ]
    assert [v.sandbox_id for v in sorted(victims, key=victim_order)] == [2, 3, 1, 4]
    snapshot = Snapshot([host("a", 3)])
    gpus = snapshot.hosts[0].gpus
    hold(snapshot, 900, [gpus[0]], priority=10, preemptible=True, started_at=5)
    hold(snapshot, 901, [gpus[1]], priority=50, preemptible=True, borrowed=True)
    hold(snapshot, 902, [gpus[2]], priority=10, preemptible=True, started_at=9)
    decisions = run_cycle(snapshot, [req(1, priority=200)], POLICY, now=0.0)
    assert [d.sandbox_id for d in decisions if isinstance(d, Preempt)] == [901]
    snapshot.running = [r for r in snapshot.running if r.sandbox_id != 901]
    decisions = run_cycle(snapshot, [req(1, priority=200)], POLICY, now=0.0)
    assert [d.sandbox_id for d in decisions if isinstance(d, Preempt)] == [902]


def test_only_preemptible_and_lower_priority_sandboxes_are_victims() -> None:
    snapshot = Snapshot([host("a", 2)])
    gpus = snapshot.hosts[0].gpus
    hold(snapshot, 900, [gpus[0]], priority=10)  # not preemptible
    hold(snapshot, 901, [gpus[1]], priority=100, preemptible=True)  # same priority
    decisions = run_cycle(snapshot, [req(1, priority=100)], POLICY, now=0.0)
    assert kinds(decisions) == ["Pending"]
    decisions = run_cycle(snapshot, [req(1, priority=200)], POLICY, now=0.0)
    assert [d.sandbox_id for d in decisions if isinstance(d, Preempt)] == [901]


def test_nothing_is_a_victim_before_its_minimum_runtime_is_over() -> None:
    snapshot = Snapshot([host("a", 2)])
    gpus = snapshot.hosts[0].gpus
    hold(snapshot, 900, [gpus[0]], priority=10, preemptible=True, preemptible_at=600.0)
    hold(snapshot, 901, [gpus[1]], priority=10, preemptible=True, borrowed=True, preemptible_at=900.0)
    assert kinds(run_cycle(snapshot, [req(1, priority=200)], POLICY, now=599.0)) == ["Pending"]
    decisions = run_cycle(snapshot, [req(1, priority=200)], POLICY, now=600.0)
    assert [d.sandbox_id for d in decisions if isinstance(d, Preempt)] == [900]


def test_the_plan_picks_the_host_needing_fewest_victims_and_restores_the_snapshot() -> None:
    snapshot = Snapshot([host("a", 2), host("b", 2)])
    a, b = snapshot.hosts[0].gpus, snapshot.hosts[1].gpus
    hold(snapshot, 900, [a[0]], priority=10, preemptible=True)
    hold(snapshot, 901, [a[1]], priority=10, preemptible=True)
    hold(snapshot, 902, b, priority=90, preemptible=True)
    plan = plan_preemption(snapshot, req(1, gpu_count=2, priority=200), POLICY, snapshot.running)
    assert plan is not None and [v.sandbox_id for v in plan.victims] == [902]
    assert plan.place.host == "b"
    assert all(g.exclusive_busy for h in snapshot.hosts for g in h.gpus)


def test_many_small_victims_fall_back_to_a_pruned_greedy_plan() -> None:
    snapshot = Snapshot([host("m", 1, "mps")])
    gpu = snapshot.hosts[0].gpus[0]
    for i in range(10):
        grant = DeviceGrant(gpu.uuid, gpu.uuid, "mps", 100, mps_memory_mib=1000, mps_thread_pct=10)
        book(gpu, grant)
        snapshot.running.append(
            Running(900 + i, "q", "m", (grant,), priority=10, preemptible=True, started_at=i)
        )
    decisions = run_cycle(
        snapshot, [req(1, priority=200, mode="mps", mps_memory_mib=1000, mps_thread_pct=30)], POLICY, now=0.0
    )
    assert [d.sandbox_id for d in decisions if isinstance(d, Preempt)] == [909, 908, 907]
    assert isinstance(decisions[-1], Place)


def test_a_borrowing_request_does_not_preempt_within_guarantee_work() -> None:
    snapshot = Snapshot([host("a", 1)])
    hold(snapshot, 900, snapshot.hosts[0].gpus, priority=10, preemptible=True)
    state = FairShareState({"q": ProjectShare(guaranteed_milli=1000), "p": ProjectShare(guaranteed_milli=0)})
    decisions = run_cycle(snapshot, [req(1, priority=200)], POLICY, now=0.0, fairshare=state)
    assert kinds(decisions) == ["Pending"]


# --- pending reasons -----------------------------------------------------------------------


def test_a_lower_priority_request_hears_about_those_ahead() -> None:
    snapshot = Snapshot([host("a", 1)])
    hold(snapshot, 900, snapshot.hosts[0].gpus)
    decisions = run_cycle(snapshot, [req(1, priority=200), req(2, priority=100)], POLICY, now=0.0)
    assert "priority: 1 higher-priority dedicated requests wait ahead of it" in decisions[1].reason  # type: ignore[union-attr]


def test_the_reservation_reason_names_a_higher_priority_head() -> None:
    queue = [req(1, gpu_count=2, priority=200), req(2, at=1, priority=100)]
    decisions = run_cycle(staggered(), queue, POLICY, now=0.0)
    assert "held for the higher-priority request #1" in decisions[-1].reason  # type: ignore[union-attr]


def test_every_request_gets_one_place_or_pending() -> None:
    queue = [req(i, at=i, gpu_count=1 + i % 3, max_duration_s=100.0 * i) for i in range(1, 12)]
    decisions = run_cycle(staggered(), queue, POLICY, now=0.0)
    answered = [d.request_id for d in decisions if isinstance(d, Place | Pending)]
    assert sorted(answered) == list(range(1, 12))
    assert all(d.reason for d in decisions if isinstance(d, Pending))


def test_a_live_cycle_of_1000_requests_on_500_gpus_decides_within_a_second() -> None:
    from scheduler.research.bench_cycle import measure_live

    figures = measure_live(hosts=63, queue_size=1000, repeats=1)
    assert figures["gpus"] == 504 and figures["placed"] > 0
    assert figures["cpu_p50_ms"] < 1000  # CPU time: other work on the machine does not count
