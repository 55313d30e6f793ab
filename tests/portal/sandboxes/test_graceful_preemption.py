"""Graceful preemption, per tier: a minimum runtime, a warning ``preempt_grace`` before the
stop (owner told, the agent asked to signal the sandbox and run the checkpoint hook), and
the victim queued again when its tier says so."""

from __future__ import annotations

import math
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.catalog.models import Storage
from portal.sandboxes import actions, preemption
from portal.sandboxes.models import Notification, Sandbox
from portal.scheduling.preview import preview_request
from portal.scheduling.snapshot import build_queue, build_snapshot
from tests.factories import PriorityClassFactory, TierFactory
from tests.portal.helpers import client_for, place_all, request
from wire.spec import SandboxSpec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]
GRACE = timedelta(seconds=90)


@pytest.fixture
def batch(catalog: Any) -> Any:
    """Preemptible batch work, safe for its first 10 minutes, warned 90 s before its stop."""
    return TierFactory(
        slug="batch",
        sharing_mode="dedicated",
        priority_class=PriorityClassFactory(name="batch", value=10, preemptible=True),
        preempt_after=timedelta(minutes=10),
        preempt_grace=GRACE,
    )


def fill_with(people: Any, catalog: Any, tier: Any, running_for: timedelta) -> list[Sandbox]:
    """Every dedicated GPU of the fleet taken by ``tier``'s sandboxes, running since
    ``running_for`` ago."""
    fillers = [request(people["owner"], people["project"], tier, catalog["image"]) for _ in range(4)]
    place_all()
    started = timezone.now() - running_for
    for sandbox in fillers:
        sandbox.refresh_from_db()
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, started)
    return fillers


def urgent_request(people: Any, catalog: Any) -> Sandbox:
    urgent = request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    place_all()
    urgent.refresh_from_db()
    return urgent


def warned_victim(urgent: Sandbox) -> Sandbox:
    victims = list(Sandbox.objects.filter(preempted_for=urgent))
    assert len(victims) == 1, victims
    return victims[0]


def preempt_one(people: Any, catalog: Any, batch: Any) -> tuple[Sandbox, Sandbox]:
    """The fleet full of batch work running for an hour, and an urgent request: (the
    request, the one victim chosen for it)."""
    fill_with(people, catalog, batch, running_for=timedelta(hours=1))
    urgent = urgent_request(people, catalog)
    return urgent, warned_victim(urgent)


def report_stopped(sandbox: Sandbox, message: str = "stopped") -> Sandbox:
    actions.do_mark_stopped(sandbox.allocation_key, timezone.now(), message)
    sandbox.refresh_from_db()
    return sandbox


def assert_starts(request_: Sandbox) -> None:
    place_all()
    request_.refresh_from_db()
    assert request_.state == "starting"


def deadline(victim: Sandbox) -> datetime:
    assert victim.preempt_at is not None
    return victim.preempt_at


