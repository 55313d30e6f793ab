"""In-app notifications and idle culling: who hears what, once, and an idle sandbox is
warned, then stopped with the reason recorded."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from portal.control.culling import do_cull_idle
from portal.control.faults import do_drain_gpu
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.models import Notification, Sandbox, StopCause
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def kinds(user: Any) -> list[str]:
    return list(
        Notification.objects.filter(user=user).order_by("created_at", "pk").values_list("kind", flat=True)
    )


def running(people: Any, catalog: Any, tier: str = "dedicated", **kw: Any) -> Sandbox:
    sandbox = request(people["owner"], people["project"], catalog[tier], catalog["image"], **kw)
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    sandbox.refresh_from_db()
    return sandbox


def test_the_owner_hears_of_starts_waits_and_ends_they_did_not_cause(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    owner = people["owner"]
    mine = running(people, catalog, gpu_count=2)
    running(people, catalog, gpu_count=2)
    assert kinds(owner) == ["started", "started"]
    waiting = request(owner, people["project"], catalog["dedicated"], catalog["image"], gpu_count=2)
    place_all()
    place_all()  # a second cycle refines the reason: no second notification
    [queued] = Notification.objects.filter(user=owner, kind="queued")
    assert queued.sandbox_id == waiting.pk and "waits: waiting for 2 free GPUs" in queued.message

    actions.do_request_stop(waiting.pk, owner)  # the owner's own stop: nothing to tell them
    actions.do_request_stop(mine.pk, people["admin"], "maintenance on the host")
    [by_admin] = Notification.objects.filter(user=owner, kind="ended")
    assert by_admin.message == f"Sandbox {mine.pk} is being stopped by ada: maintenance on the host"
    actions.do_mark_stopped(mine.allocation_key, timezone.now())
    assert Notification.objects.filter(user=owner, kind="ended").count() == 1  # told once

    other = Sandbox.objects.exclude(pk__in=[mine.pk, waiting.pk]).get()
    actions.do_mark_stopped(
        other.allocation_key, timezone.now(), "exited: out of memory: killed at the memory limit"
    )
    exited = Notification.objects.filter(user=owner, kind="ended").latest("pk")
    assert exited.message == f"Sandbox {other.pk}: exited: out of memory: killed at the memory limit"
    assert not Notification.objects.exclude(user=owner).exists()


def test_drains_and_quotas_are_told_to_those_they_touch(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=2, max_gpus=8)
    sandbox = running(people, catalog)
    assert "quota" not in kinds(people["owner"])
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    [quota] = Notification.objects.filter(user=people["owner"], kind="quota")
    assert quota.message == "Project Vision uses 2 of its 2 live sandboxes."
    gpu = sandbox.allocations.get().gpu
    do_drain_gpu(gpu.uuid, "fan failure", people["admin"])
    [drained] = Notification.objects.filter(user=people["owner"], kind="drained")
    assert (
        f"Sandbox {sandbox.pk}: its GPU ({gpu.host.name} #{gpu.index}) was taken out of service"
        in drained.message
    )
    assert "fan failure" in drained.message and "keeps running" in drained.message


def test_an_idle_sandbox_is_warned_then_stopped_and_use_resets_the_clock(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    tier = catalog["dedicated"]
    tier.idle_util_pct, tier.idle_minutes, tier.idle_grace_minutes = 5, 30, 10
    tier.save()
    assert tier.idle_rule == "stopped when GPU utilization stays under 5% for 40 min (warned after 30 min)"
    sandbox = running(people, catalog)
    t0 = timezone.now()

    def report(util: float, at: Any) -> None:
        Sandbox.objects.filter(pk=sandbox.pk).update(gpu_util_pct=util, gpu_util_window_s=600, gpu_util_at=at)

    report(2.0, t0)
    assert do_cull_idle(t0) == []
    sandbox.refresh_from_db()
    assert sandbox.idle_since == sandbox.started_at  # its window began before it started
    assert (
        do_cull_idle(t0 + timedelta(minutes=21)) == []
        and not Notification.objects.filter(kind="idle").exists()
    )
    report(50.0, t0 + timedelta(minutes=22))  # busy again: the clock restarts
    assert do_cull_idle(t0 + timedelta(minutes=22)) == []
    sandbox.refresh_from_db()
    assert sandbox.idle_since is None

    report(1.0, t0 + timedelta(minutes=30))
    do_cull_idle(t0 + timedelta(minutes=30))
    assert do_cull_idle(t0 + timedelta(minutes=51)) == []  # idle 31 min: warned, not stopped
    [warning] = Notification.objects.filter(kind="idle")
    assert "will be stopped at" in warning.message
    assert sandbox.events.filter(message__startswith="idle: GPU utilization under 5%").count() == 1
    assert do_cull_idle(t0 + timedelta(minutes=55)) == []  # warned once
    assert do_cull_idle(t0 + timedelta(minutes=61)) == [sandbox.pk]
    sandbox.refresh_from_db()
    assert sandbox.state == "stopping"
    assert sandbox.events.latest("pk").message.startswith("culled: GPU utilization under 5% for 41 min")
    assert [t[1] for t in sent_tasks if t[1] == "stop_sandbox"] == ["stop_sandbox"]
    actions.do_mark_stopped(sandbox.allocation_key, timezone.now())
    assert kinds(people["owner"])[-2:] == ["idle", "culled"]  # the stop's end adds nothing


def test_the_notifications_page_is_each_users_own(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    running(people, catalog)
    owner = client_for(people["owner"])
    page = owner.get("/notifications/")
    assert page.status_code == 200 and b"is running on" in page.content
    assert b'<span class="count">1</span>' in page.content
    assert b"is running on" not in client_for(people["outsider"]).get("/notifications/").content
    assert owner.post("/notifications/").status_code == 302
    assert not Notification.objects.filter(read_at=None).exists()
    assert b'class="count"' not in owner.get("/notifications/").content
    assert Client().get("/notifications/").status_code == 302


def test_why_a_sandbox_stopped_is_a_field_not_read_back_from_words(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """Issue 19: whom an end is told to, and whether it is called expired, came from the
    words or data of the stopping event (a message starting "culled", data "expired")."""
    owner = people["owner"]
    idle = running(people, catalog)
    actions.do_request_stop(idle.pk, None, "idle for a long while", cause=StopCause.CULLED)
    actions.do_mark_stopped(idle.allocation_key, timezone.now())
    idle.refresh_from_db()
    assert (idle.state, idle.stop_cause) == ("stopped", "culled")
    assert not Notification.objects.filter(user=owner, kind="ended").exists()  # culling told them

    gone = running(people, catalog)
    actions.do_mark_stopped(gone.allocation_key, timezone.now(), "exited with code 0")
    gone.refresh_from_db()
    assert (gone.state, gone.stop_cause) == ("stopped", "exited")
    assert Notification.objects.filter(user=owner, kind="ended", sandbox=gone).exists()
