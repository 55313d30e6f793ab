"""CPU-only sandboxes: host CPU and memory, no GPU, from request to bill."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.test import Client
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.billing.invoices import do_draft_invoices, month_start
from portal.billing.models import UsageRecord
from portal.catalog.models import SharingMode, Tier
from portal.control.hosts import mark_lost_hosts
from portal.control.reconcile import do_reconcile_host
from portal.fleet.models import Host
from portal.quotas.models import QuotaPolicy
from portal.quotas.usage import gpu_hours_since
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from portal.sandboxes.specs import launch_spec
from portal.scheduling.snapshot import build_fairshare, build_queue, build_snapshot
from scheduler.cluster import CPU_ONLY
from tests.factories import TierFactory
from tests.portal.helpers import client_for, place_all, request, request_form

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]
START = timezone.now().replace(microsecond=0) - timedelta(hours=2)


@pytest.fixture
def cpu(catalog: Any) -> Tier:
    """2 cores and 2 GiB of a host, 0.10 EUR per hour of the sandbox."""
    return TierFactory(  # type: ignore[return-value]
        slug="cpu", name="CPU only", sharing_mode=SharingMode.CPU, price_per_gpu_hour_micros=100_000,
        cpu_limit=2.0, memory_limit_mib=2048,
    )  # fmt: skip


def _ask(people: Any, catalog: Any, tier: Tier, **kw: Any) -> Sandbox:
    return request(people["owner"], people["project"], tier, catalog["image"], **kw)


def _running(people: Any, catalog: Any, tier: Tier, at: Any = START) -> Sandbox:
    sandbox = _ask(people, catalog, tier)
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, at)
    sandbox.refresh_from_db()
    assert sandbox.state == "running"
    return sandbox


def test_the_tier_asks_the_scheduler_for_cpu_and_memory_only(people: Any, catalog: Any, cpu: Tier) -> None:
    sandbox = _ask(people, catalog, cpu)
    [asked] = [r for r in build_queue() if r.id == sandbox.pk]
    assert SharingMode.CPU == CPU_ONLY and asked.mode == CPU_ONLY
    assert (asked.cpu_milli, asked.memory_mib, asked.gpu_milli) == (2000, 2048, 0)


def test_it_is_placed_without_a_device_and_launched_with_none(
    people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = _ask(people, catalog, cpu)
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "starting" and sandbox.host is not None
    assert not sandbox.allocations.exists()
    assert (
        sandbox.events.get(to_state="placing").message == f"placed on {sandbox.host.name}: CPU only, no GPU"
    )
    [(queue, _, (spec,))] = [t for t in sent_tasks if t[1] == "launch_sandbox"]
    assert queue == f"host.{sandbox.host.name}"
    assert not spec["device_uuids"] and spec["real_gpu"] is False and spec["mps"] is None
    assert (spec["cpu_limit"], spec["memory_limit_mib"]) == (2.0, 2048)
    assert launch_spec(sandbox).gpu_env() == {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}


def test_a_host_is_not_over_committed_by_sandboxes_that_hold_no_gpu(
    people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any
) -> None:
    Host.objects.filter(name="h100").update(state=Host.State.DRAINING)  # one host to fill
    Host.objects.filter(name="a100").update(cpu_cores=5, memory_mib=8192)
    first, second = _running(people, catalog, cpu), _running(people, catalog, cpu)
    a100 = next(h for h in build_snapshot().hosts if h.name == "a100")
    assert (a100.cpu_used_milli, a100.memory_used_mib) == (4000, 4096)  # no allocation, yet counted
    third = _ask(people, catalog, cpu)
    whole = _ask(people, catalog, catalog["dedicated"], gpu_count=1)  # 0.5 core: still fits
    place_all()
    third.refresh_from_db()
    whole.refresh_from_db()
    assert third.state == "queued" and "no host has 2 CPU cores and 2048 MiB" in third.pending_reason
    assert whole.state == "starting"
    actions.do_request_stop(first.pk, people["owner"])
    actions.do_mark_stopped(first.allocation_key, timezone.now())
    place_all()
    third.refresh_from_db()
    assert third.state == "starting" and second.pk != third.pk


def test_it_uses_no_gpu_quota(people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any) -> None:
    QuotaPolicy.objects.create(project=people["project"], max_gpus=0, max_gpu_hours_month=0)
    gpu = actions.SandboxRequest(people["project"], catalog["dedicated"], catalog["image"], "container")
    with pytest.raises(actions.SandboxRequestError, match="GPU-hours"):
        actions.check_request_sandbox(people["owner"], gpu)
    sandbox = _running(people, catalog, cpu)  # no GPU-hours left, no GPU allowed: it runs anyway
    assert gpu_hours_since(people["project"].pk, START - timedelta(days=1), timezone.now()) == 0
    assert build_fairshare(timezone.now().timestamp()).share("vision").usage_gpu_s == 0
    assert {r.sandbox_id: r.milli_gpu for r in build_snapshot().running}[sandbox.pk] == 0


def test_it_is_billed_per_hour_of_the_sandbox(
    people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = _running(people, catalog, cpu)
    actions.do_request_stop(sandbox.pk, people["owner"])
    actions.do_mark_stopped(sandbox.allocation_key, START + timedelta(minutes=90))
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert (record.milli_gpu, record.billed_milli, record.gpu_model) == (0, 1000, "")
    assert record.cost_micros == 150_000  # 0.10 per hour x 1.5 h
    owner = Client(HTTP_AUTHORIZATION=f"Bearer {ApiToken.issue(people['owner'], 't', ['read:usage'])[1]}")
    [row] = owner.get("/api/v1/usage/").json()["results"]
    assert (row["milli_gpu"], row["billed_milli"], row["cost_micros"]) == (0, 1000, 150_000)
    export = owner.get("/api/v1/usage/export.csv")
    csv = b"".join(export.streaming_content).decode().splitlines()  # type: ignore[attr-defined]
    assert csv[0].endswith(",billed_milli") and csv[1].endswith(",1000")
    [invoice] = do_draft_invoices(month_start(record.started_at), timezone.now())
    assert invoice.total_micros == 150_000
    page = client_for(people["owner"]).get(f"/projects/vision/invoices/{invoice.pk}/").content.decode()
    assert "CPU only" in page and "0.10 EUR/h per sandbox" in page


def test_a_cpu_tier_culls_by_nothing_it_does_not_have(catalog: Any) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        TierFactory(slug="cpu-culled", sharing_mode=SharingMode.CPU, idle_util_pct=5)


def test_a_lost_host_loses_it_and_it_starts_again_elsewhere(
    people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any
) -> None:
    Tier.objects.filter(pk=cpu.pk).update(requeue_on_failure=True)
    sandbox = _running(people, catalog, cpu)
    lost = sandbox.host
    assert lost is not None
    Host.objects.filter(pk=lost.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    Host.objects.exclude(pk=lost.pk).update(last_heartbeat_at=timezone.now())
    assert mark_lost_hosts(timezone.now()) == 1
    sandbox.refresh_from_db()
    assert sandbox.state == "queued" and sandbox.host is None
    assert UsageRecord.objects.get(sandbox=sandbox).ended_at is not None
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "starting" and sandbox.host is not None and sandbox.host != lost


def test_reconcile_treats_it_like_any_sandbox(
    people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = _ask(people, catalog, cpu)
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.host is not None
    started_ms = int(START.timestamp() * 1000)
    report: list[Any] = [
        {
            "allocation_key": sandbox.allocation_key,
            "sandbox_id": sandbox.pk,
            "state": "running",
            "started_at_ms": started_ms,
            "handle": {"driver": "docker", "ref": "c"},
        }
    ]
    assert do_reconcile_host(sandbox.host.name, timezone.now(), report).marked_running == [sandbox.pk]
    later = timezone.now() + timedelta(seconds=5)
    assert do_reconcile_host(sandbox.host.name, later, []).vanished == [sandbox.pk]
    sandbox.refresh_from_db()
    assert sandbox.state == "failed" and "vanished" in sandbox.failure


def test_its_pages_say_cpu_only_and_show_no_gpu_chart(
    people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = _running(people, catalog, cpu)
    owner = client_for(people["owner"])
    page = owner.get(f"/sandboxes/{sandbox.pk}/").content.decode()
    assert "CPU only · 2 CPU, 2048 MiB" in page and 'id="no-gpu"' in page
    assert "no GPU stream to chart" in page and 'id="gpu-chart"' not in page
    assert "None: CPU only, no GPU." in page and "NVIDIA_VISIBLE_DEVICES=void" in page
    assert "0.10 EUR/h per sandbox" in page
    assert "CPU only · 2 CPU, 2048 MiB" in owner.get("/sandboxes/").content.decode()
    form = owner.get("/sandboxes/new/").content.decode()
    assert f'"{cpu.pk}": "cpu"' in form  # the form's script hides the GPU fields for it
    asked = request_form(people, catalog, tier=str(cpu.pk))
    del asked["gpu_count"]
    preview = owner.post("/sandboxes/preview/", asked).content.decode()
    assert "Starts now on " in preview and "CPU only (no GPU)" in preview
    made = owner.post("/sandboxes/new/", asked)
    assert made.status_code == 302
    assert Sandbox.objects.get(pk=int(made["Location"].rstrip("/").split("/")[-1])).tier == cpu


def test_the_api_says_what_it_holds_and_refuses_gpu_fields(
    people: Any, catalog: Any, cpu: Tier, fleet: Any, sent_tasks: Any
) -> None:
    _, key = ApiToken.issue(people["owner"], "t", ["write:sandboxes", "read:usage"])
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    body = {
        "project": "vision",
        "tier": "cpu",
        "image": "busybox",
        "isolation": "container",
        "duration_hours": 1,
    }
    refused = client.post("/api/v1/sandboxes/", {**body, "gpu_count": 1}, content_type="application/json")
    assert (
        refused.status_code == 400 and "A cpu tier does not take gpu_count" in refused.json()["gpu_count"][0]
    )
    made = client.post("/api/v1/sandboxes/", body, content_type="application/json")
    assert made.status_code == 201, made.json()
    assert (made.json()["sharing_mode"], made.json()["gpu_count"]) == ("cpu", 0)
