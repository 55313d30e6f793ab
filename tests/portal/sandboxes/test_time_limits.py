"""Time limits: a sandbox is warned before its limit, stopped at it (ending ``expired``),
and can be extended within its tier's maximum by those who manage it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.sandboxes import actions
from portal.sandboxes.models import Notification, Sandbox
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def running(people: Any, catalog: Any, hours: int = 1, started_ago: timedelta = timedelta(0)) -> Sandbox:
    sandbox = request(
        people["owner"],
        people["project"],
        catalog["dedicated"],
        catalog["image"],
        duration=timedelta(hours=hours),
    )
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(
        sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now() - started_ago
    )
    sandbox.refresh_from_db()
    return sandbox


def test_extending_within_the_tier_and_not_beyond(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog)
    assert actions.do_extend(sandbox.pk, people["owner"], timedelta(hours=2)) == timedelta(hours=3)
    assert sandbox.events.filter(message="time limit extended by 2 h to 3 h").exists()
    with pytest.raises(actions.SandboxRequestError) as err:
        actions.do_extend(sandbox.pk, people["owner"], timedelta(hours=8))
    assert err.value.field == "duration"
    assert err.value.message == (
        "The tier Dedicated allows at most 8 h per sandbox; this one has 3 h, so it can get at most 5 h more."
    )
    assert Sandbox.objects.get(pk=sandbox.pk).max_duration == timedelta(hours=3)


def test_the_extend_button_is_for_those_who_manage_the_sandbox(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog)
    url = f"/sandboxes/{sandbox.pk}/extend/"
    assert client_for(people["owner"]).post(url, {"hours": "2"}).status_code == 302
    assert Sandbox.objects.get(pk=sandbox.pk).max_duration == timedelta(hours=3)
    assert client_for(people["member"]).post(url, {"hours": "1"}).status_code == 403
    assert client_for(people["outsider"]).post(url, {"hours": "1"}).status_code == 404
    bad = client_for(people["admin"]).post(url, {"hours": "3"}, HTTP_HX_REQUEST="true")
    assert bad.status_code == 400 and b"Extend by one of 1, 2, 4, 8 hours." in bad.content
    too_long = client_for(people["owner"]).post(url, {"hours": "8"}, HTTP_HX_REQUEST="true")
    assert too_long.status_code == 400 and b"at most 5 h more" in too_long.content
    page = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/status/")
    assert b'id="extend-form"' in page.content
    device = sandbox.allocations.get(active=True).device_uuid
    assert f"NVIDIA_VISIBLE_DEVICES={device}".encode() in page.content and b"Network: none" in page.content
    assert (
        b'id="extend-form"'
        not in client_for(people["member"]).get(f"/sandboxes/{sandbox.pk}/status/").content
    )


def test_a_sandbox_is_warned_then_expires_at_its_limit(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    soon = running(people, catalog, hours=1, started_ago=timedelta(minutes=50))
    over = running(people, catalog, hours=1, started_ago=timedelta(minutes=61))
    now = timezone.now()
    assert actions.do_expire_overdue(now) == [over.pk]
    assert actions.do_expire_overdue(now) == []  # stopping already: sent once
    [warning] = Notification.objects.filter(sandbox=soon, kind="expiring")
    assert "reaches its time limit at" in warning.message and "extend it" in warning.message
    actions.do_expire_overdue(now)
    assert Notification.objects.filter(sandbox=soon, kind="expiring").count() == 1  # warned once
    actions.do_extend(soon.pk, people["owner"], timedelta(hours=1))
    assert Sandbox.objects.get(pk=soon.pk).expiry_warned_at is None  # a new limit, a new warning

    over.refresh_from_db()
    assert over.state == "stopping" and [t[2][0] for t in sent_tasks if t[1] == "stop_sandbox"] == [
        over.allocation_key
    ]
    actions.do_mark_stopped(over.allocation_key, timezone.now())
    over.refresh_from_db()
    assert (
        over.state == "expired" and over.events.latest("pk").message == "expired: it reached its time limit"
    )
    assert Notification.objects.filter(sandbox=over, kind="ended").exists()
