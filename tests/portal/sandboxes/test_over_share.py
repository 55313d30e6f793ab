"""GPU memory shares on shared GPUs: what the launch spec says a sandbox may hold, and what the
portal does with its agent's report that it holds more (``sandbox_over_share``): the owner
warned with the figures, the sandbox stopped with the reason recorded and billed to the stop,
the warning cleared, and stale or malformed reports ignored."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.catalog.models import Tier
from portal.control import tasks
from portal.sandboxes import actions
from portal.sandboxes.models import Notification, Sandbox, SandboxEvent
from portal.sandboxes.specs import launch_spec
from tests.portal.helpers import client_for, place_all, request
from wire.spec import MemoryShare, SandboxSpec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]
GIB = 1024


def running(people: Any, catalog: Any, tier: str, **kw: Any) -> Sandbox:
    sandbox = request(people["owner"], people["project"], catalog[tier], catalog["image"], **kw)
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, timezone.now())
    sandbox.refresh_from_db()
    assert sandbox.state == "running", sandbox.failure
    return sandbox


def report(sandbox: Sandbox, action: str, mem_mib: int, **kw: Any) -> dict[str, Any]:
    gpu = sandbox.allocations.get(active=True).device_uuid
    return {
        "sandbox_id": sandbox.pk,
        "allocation_key": sandbox.allocation_key,
        "gpu": gpu,
        "mem_mib": mem_mib,
        "share_mib": 20 * GIB,
        "since_ms": int(time.time() * 1000) - 5000,
        "action": action,
        **kw,
    }


def notes(sandbox: Sandbox) -> list[str]:
    return list(
        Notification.objects.filter(sandbox=sandbox, kind="over_share")
        .order_by("pk")
        .values_list("message", flat=True)
    )


# --- the launch spec -----------------------------------------------------------------------------


def test_an_mps_share_is_watched_against_the_memory_it_asked_for(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog, "mps", mps_memory_mib=20 * GIB, mps_thread_pct=25)
    spec = launch_spec(sandbox)
    assert spec.memory_share == MemoryShare("mps", 20 * GIB, 0, over_share="stop", grace_s=120)
    assert SandboxSpec.from_json(spec.to_json()).memory_share == spec.memory_share  # as the agent reads it


def test_a_time_slice_replica_is_watched_against_the_gpus_memory_over_its_replicas(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    Tier.objects.filter(slug="timeslice").update(over_share="warn", over_share_grace=timedelta(seconds=30))
    catalog["timeslice"].refresh_from_db()
    sandbox = running(people, catalog, "timeslice")
    gpu = sandbox.allocations.get(active=True).gpu
    assert (gpu.memory_mib, gpu.timeslice_replicas) == (81920, 4)
    share = launch_spec(sandbox).memory_share
    assert share == MemoryShare("timeslice", 20480, 4, over_share="warn", grace_s=30)
    [(_, _, (sent,))] = [t for t in sent_tasks if t[1] == "launch_sandbox"]
    assert sent["memory_share"] == {
        "kind": "timeslice", "memory_mib": 20480, "replicas": 4, "over_share": "warn", "grace_s": 30
    }  # fmt: skip


def test_a_gpu_of_its_own_has_no_share_to_watch(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    assert launch_spec(running(people, catalog, "dedicated")).memory_share is None
    assert launch_spec(running(people, catalog, "mig", mig_profile="3g.40gb")).memory_share is None


# --- the agent's reports ---------------------------------------------------------------------------


def test_over_its_share_the_owner_is_warned_at_once_with_the_figures_and_the_rule(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog, "timeslice")
    tasks.sandbox_over_share("a100", report(sandbox, "warn", 23_654))  # type: ignore[arg-type]
    tasks.sandbox_over_share("a100", report(sandbox, "warn", 24_000))  # type: ignore[arg-type]
    sandbox.refresh_from_db()
    [message] = notes(sandbox)  # once per time over, however many reports
    gpu = sandbox.allocations.get(active=True).device_uuid
    assert message.startswith(
        f"Sandbox {sandbox.pk} holds 23.1 GiB of its 20.0 GiB share of GPU memory on {gpu}; "
    )
    assert "under the tier's rule it is stopped after 2 min" in message and "if it stays over" in message
    assert sandbox.state == "running" and sandbox.over_share_mib == 24_000
    assert [t for t in sent_tasks if t[1] == "email_notifications"]  # mailed too (a default kind)
    page = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/status/").content.decode()
    assert 'id="over-share-warning"' in page and "holds 23.4 GiB of its 20.0 GiB" in page, page
    assert "It is stopped at" in page
    assert (
        SandboxEvent.objects.filter(sandbox=sandbox, message__startswith="over its GPU memory share").count()
        == 1
    )


def test_back_within_its_share_the_warning_is_cleared(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog, "timeslice")
    tasks.sandbox_over_share("a100", report(sandbox, "warn", 23_000))  # type: ignore[arg-type]
    tasks.sandbox_over_share("a100", report(sandbox, "clear", 12_000))  # type: ignore[arg-type]
    sandbox.refresh_from_db()
    assert sandbox.over_share_since is None and sandbox.state == "running"
    page = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/status/").content.decode()
    assert "over-share-warning" not in page
    assert SandboxEvent.objects.filter(
        sandbox=sandbox, message__startswith="back within its GPU memory share"
    ).exists()
    tasks.sandbox_over_share("a100", report(sandbox, "warn", 22_000))  # type: ignore[arg-type]
    assert len(notes(sandbox)) == 2  # a new time over is a new warning


def test_over_its_share_past_the_grace_it_is_stopped_with_the_reason_and_billed_to_the_stop(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog, "timeslice")
    neighbour = running(people, catalog, "timeslice")
    since_ms = int(time.time() * 1000) - 130_000  # over since 2 min 10 s ago: past the grace
    tasks.sandbox_over_share("a100", report(sandbox, "warn", 23_000, since_ms=since_ms))  # type: ignore[arg-type]
    tasks.sandbox_over_share("a100", report(sandbox, "stop", 23_500, since_ms=since_ms))  # type: ignore[arg-type]
    sandbox.refresh_from_db()
    assert (sandbox.state, sandbox.stop_cause) == ("stopping", "over_share")
    stops = [t for t in sent_tasks if t[1] == "stop_sandbox"]
    assert [args[0] for _, _, args in stops] == [sandbox.allocation_key]  # the neighbour runs on
    stopping = SandboxEvent.objects.get(sandbox=sandbox, to_state="stopping").message
    assert stopping.startswith("stopped: held 22.9 GiB, over its 20.0 GiB GPU memory share on GPU-"), stopping
    assert "for 2 min" in stopping and "(tier Timeslice)" in stopping
    assert notes(sandbox)[-1] == f"Sandbox {sandbox.pk} was {stopping}."

    stopped_at = timezone.now()
    actions.do_mark_stopped(sandbox.allocation_key, stopped_at, "stopped")  # its host's report
    sandbox.refresh_from_db()
    assert sandbox.state == "stopped"
    [usage] = UsageRecord.objects.filter(sandbox=sandbox)
    assert usage.ended_at == stopped_at and usage.cost_micros is not None
    assert usage.duration == stopped_at - usage.started_at  # not a microsecond beyond the stop
    ended = Notification.objects.filter(sandbox=sandbox, kind="ended")
    assert not ended.exists()  # told once, with the figures, when it was stopped
    page = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/").content.decode()
    assert (
        'id="over-share-stop"' in page
        and "Stopped: it held 22.9 GiB of its 20.0 GiB share for 2 min 10 s" in page
    )
    assert stopping in page  # its history
    neighbour.refresh_from_db()
    assert neighbour.state == "running"


def test_a_stop_under_a_tier_that_now_only_warns_warns(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog, "mps", mps_memory_mib=20 * GIB, mps_thread_pct=25)
    Tier.objects.filter(slug="mps").update(over_share="warn")
    tasks.sandbox_over_share("a100", report(sandbox, "stop", 30_000))  # type: ignore[arg-type]
    sandbox.refresh_from_db()
    assert sandbox.state == "running" and sandbox.over_share_since is not None
    assert "its tier only warns" in notes(sandbox)[0]
    assert not [t for t in sent_tasks if t[1] == "stop_sandbox"]


@pytest.mark.parametrize(
    "change",
    [
        {"allocation_key": "an-earlier-placement"},
        {"sandbox_id": 999_999},
        {"gpu": "GPU-not-its-own"},
        {"action": "explode"},
        {"mem_mib": "lots"},
        {"mem_mib": -1},
        {"since_ms": 10**20},
        {"sandbox_id": True},
        {"share_mib": None},
    ],
)
def test_a_stale_or_malformed_report_is_ignored(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, change: dict[str, Any]
) -> None:
    sandbox = running(people, catalog, "timeslice")
    tasks.sandbox_over_share("a100", {**report(sandbox, "stop", 30_000), **change})  # type: ignore[typeddict-item]
    sandbox.refresh_from_db()
    assert sandbox.state == "running" and sandbox.over_share_since is None and not notes(sandbox)


def test_a_report_for_a_sandbox_no_longer_running_or_from_another_host_is_ignored(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog, "timeslice")
    tasks.sandbox_over_share("h100", report(sandbox, "warn", 30_000))  # type: ignore[arg-type]
    actions.do_request_stop(sandbox.pk, people["owner"])
    tasks.sandbox_over_share("a100", report(sandbox, "stop", 30_000))  # type: ignore[arg-type]
    tasks.sandbox_over_share("a100", "not a report")  # type: ignore[arg-type]
    tasks.sandbox_over_share("a100", {})  # type: ignore[typeddict-item]
    sandbox.refresh_from_db()
    assert sandbox.stop_cause == "asked" and not notes(sandbox)
