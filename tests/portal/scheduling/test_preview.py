"""The request form's live answer: starts now, or waits with a place, an ETA and
alternatives, or is refused naming the rule; computed by the scheduler, nothing written."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from portal.scheduling import digest, preview
from portal.scheduling.preview import Preview, preview_request
from tests.factories import PriorityClassFactory, TierFactory
from tests.portal.helpers import client_for, place_all, request, request_form

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def ask(people: Any, catalog: Any, tier: str, **kw: Any) -> actions.SandboxRequest:
    return actions.SandboxRequest(
        project=people["project"], tier=catalog[tier], image=catalog["image"], isolation="container", **kw
    )


def running(people: Any, catalog: Any, tier: str, **kw: Any) -> Sandbox:
    sandbox = request(people["owner"], people["project"], catalog[tier], catalog["image"], **kw)
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    sandbox.refresh_from_db()
    assert sandbox.state == "running"
    return sandbox


def test_a_request_that_fits_starts_now_and_nothing_is_written(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    answer = preview_request(people["owner"], ask(people, catalog, "dedicated", gpu_count=2))
    assert (
        answer.verdict == "now" and answer.message.startswith("starts now on ") and len(answer.devices) == 2
    )
    assert not Sandbox.objects.exists() and sent_tasks == []


def test_a_full_fleet_gives_a_place_an_eta_and_alternatives(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    first = running(people, catalog, "dedicated", gpu_count=2)
    running(people, catalog, "dedicated", gpu_count=2)  # every dedicated GPU is taken
    queued = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_count=2)
    place_all()
    assert Sandbox.objects.get(pk=queued.pk).state == "queued"

    answer = preview_request(people["owner"], ask(people, catalog, "dedicated", gpu_count=1))
    assert answer.verdict == "waits" and answer.position == 2  # behind the queued one
    assert "waiting for 1 free GPU on one host" in answer.message
    assert first.started_at is not None and answer.eta is not None
    assert abs(answer.eta - (first.started_at + timedelta(hours=8))) < timedelta(seconds=5)

    for _ in range(4):  # every 1g.10gb slice of the two MIG GPUs
        running(people, catalog, "mig", mig_profile="1g.10gb")
    answer = preview_request(people["owner"], ask(people, catalog, "mig", mig_profile="1g.10gb"))
    assert answer.verdict == "waits" and answer.position == 2
    assert answer.alternatives == [
        "a 3g.40gb slice is free now on h100",
        "a 2g.20gb slice is free now on h100",
    ]


def test_mps_alternative_and_refusal_naming_the_quota(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    running(people, catalog, "mps", mps_memory_mib=61440, mps_thread_pct=50)
    answer = preview_request(
        people["owner"], ask(people, catalog, "mps", mps_memory_mib=40960, mps_thread_pct=20)
    )
    assert answer.verdict == "waits"
    assert answer.alternatives == ["an MPS share of up to 20 GiB and 50% of the threads is free now on a100"]
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=1)
    answer = preview_request(people["owner"], ask(people, catalog, "timeslice"))
    assert answer.verdict == "refused" and "quota of 1 live sandboxes" in answer.message


def test_the_preview_endpoint_answers_the_form(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    form = request_form(people, catalog, duration_hours="2")
    page = client_for(people["owner"]).post("/sandboxes/preview/", form)
    assert page.status_code == 200
    assert b"Starts now on " in page.content and b"2.50 EUR/GPU-h" in page.content
    outsider = client_for(people["outsider"]).post("/sandboxes/preview/", form)
    assert b"would be refused" in outsider.content and b"Project: Select a valid choice" in outsider.content
    assert client_for(people["owner"]).get("/sandboxes/preview/").status_code == 405
    from django.test import Client

    assert Client().post("/sandboxes/preview/", form).status_code == 302  # to the login page


def test_a_form_not_filled_in_yet_is_not_called_refused(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """The preview runs when the page loads, before anything is chosen."""
    owner = client_for(people["owner"])
    page = owner.post("/sandboxes/preview/", {"isolation": "container", "duration_hours": "1"})
    text = page.content.decode()
    assert "verdict-incomplete" in text and "refused" not in text
    assert "Choose a project, a tier and an image to see whether it would start now." in text
    form = request_form(people, catalog)
    del form["image"]
    assert "Choose an image to see whether" in owner.post("/sandboxes/preview/", form).content.decode()


@pytest.mark.parametrize(
    ("drivers", "chosen"),
    [
        (("docker", "process"), "container"),
        (("process",), "process"),
        (("libvirt",), "vm"),
        ((), "container"),
    ],
)
def test_the_form_opens_on_an_isolation_a_host_gives(
    people: Any, drivers: tuple[str, ...], chosen: str
) -> None:
    """make run on a machine without Docker has only bubblewrap hosts: a form opening on
    *container* would have a newcomer's first request wait for a host that never comes."""
    from tests.conftest import seed_host

    for number, driver in enumerate(drivers):
        seed_host(f"h{number}", "A100-80GB:1", driver=driver)
    page = client_for(people["owner"]).get("/sandboxes/new/").content.decode()
    assert f'<option value="{chosen}" selected>' in page


