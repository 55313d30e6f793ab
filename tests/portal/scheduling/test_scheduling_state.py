"""What the scheduling cycle reads, keeps and leaves behind: the fleet read with plain
queries, a cycle that changes nothing writing nothing, the placement policy kept between
cycles and taught by recent requests, and the state published for the preview matching
what the database says after the cycle."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.control import scheduling
from portal.control.scheduling import schedule_once
from portal.fleet.models import Gpu, Host, MigInstance
from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox
from portal.scheduling import digest, policy
from portal.scheduling.snapshot import build_snapshot, read_queue
from scheduler.cluster import AUTO, Running
from scheduler.placement import workload
from scheduler.placement.workload import WorkloadModel
from tests.conftest import seed_host
from tests.factories import PriorityClassFactory, TierFactory
from tests.portal.helpers import place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]
WRITES = ("INSERT", "UPDATE", "DELETE")


def ask(people: Any, catalog: Any, tier: str, count: int = 1, **kw: Any) -> list[Sandbox]:
    return [
        request(people["owner"], people["project"], catalog[tier], catalog["image"], **kw)
        for _ in range(count)
    ]


def writes(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if q["sql"].lstrip().split()[0].upper() in WRITES]


def test_a_cycle_in_which_nothing_changed_writes_nothing(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    ask(people, catalog, "dedicated", 4)  # every dedicated GPU
    ask(people, catalog, "mps", mps_memory_mib=61440, mps_thread_pct=50)
    ask(people, catalog, "timeslice", 4)  # every replica
    assert place_all_counts() == (9, 0)
    waiting = ask(people, catalog, "dedicated", 3) + ask(
        people, catalog, "mps", mps_memory_mib=40960, mps_thread_pct=60
    )
    waiting += ask(people, catalog, "timeslice")
    with CaptureQueriesContext(connection) as first:
        assert place_all_counts() == (0, 5)
    assert writes(first)  # the first reasons are written (and their owners told)
    assert all(Sandbox.objects.get(pk=s.pk).pending_reason for s in waiting)
    for _ in range(2):
        with CaptureQueriesContext(connection) as again:
            assert place_all_counts() == (0, 5)
        assert writes(again) == []


def place_all_counts() -> tuple[int, int]:
    return schedule_once(now=time.time())  # as the control worker calls it


def test_the_snapshot_reads_every_kind_of_holding(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    (pair,) = ask(people, catalog, "dedicated", gpu_count=2)
    (mig,) = ask(people, catalog, "mig", mig_profile="1g.10gb")
    (share,) = ask(people, catalog, "mps", mps_memory_mib=20480, mps_thread_pct=30)
    (replica,) = ask(people, catalog, "timeslice")
    place_all()
    # A sandbox that holds no device (CPU-only, once there are such tiers) still takes its
    # tier's CPU and memory on its host.
    a100 = Host.objects.get(name="a100")
    deviceless = Sandbox.objects.create(
        project=people["project"], owner=people["owner"], tier=catalog["timeslice"], image=catalog["image"],
        isolation="container", max_duration=timedelta(hours=1), state="running", host=a100,
        started_at=timezone.now(),
    )  # fmt: skip
    Gpu.objects.filter(host=a100, index=1).update(sharing_mode=AUTO, timeslice_replicas=8)
    Gpu.objects.filter(host__name="h100", index=3).update(state=Gpu.State.DRAINED)
    snapshot = build_snapshot()

    gpus = {(g.host, g.index): g for h in snapshot.hosts for g in h.gpus}
    assert [h.name for h in snapshot.hosts] == ["a100", "h100"]
    assert [g.index for g in snapshot.hosts[0].gpus] == [0, 1, 2, 3]
    assert sum(g.exclusive_busy for g in gpus.values()) == 2
    assert (gpus["a100", 1].mode, gpus["a100", 1].replicas) == (AUTO, 8)  # follows demand, may time-slice
    assert (gpus["a100", 2].mps_used_mib, gpus["a100", 2].mps_used_threads) == (20480, 30)
    assert (gpus["a100", 3].replicas, gpus["a100", 3].replicas_used) == (4, {0})
    assert gpus["a100", 2].replicas == 0  # an MPS GPU offers no replicas
    assert not gpus["h100", 3].available and gpus["h100", 2].available
    slots = [s for g in (gpus["h100", 0], gpus["h100", 1]) for s in g.mig]
    assert len(slots) == MigInstance.objects.count() and sum(s.busy for s in slots) == 1

    running = {r.sandbox_id: r for r in snapshot.running}
    assert set(running) == {pair.pk, mig.pk, share.pk, replica.pk, deviceless.pk}
    assert [g.kind for g in running[pair.pk].grants] == ["exclusive", "exclusive"]
    assert running[mig.pk].grants[0].mig_uuid.startswith("MIG-")
    assert running[deviceless.pk].grants == () and running[deviceless.pk].host == "a100"
    on_a100 = [r for r in running.values() if r.host == "a100"]
    assert snapshot.hosts[0].cpu_used_milli == 500 * len(on_a100)
    assert snapshot.hosts[0].memory_used_mib == 256 * len(on_a100)

    # An instance a re-layout destroyed leaves its allocation without one: held, unnamed.
    Allocation.objects.filter(sandbox=mig).update(mig_instance=None)
    again = {r.sandbox_id: r for r in build_snapshot().running}
    assert again[mig.pk].grants[0].mig_uuid == ""
    Host.objects.filter(name="h100").update(state=Host.State.LOST)
    assert [h.up for h in build_snapshot().hosts] == [True, False]


def test_the_policy_is_kept_between_cycles_and_learns_from_recent_requests(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It publishes what is typical from a few requests here (200 in production).
    monkeypatch.setattr(workload, "MIN_OBSERVED", 10)
    ask(people, catalog, "mps", 20, mps_memory_mib=1024, mps_thread_pct=25)
    place_all()  # warms the kept policy from the database
    with policy.lock:
        kept = policy.kept_policy("gpushare")
    model = policy.workload_of(kept)
    assert model is not None and model.observed == 20 and model.window is not None
    assert [(t.cpu_milli, t.gpu_milli, t.num_gpu) for t in model.typical] == [(500, 250, 1)]
    ask(people, catalog, "dedicated", 2, gpu_count=2)
    place_all()  # the queue is shown to the same model; each request counts once
    place_all()
    with policy.lock:
        assert policy.kept_policy("gpushare") is kept
    assert model.observed == 22


def test_a_new_model_learns_the_latest_requests_first_come_first_counted(
    people: Any, catalog: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workload, "MIN_OBSERVED", 2)
    older = ask(people, catalog, "mps", 5, mps_memory_mib=1024, mps_thread_pct=25)
    older += ask(people, catalog, "mig", mig_profile="1g.10gb")  # MIG is not part of the measures
    yesterday = timezone.now() - timedelta(days=1)
    Sandbox.objects.filter(pk__in=[s.pk for s in older]).update(requested_at=yesterday)
    ask(people, catalog, "dedicated", 3, gpu_count=2)
    model = WorkloadModel(window=4)
    policy.warm(model)  # the latest four: three dedicated pairs, then the MIG slice (skipped)
    assert model.observed == 3 and [(t.gpu_milli, t.num_gpu) for t in model.typical] == [(1000, 2)]


def comparable(running: list[Running]) -> dict[int, tuple[Any, ...]]:
    """Who holds what, without the start time (the digest dates a new placement when it
    writes, the database when it booked)."""
    return {
        r.sandbox_id: (
            r.project,
            r.host,
            r.grants,
            r.priority,
            r.preemptible,
            r.borrowed,
            r.cpu_milli,
            r.memory_mib,
        )
        for r in running
    }


def assert_published_state_is_the_database() -> digest.Digest:
    state = digest.latest()
    assert state is not None
    fresh = build_snapshot()
    assert state.snapshot().hosts == fresh.hosts
    assert comparable(state.running) == comparable(fresh.running)
    for held in state.running:
        assert any(
            abs(held.started_at - r.started_at) < 5 for r in fresh.running if r.sandbox_id == held.sandbox_id
        )
    assert {r.id for r in state.pending} == {q.request.id for q in read_queue()}
    return state


def test_the_published_state_is_what_the_database_holds_after_the_cycle(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = TierFactory(
        slug="batch",
        sharing_mode="dedicated",
        priority_class=PriorityClassFactory(name="batch", value=10, preemptible=True),
    )
    fillers = [request(people["owner"], people["project"], batch, catalog["image"]) for _ in range(4)]
    ask(people, catalog, "mps", 2, mps_memory_mib=20480, mps_thread_pct=30)
    place_all()
    assert_published_state_is_the_database()
    for sandbox in fillers:
        sandbox.refresh_from_db()
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, timezone.now())

    # A preemption: the victim keeps its GPU while it stops (no longer preemptible), and the
    # request waits for it outside the queue.
    (urgent,) = ask(people, catalog, "dedicated")
    place_all()
    state = assert_published_state_is_the_database()
    stopping = Sandbox.objects.get(state="stopping")
    assert stopping.preempted_for_id == urgent.pk
    assert not next(r for r in state.running if r.sandbox_id == stopping.pk).preemptible
    assert urgent.pk not in {r.id for r in state.pending}

    # A placement the database refuses (a device taken meanwhile) stays queued.
    refused = ask(people, catalog, "mps", 2, mps_memory_mib=10240, mps_thread_pct=10)
    real_place = actions.do_place
    monkeypatch.setattr(
        actions,
        "do_place",
        lambda sandbox_id, *a, **kw: sandbox_id != refused[1].pk and real_place(sandbox_id, *a, **kw),
    )
    place_all()
    state = assert_published_state_is_the_database()
    assert Sandbox.objects.get(pk=refused[0].pk).state == "starting"
    assert [r.id for r in state.pending] == [refused[1].pk]


def test_the_queue_head_and_its_reservation_are_published(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workload, "MIN_OBSERVED", 2)  # publishes what is typical from a few requests
    ask(people, catalog, "dedicated", 4)
    place_all()
    head, behind = ask(people, catalog, "dedicated", 2, gpu_count=2)
    place_all()
    state = assert_published_state_is_the_database()
    assert [r.id for r in state.pending] == [head.pk, behind.pk]  # in the order the cycle took them
    assert state.reservation is not None and state.reservation.request_id == head.pk
    assert len(state.reservation.grants) == 2
    assert state.policy == "gpushare" and state.typical  # what the kept policy learned


def test_an_idle_cycle_publishes_at_once_when_the_fleet_changed(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """A host that joins, a GPU drained, a sandbox that ends: the next idle cycle publishes,
    not the next refresh (a fresh platform's first preview said "no GPU host is up")."""
    place_all()
    first = digest.latest()
    assert first is not None
    place_all()
    assert digest.latest().written_at == first.written_at  # type: ignore[union-attr]  # nothing changed
    seed_host("joined", "H100-80GB:2")
    place_all()
    joined = digest.latest()
    assert joined is not None and joined.written_at > first.written_at
    assert "joined" in [h.name for h in joined.snapshot().hosts]
    Gpu.objects.filter(host__name="joined", index=0).update(state=Gpu.State.DRAINED)
    place_all()
    drained = digest.latest()
    assert drained is not None and drained.written_at > joined.written_at
    [host] = [h for h in drained.snapshot().hosts if h.name == "joined"]
    assert [g.available for g in host.gpus] == [False, True]


def test_an_idle_cycle_refreshes_the_state_every_few_seconds(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert digest.latest() is None
    now = time.time()  # one cycle time throughout: the state's hash covers it
    schedule_once(now)  # nothing queued, nothing published yet: publishes
    first = digest.latest()
    assert first is not None and first.pending == [] and len(first.snapshot().hosts) == 2
    schedule_once(now)
    again = digest.latest()
    assert again is not None and again.written_at == first.written_at  # not yet due
    monkeypatch.setattr(digest, "IDLE_REFRESH_S", 0.0)
    time.sleep(0.01)
    schedule_once(now)
    later = digest.latest()
    assert later is not None and later.written_at > first.written_at
    assert later.hash == first.hash  # nothing changed: the web server keeps what it decoded


def test_a_digest_too_old_or_unreadable_is_not_used(monkeypatch: pytest.MonkeyPatch, fleet: Any) -> None:
    place_all()
    assert digest.latest() is not None
    assert digest.latest(max_age=-1) is None
    digest.clear()
    digest._redis().set(digest.META_KEY, b'{"hash": "x", "written_at": %f}' % time.time())
    digest._redis().set(digest.BODY_KEY, b'{"format": 0}')
    assert digest.latest() is None  # another layout: read as missing


def test_the_cycle_reports_where_its_time_went(
    fleet: Any, people: Any, catalog: Any, sent_tasks: Any
) -> None:
    ask(people, catalog, "dedicated")
    place_all()
    parts = set(scheduling.last_report.seconds)
    assert {"queue", "snapshot", "fairshare", "learn", "decide", "commit", "encode", "publish"} <= parts
    assert scheduling.last_report.placed == 1


def test_a_mirror_follows_new_states_host_by_host(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """The web server's fleet: a new state replaces only the hosts that changed, so the
    policy's scores for the others carry over, and keeps the holders whose rows are the same."""
    (whole,) = ask(people, catalog, "dedicated")
    place_all()
    ask(people, catalog, "dedicated", gpu_count=3)  # no host has three: it waits
    place_all()  # the holder now as the database dates it
    first = digest.latest()
    assert first is not None
    mirror = digest.Mirror()
    snapshot = mirror.follow(first)
    assert snapshot is not None and snapshot.hosts == first.snapshot().hosts
    hosts = {h.name: h for h in snapshot.hosts}
    holder = next(r for r in snapshot.running if r.sandbox_id == whole.pk)
    (share,) = ask(people, catalog, "mps", mps_memory_mib=1024, mps_thread_pct=10)  # the MPS GPU is on a100
    place_all()
    second = digest.latest()
    assert second is not None and second.hash != first.hash
    assert mirror.follow(second) is snapshot  # the same fleet, brought up to date
    assert snapshot.hosts == second.snapshot().hosts and snapshot.changes == ["a100"]
    assert {h.name for h in snapshot.hosts if h is hosts[h.name]} == {"h100"}
    assert next(r for r in snapshot.running if r.sandbox_id == whole.pk) is holder
    assert share.pk in {r.sandbox_id for r in snapshot.running}


def test_the_collector_is_held_off_while_one_holder_remains() -> None:
    import gc

    from scheduler.gc_pause import collection_paused

    assert gc.isenabled()
    with collection_paused():
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