def test_nothing_is_preempted_in_its_minimum_runtime(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    fillers = fill_with(people, catalog, batch, running_for=timedelta(minutes=9))
    urgent = urgent_request(people, catalog)
    assert urgent.state == "queued" and not Sandbox.objects.filter(preempted_for=urgent).exists()
    assert not [t for _, t, _ in sent_tasks if t in ("warn_sandbox", "stop_sandbox")]

    # Two minutes later the fillers are past their 10 minutes: one is preempted.
    Sandbox.objects.filter(pk__in=[f.pk for f in fillers]).update(
        started_at=timezone.now() - timedelta(minutes=11)
    )
    place_all()
    assert warned_victim(urgent).state == "running"


def test_a_victim_is_warned_runs_out_its_grace_then_stops(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    fill_with(people, catalog, batch, running_for=timedelta(hours=1))
    before = timezone.now()
    urgent = urgent_request(people, catalog)
    victim = warned_victim(urgent)

    # Warned: it runs on, its owner is told when it stops, its host is asked to warn it.
    assert victim.state == "running" and victim.stop_cause == "preempted"
    assert victim.preempt_at is not None and before + GRACE <= victim.preempt_at <= timezone.now() + GRACE
    told = Notification.objects.filter(user=people["owner"], sandbox=victim).first()  # the newest
    assert told is not None and told.kind == "preempted" and "Save your work now" in told.message
    warns = [a for _, t, a in sent_tasks if t == "warn_sandbox"]
    assert warns == [(victim.allocation_key, victim.pk, victim.handle, victim.preempt_at.timestamp())]
    assert not [t for _, t, _ in sent_tasks if t == "stop_sandbox"]
    assert "preemption warning" in str(victim.events.values_list("message", flat=True).last())
    page = client_for(people["owner"]).get(f"/sandboxes/{victim.pk}/").content.decode()
    assert 'id="preempt-warning"' in page and "Save your work now" in page

    # Meanwhile the request waits out of the queue, no second victim is chosen, and the
    # plan sees the victim's GPU free at the end of the grace period, not at its time limit.
    assert urgent.pk not in [r.id for r in build_queue()]
    place_all()
    assert Sandbox.objects.filter(preempted_for__isnull=False).count() == 1
    planned = next(r for r in build_snapshot().running if r.sandbox_id == victim.pk)
    assert planned.ends_at == victim.preempt_at.timestamp() and not planned.preemptible
    assert planned.preemptible_at == math.inf  # promised away: not even a reclaim may take it

    assert preemption.do_stop_warned(timezone.now()) == []  # not yet
    assert preemption.do_stop_warned(deadline(victim)) == [victim.pk]
    victim.refresh_from_db()
    assert victim.state == "stopping"
    assert [a[1] for _, t, a in sent_tasks if t == "stop_sandbox"] == [victim.pk]

    assert report_stopped(victim).state == "preempted"
    assert_starts(urgent)


def test_a_victim_that_exits_at_its_warning_ends_preempted(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    urgent, victim = preempt_one(people, catalog, batch)
    assert report_stopped(victim, "exited with code 143").state == "preempted"
    assert [e.message for e in victim.events.all()][-2] == "it exited at its preemption warning"
    assert_starts(urgent)


def test_a_requeued_victim_waits_again_and_runs_after_with_its_files(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    batch.requeue_on_preemption = True
    batch.save()
    batch.storages.set(
        [Storage.objects.create(name="home", kind="home", directory="homes", mount_path="/home/sandbox")]
    )
    urgent, victim = preempt_one(people, catalog, batch)
    preemption.do_stop_warned(deadline(victim))
    victim.refresh_from_db()
    victim = report_stopped(victim)
    assert victim.state == "queued" and victim.host is None and victim.allocation_key == ""
    assert victim.preempted_for is None and victim.preempt_at is None and victim.stop_cause == ""
    assert not victim.allocations.filter(active=True).exists()
    last = Notification.objects.filter(sandbox=victim).first()
    assert last is not None and last.kind == "preempted" and "queued again" in last.message
    place_all()
    urgent.refresh_from_db()
    victim.refresh_from_db()
    assert urgent.state == "starting" and victim.state == "queued"  # the GPU went to the urgent one

    actions.do_mark_running(urgent.allocation_key, {"driver": "docker", "ref": "u"}, timezone.now())
    actions.do_request_stop(urgent.pk, people["outsider"])
    urgent.refresh_from_db()
    report_stopped(urgent)
    assert_starts(victim)  # queued again, it runs again
    # On whichever host, it mounts the same home: the files it wrote before are there.
    launches = [SandboxSpec.from_json(a[0]) for _, t, a in sent_tasks if t == "launch_sandbox"]
    first, again = [spec.mounts for spec in launches if spec.sandbox_id == victim.pk]
    assert first == again and [m.source for m in first] == [f"homes/{victim.owner_id}"]


def test_the_warning_is_called_off_when_the_request_is_withdrawn(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    urgent, victim = preempt_one(people, catalog, batch)
    actions.do_request_stop(urgent.pk, people["outsider"])

    assert preemption.do_stop_warned(deadline(victim)) == []
    victim.refresh_from_db()
    assert victim.state == "running" and victim.preempt_at is None and victim.preempted_for is None
    assert "preemption called off" in str(victim.events.values_list("message", flat=True).last())
    assert "called off" in str(
        Notification.objects.filter(sandbox=victim).values_list("message", flat=True).first()
    )
    assert not [t for _, t, _ in sent_tasks if t == "stop_sandbox"]


def test_a_warned_victim_is_not_moved_and_ends_preempted_if_its_host_is_lost(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    batch.requeue_on_preemption = True
    batch.save()
    urgent, victim = preempt_one(people, catalog, batch)
    assert not actions.do_begin_move(victim.pk, plan_id=1)  # it stops soon: no plan moves it
    assert actions.do_lose(victim.pk, "host lost") == "queued"  # as its preemption would end
    victim.refresh_from_db()
    assert victim.preempted_for is None and victim.stop_cause == ""
    assert_starts(urgent)


def test_a_warning_whose_request_is_gone_is_called_off(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    urgent, victim = preempt_one(people, catalog, batch)
    Sandbox.objects.filter(pk=urgent.pk).delete()
    assert preemption.do_stop_warned(deadline(victim)) == []
    victim.refresh_from_db()
    assert victim.state == "running" and victim.preempt_at is None and victim.stop_cause == ""


def test_an_owner_who_stops_a_warned_sandbox_ends_it_stopped_not_requeued(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    batch.requeue_on_preemption = True
    batch.save()
    urgent, victim = preempt_one(people, catalog, batch)
    actions.do_request_stop(victim.pk, people["owner"])
    victim.refresh_from_db()
    assert report_stopped(victim).state == "stopped"
    assert_starts(urgent)


def test_a_tier_without_grace_stops_its_victim_at_once(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    batch.preempt_grace = timedelta(0)
    batch.save()
    _, victim = preempt_one(people, catalog, batch)
    assert victim.state == "stopping" and victim.preempt_at is None
    assert not [t for _, t, _ in sent_tasks if t == "warn_sandbox"]


def test_the_live_answer_counts_the_victims_warning_and_minimum_runtime(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    urgent = actions.SandboxRequest(
        project=people["other_project"],
        tier=catalog["dedicated"],
        image=catalog["image"],
        isolation="container",
    )
    fill_with(people, catalog, batch, running_for=timedelta(minutes=1))
    place_all()  # publishes what the preview reads
    assert preview_request(people["outsider"], urgent).verdict == "waits"  # all in their first 10 min
    answer = preview_request(people["outsider"], urgent, now=time.time() + 10 * 60)  # the same, later
    assert answer.verdict == "now"
    assert answer.message.endswith("have stopped, within 90 s (their warning before the stop)"), (
        answer.message
    )


def test_the_request_form_states_the_tiers_preemption(batch: Any) -> None:
    batch.requeue_on_preemption = True
    assert batch.preemption_rule == (
        "preemptible after 10 min of running, warned 90 s before the stop, then queued again"
    )