def both_ways(
    user: Any, req: actions.SandboxRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[Preview, Preview]:
    """The answer from the state the last cycle published, and the one read afresh from the
    database (what the preview does when the control worker is down)."""
    now = time.time()
    assert digest.latest() is not None
    reads: list[int] = []
    real_build = preview.build_snapshot

    def build_snapshot() -> Any:
        reads.append(1)
        return real_build()

    monkeypatch.setattr(preview, "build_snapshot", build_snapshot)
    published = preview_request(user, req, now)
    assert reads == []  # one placement attempt on the published state, no database snapshot
    with monkeypatch.context() as stale:
        stale.setattr(digest, "max_age_s", lambda: -1.0)
        fresh = preview_request(user, req, now)
    assert reads == [1]
    return published, fresh


def assert_same(published: Preview, fresh: Preview) -> Preview:
    assert (published.verdict, published.message, published.position, published.alternatives) == (
        fresh.verdict,
        fresh.message,
        fresh.position,
        fresh.alternatives,
    )
    assert (published.host, published.devices) == (fresh.host, fresh.devices)
    assert (published.eta is None) == (fresh.eta is None)
    if published.eta is not None and fresh.eta is not None:
        assert abs(published.eta - fresh.eta) < timedelta(seconds=5)
    return published


def test_the_last_cycles_state_answers_as_the_database_would(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = people["owner"]
    place_all()  # an idle cycle publishes the empty fleet
    answer = assert_same(*both_ways(owner, ask(people, catalog, "dedicated", gpu_count=2), monkeypatch))
    assert answer.verdict == "now"

    batch = TierFactory(
        slug="batch",
        sharing_mode="dedicated",
        priority_class=PriorityClassFactory(name="batch", value=10, preemptible=True),
    )
    running(people, catalog, "dedicated", gpu_count=2)
    for _ in range(2):
        filler = request(owner, people["project"], batch, catalog["image"])
        place_all()
        filler.refresh_from_db()
        actions.do_mark_running(filler.allocation_key, {"driver": "docker", "ref": "b"}, timezone.now())
    # A higher-priority request may take a preemptible sandbox's GPU.
    answer = assert_same(*both_ways(owner, ask(people, catalog, "dedicated"), monkeypatch))
    assert "once 1 preemptible sandbox(es) have stopped" in answer.message


def test_behind_the_queue_head_the_last_cycles_state_answers_as_the_database_would(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A place in the queue, the head's reservation, an ETA, backfill, alternatives."""
    owner = people["owner"]
    first, *others = [running(people, catalog, "dedicated") for _ in range(4)]
    beside = next(s for s in others if s.host_id == first.host_id)
    actions.do_request_stop(beside.pk, owner)
    beside.refresh_from_db()
    actions.do_mark_stopped(beside.allocation_key, timezone.now())
    for _ in range(4):
        running(people, catalog, "mig", mig_profile="1g.10gb")
    # The head needs two GPUs: the one free now and the one ``first`` frees at its end.
    head = request(owner, people["project"], catalog["dedicated"], catalog["image"], gpu_count=2)
    place_all()
    state = digest.latest()
    assert state is not None and state.reservation is not None and state.reservation.request_id == head.pk
    answer = assert_same(*both_ways(owner, ask(people, catalog, "dedicated"), monkeypatch))
    assert answer.verdict == "waits" and answer.position == 2
    assert answer.message.startswith(
        f"reserved: the capacity that fits it is held for the older request #{head.pk}"
    )
    answer = assert_same(*both_ways(owner, ask(people, catalog, "dedicated", gpu_count=2), monkeypatch))
    assert answer.verdict == "waits" and answer.position == 2 and answer.eta is not None
    short = ask(people, catalog, "dedicated", duration=timedelta(minutes=30))
    assert assert_same(*both_ways(owner, short, monkeypatch)).verdict == "now"  # ends before the head starts
    answer = assert_same(*both_ways(owner, ask(people, catalog, "mig", mig_profile="1g.10gb"), monkeypatch))
    assert answer.verdict == "waits" and answer.alternatives
    mps = ask(people, catalog, "mps", mps_memory_mib=20480, mps_thread_pct=30)
    assert assert_same(*both_ways(owner, mps, monkeypatch)).verdict == "now"
    QuotaPolicy.objects.create(project=people["project"], max_gpus=3)
    place_all()
    answer = assert_same(*both_ways(owner, ask(people, catalog, "dedicated"), monkeypatch))
    assert answer.verdict == "waits" and answer.message.startswith("quota: ")
