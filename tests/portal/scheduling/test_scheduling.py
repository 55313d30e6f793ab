"""The portal's cycle with the fair-share scheduler: preemption, borrowing, durations."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from portal.scheduling.snapshot import build_queue, build_snapshot
from tests.factories import PriorityClassFactory, TierFactory
from tests.portal.helpers import place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


@pytest.fixture
def batch(catalog: Any) -> Any:
    return TierFactory(
        slug="batch",
        sharing_mode="dedicated",
        priority_class=PriorityClassFactory(name="batch", value=10, preemptible=True),
    )


def run(sandbox: Sandbox) -> None:
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, timezone.now())


def test_preemption_waits_for_the_victim_to_stop(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: list[Any]
) -> None:
    owner, image = people["owner"], catalog["image"]
    fillers = [request(owner, people["project"], batch, image) for _ in range(4)]  # 4 dedicated GPUs
    place_all()
    for sandbox in fillers:
        run(sandbox)
    assert [Sandbox.objects.get(pk=f.pk).state for f in fillers] == ["running"] * 4
    urgent = request(people["outsider"], people["other_project"], catalog["dedicated"], image)
    place_all()
    urgent.refresh_from_db()
    victims = list(Sandbox.objects.filter(preempted_for=urgent))
    assert len(victims) == 1 and victims[0].state == "stopping"  # the fewest victims
    assert urgent.state == "queued" and f"preempted sandbox {victims[0].pk}" in urgent.pending_reason
    assert [a[1] for _, t, a in sent_tasks if t == "stop_sandbox"] == [victims[0].pk]

    # While the victim stops, its GPU stays booked and no second victim is chosen.
    assert urgent.pk not in [r.id for r in build_queue()]
    place_all()
    assert Sandbox.objects.filter(state="stopping").count() == 1

    actions.do_mark_stopped(victims[0].allocation_key, timezone.now())
    victims[0].refresh_from_db()
    last_event = victims[0].events.last()
    assert victims[0].state == "preempted" and last_event is not None and last_event.to_state == "preempted"
    place_all()
    urgent.refresh_from_db()
    assert urgent.state == "starting"
    assert urgent.allocations.get().gpu_id == victims[0].allocations.get().gpu_id


def test_non_preemptible_work_is_never_a_victim(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    owner, image = people["owner"], catalog["image"]
    holders = [request(owner, people["project"], catalog["dedicated"], image) for _ in range(4)]
    place_all()
    for sandbox in holders:
        run(sandbox)
    urgent = request(people["outsider"], people["other_project"], catalog["dedicated"], image)
    place_all()
    urgent.refresh_from_db()
    assert urgent.state == "queued" and not Sandbox.objects.filter(state="stopping").exists()


def test_capacity_above_the_guarantee_is_marked_borrowed(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    QuotaPolicy.objects.create(project=people["project"], guaranteed_gpus=1, max_gpus=4)
    first = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    second = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.borrowed, second.borrowed) == (False, True)
    running = {r.sandbox_id: r for r in build_snapshot().running}
    assert running[second.pk].borrowed and not running[first.pk].borrowed
    assert running[first.pk].ends_at is not None


def test_requests_carry_their_duration(people: Any, catalog: Any, sent_tasks: Any) -> None:
    request(
        people["owner"],
        people["project"],
        catalog["dedicated"],
        catalog["image"],
        duration=timedelta(hours=2),
    )
    assert [r.max_duration_s for r in build_queue()] == [7200.0]


def test_a_host_is_never_promised_more_cpu_or_memory_than_it_has(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    from portal.fleet.models import Host

    Host.objects.update(cpu_cores=1, memory_mib=512)  # each tier sandbox takes 0.5 core, 256 MiB
    sandboxes = [
        request(people["owner"], people["project"], catalog["timeslice"], catalog["image"]) for _ in range(4)
    ]
    place_all()
    states = sorted(Sandbox.objects.filter(pk__in=[s.pk for s in sandboxes]).values_list("state", flat=True))
    assert states == ["queued", "queued", "starting", "starting"]  # the time-slice host holds two
    waiting = Sandbox.objects.filter(state="queued").first()
    assert waiting is not None and "free on a100, but without 0.5 CPU cores" in waiting.pending_reason
    snapshot = build_snapshot()
    a100 = next(h for h in snapshot.hosts if h.name == "a100")
    assert (a100.cpu_used_milli, a100.memory_used_mib) == (1000, 512)
