"""GET /metrics: DCGM-named GPU series from the newest samples, gpushare_* series from the
database, and who may read them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
import redis.asyncio
from django.conf import settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from portal.billing.models import UsageRecord
from portal.fleet.models import Gpu, Host, MigInstance
from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox
from portal.telemetry import metrics
from portal.telemetry.exposition import text_format
from portal.telemetry.metrics import CLOCK_EVENT_BITS, clock_event_bits
from portal.telemetry.models import Alert
from tests.conftest import seed_host
from tests.portal.helpers import client_for, place_all, request
from wire.telemetry import LATEST_PREFIX, GpuSampleMessage, SandboxFigures
from workers.gpu.base import GpuSample
from workers.gpu.nvml import decode_clock_reasons
from workers.host.telemetry import sample_message, store_latest

# Placing and launching go through on_commit, so the tests commit.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]

TOKEN = "scrape-token-for-tests"
MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def _no_stored_samples() -> Iterator[None]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter(match=f"{LATEST_PREFIX}*"):
        client.delete(key)
    yield
    for key in client.scan_iter(match=f"{LATEST_PREFIX}*"):
        client.delete(key)
    client.close()


@pytest.fixture
def token(settings: Any) -> str:
    settings.METRICS_TOKEN = TOKEN
    return TOKEN


def message(
    uuid: str,
    host: str,
    *,
    age_s: float = 0,
    parent: str = "",
    simulated: bool = True,
    sandboxes: dict[str, SandboxFigures] | None = None,
    **fields: Any,
) -> GpuSampleMessage:
    values: dict[str, Any] = {
        "temp_c": 61.5,
        "util_pct": 87.0,
        "mem_used_mib": 30_000,
        "mem_total_mib": 81_559,
        "power_w": 412.3,
        "sm_clock_mhz": 1755,
        "throttle": ("sw_power_cap", "hw_slowdown"),
        "ecc_corrected": 3,
        "ecc_uncorrected": 1,
        **fields,
    }
    xid = values.pop("xid", 0)
    sample = GpuSample(uuid=uuid, t_ms=int((time.time() - age_s) * 1000), **values)
    return sample_message(sample, host, simulated, sandboxes or {}, xid=xid, parent=parent)


def store(host: str, *messages: GpuSampleMessage) -> None:
    """Through the agents' own writer."""

    async def write() -> None:
        client = redis.asyncio.Redis.from_url(settings.REDIS_URL)
        try:
            await store_latest(client, host, list(messages))
        finally:
            await client.aclose()

    asyncio.run(write())


def scrape(client: Client | None = None, **headers: str) -> dict[str, list[Sample]]:
    client = client or Client()
    response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}", **headers})
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    families: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        assert family.name not in families
        families[family.name] = family.samples
    return families


def one(samples: list[Sample], **labels: str | None) -> Sample:
    found = [s for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (labels, samples)
    return found[0]


def start(sandbox: Sandbox, at: Any = None) -> Sandbox:
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, at or timezone.now())
    sandbox.refresh_from_db()
    return sandbox


@pytest.fixture
def running(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> dict[str, Any]:
    """A dedicated sandbox of mark's (Vision) and a MIG sandbox of olivia's, both running."""
    dedicated = request(people["member"], people["project"], catalog["dedicated"], catalog["image"])
    mig = request(people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="1g.10gb")
    place_all()
    dedicated, mig = start(dedicated, timezone.now() - timedelta(hours=1)), start(mig)
    held = Allocation.objects.get(sandbox=dedicated, active=True)
    slice_ = Allocation.objects.get(sandbox=mig, active=True)
    assert slice_.mig_instance is not None
    return {
        "dedicated": dedicated,
        "mig": mig,
        "held_gpu": held.gpu,
        "instance": slice_.mig_instance,
        "people": people,
        "catalog": catalog,
    }


def test_gpu_series_carry_dcgm_names_and_labels(running: dict[str, Any], token: str) -> None:
    held: Gpu = running["held_gpu"]
    instance: MigInstance = running["instance"]
    parent = instance.gpu
    dedicated, mig = running["dedicated"], running["mig"]
    free = Gpu.objects.filter(host=held.host, mig_enabled=False).exclude(pk=held.pk).first()
    assert free is not None
    figures = {str(dedicated.pk): SandboxFigures(mem_mib=20_000, util_pct=90.0)}
    store(held.host.name, message(held.uuid, held.host.name, sandboxes=figures, xid=48))
    store(free.host.name, message(free.uuid, free.host.name, throttle=(), util_pct=0.0))
    mig_figures = {str(mig.pk): SandboxFigures(mem_mib=4_000, util_pct=55.0)}
    store(
        parent.host.name,
        message(parent.uuid, parent.host.name, sandboxes=mig_figures),
        message(
            instance.uuid,
            parent.host.name,
            parent=parent.uuid,
            sandboxes=mig_figures,
            mem_used_mib=4_016,
            mem_total_mib=9_856,
            util_pct=55.0,
        ),
    )

    families = scrape()

    temp = families["DCGM_FI_DEV_GPU_TEMP"]
    assert len(temp) == 4  # the two sampled GPUs, the MIG GPU and its one sampled instance
    pod = f"sandbox-{dedicated.pk}"
    assert one(temp, UUID=held.uuid, GPU_I_ID=None).labels == {
        "gpu": str(held.index),
        "UUID": held.uuid,
        "device": f"nvidia{held.index}",
        "modelName": held.name,
        "Hostname": held.host.name,
        "namespace": "vision",
        "pod": pod,
        "container": pod,
    }
    assert one(temp, UUID=held.uuid).value == 61.5
    # A free GPU has no Kubernetes-style labels at all, as dcgm-exporter leaves them off.
    assert set(one(temp, UUID=free.uuid).labels) == {"gpu", "UUID", "device", "modelName", "Hostname"}
    # A MIG device: its parent's identity, the instance's profile and id, and its holder.
    mig_pod = f"sandbox-{mig.pk}"
    assert one(families["DCGM_FI_DEV_FB_USED"], GPU_I_PROFILE="1g.10gb").labels == {
        "gpu": str(parent.index),
        "UUID": parent.uuid,
        "device": f"nvidia{parent.index}",
        "modelName": parent.name,
        "Hostname": parent.host.name,
        "GPU_I_PROFILE": "1g.10gb",
        "GPU_I_ID": str(instance.gpu_instance_id),
        "namespace": "vision",
        "pod": mig_pod,
        "container": mig_pod,
    }
    assert one(families["DCGM_FI_DEV_FB_USED"], GPU_I_PROFILE="1g.10gb").value == 4_016
    assert one(families["DCGM_FI_DEV_FB_FREE"], GPU_I_PROFILE="1g.10gb").value == 9_856 - 4_016
    assert one(families["DCGM_FI_DEV_FB_TOTAL"], GPU_I_PROFILE="1g.10gb").value == 9_856
    # The MIG GPU itself: no instance labels, no holder (its instances have theirs).
    whole = [s for s in families["DCGM_FI_DEV_FB_USED"] if s.labels["UUID"] == parent.uuid]
    assert [set(s.labels) for s in whole if "GPU_I_ID" not in s.labels] == [
        {"gpu", "UUID", "device", "modelName", "Hostname"}
    ]

    def value(name: str, uuid: str) -> float:
        return one(families[name], UUID=uuid).value

    assert value("DCGM_FI_DEV_GPU_UTIL", held.uuid) == 87.0
    assert value("DCGM_FI_DEV_GPU_UTIL", free.uuid) == 0.0
    assert value("DCGM_FI_DEV_FB_USED", held.uuid) == 30_000
    assert value("DCGM_FI_DEV_FB_FREE", held.uuid) == 81_559 - 30_000
    assert value("DCGM_FI_DEV_POWER_USAGE", held.uuid) == 412.3
    assert value("DCGM_FI_DEV_SM_CLOCK", held.uuid) == 1755
    assert value("DCGM_FI_DEV_XID_ERRORS", held.uuid) == 48
    assert value("DCGM_FI_DEV_XID_ERRORS", free.uuid) == 0
    assert value("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", held.uuid) == 3
    assert value("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", held.uuid) == 1
    assert value("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", held.uuid) == 0x4 | 0x8
    assert value("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", held.uuid) == 0x4 | 0x8
    assert value("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", free.uuid) == 0

    # Per running sandbox, from the samples' figures (a MIG sandbox's from its own device);
    # its cost from billing, the samples carrying none: one GPU for an hour at 2.50.
    labels = {"sandbox": str(dedicated.pk), "project": "vision", "owner": "mark", "tier": "dedicated"}
    assert one(families["gpushare_sandbox_gpu_memory_used_bytes"], **labels).value == 20_000 * MIB
    assert one(families["gpushare_sandbox_gpu_utilization_ratio"], **labels).value == 0.9
    cost = one(families["gpushare_sandbox_cost_micros"], **labels)
    assert cost.name == "gpushare_sandbox_cost_micros_total" and cost.labels["currency"] == "EUR"
    assert cost.value == pytest.approx(2_500_000, abs=20_000)
    mig_labels = {"sandbox": str(mig.pk), "owner": "olivia", "tier": "mig"}
    assert one(families["gpushare_sandbox_gpu_memory_used_bytes"], **mig_labels).value == 4_000 * MIB
    assert one(families["gpushare_sandbox_gpu_utilization_ratio"], **mig_labels).value == 0.55


def test_the_text_format_is_what_prometheus_client_writes(running: dict[str, Any], token: str) -> None:
    """portal/telemetry/exposition.py writes generate_latest's bytes, faster: on a scrape of
    every kind of series, and on label values that need escaping."""
    held: Gpu = running["held_gpu"]
    figures = {str(running["dedicated"].pk): SandboxFigures(mem_mib=20_000, util_pct=90.0)}
    store(held.host.name, message(held.uuid, held.host.name, sandboxes=figures, xid=48))
    Alert.objects.create(
        key="t", kind="temperature", host=held.host, gpu=held, message="hot", value=90, threshold=85,
        raised_at=timezone.now(),
    )  # fmt: skip
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.FleetCollector(metrics._read_store(), timezone.now()))
    assert text_format(registry) == generate_latest(registry)

    class Awkward:
        def collect(self) -> Iterator[Any]:
            gauge = GaugeMetricFamily("g", "help with \\ and\nnewline", labels=["b", "a"])
            gauge.add_metric(['quote " back \\ nl \n', "é"], 1.5)
            gauge.add_metric(["x", "y"], float("inf"))
            counter = CounterMetricFamily("c", "counted", labels=["z"])
            counter.add_metric(["1"], 3)
            yield from (gauge, counter)

    awkward = CollectorRegistry(auto_describe=False)
    awkward.register(Awkward())
    assert text_format(awkward) == generate_latest(awkward)

    class Other:  # a type this writer leaves to prometheus_client
        def collect(self) -> Iterator[Any]:
            yield InfoMetricFamily("build", "the build", value={"version": "1"})

    other = CollectorRegistry(auto_describe=False)
    other.register(Other())
    assert text_format(other) == generate_latest(other)


def test_stale_absent_and_unknown_devices_emit_no_gpu_series(running: dict[str, Any], token: str) -> None:
    held: Gpu = running["held_gpu"]
    store(held.host.name, message(held.uuid, held.host.name, age_s=120))  # an agent long silent
    store(held.host.name, message("GPU-not-in-the-inventory", held.host.name))
    families = scrape()
    assert not [name for name in families if name.startswith("DCGM_")]
    assert families["gpushare_sandbox_gpu_memory_used_bytes"] == []
    # The inventory still lists every GPU, sampled or not.
    assert len(families["gpushare_gpu_info"]) == Gpu.objects.count()


def test_no_utilization_where_nvml_measures_none(running: dict[str, Any], token: str) -> None:
    """Guards review §1.3: NVML measures nothing on a MIG device or a GPU in MIG mode; the
    agent says None there, and that is no series (never 0), for the device and its sandbox.
    A measured figure (GPM on an H100) is exported, a measured 0 too."""
    instance: MigInstance = running["instance"]
    parent = instance.gpu
    host = parent.host.name
    mig_figures = {str(running["mig"].pk): SandboxFigures(mem_mib=4_000, util_pct=None)}
    store(
        host,
        message(parent.uuid, host, simulated=False, util_pct=None),
        message(
            instance.uuid, host, parent=parent.uuid, simulated=False, util_pct=None, sandboxes=mig_figures
        ),
    )
    families = scrape()
    assert "DCGM_FI_DEV_GPU_UTIL" not in families
    assert len(families["DCGM_FI_DEV_GPU_TEMP"]) == 2
    assert families.get("gpushare_sandbox_gpu_utilization_ratio", []) == []
    assert len(families["gpushare_sandbox_gpu_memory_used_bytes"]) == 1
    store(host, message(instance.uuid, host, parent=parent.uuid, simulated=False, util_pct=0.0))
    assert [s.value for s in scrape()["DCGM_FI_DEV_GPU_UTIL"]] == [0.0]


def test_gpushare_series(running: dict[str, Any], token: str) -> None:
    people, catalog = running["people"], running["catalog"]
    held: Gpu = running["held_gpu"]
    # One ended placement of 30 minutes on one GPU: 1.25 EUR.
    ended = request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    place_all()
    began = timezone.now() - timedelta(hours=2)
    start(ended, began)
    actions.do_mark_stopped(ended.allocation_key, began + timedelta(minutes=30))
    # Two waiting (no scheduling cycle runs after them), the older for 90 s.
    waiting = request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    Sandbox.objects.filter(pk=waiting.pk).update(requested_at=timezone.now() - timedelta(seconds=90))
    request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    Host.objects.filter(name="a100").update(state=Host.State.DRAINING)
    Gpu.objects.filter(pk=held.pk).update(state=Gpu.State.DRAINED)
    now = timezone.now()
    alert = {"host": held.host, "gpu": held, "message": "hot", "value": 90, "threshold": 85, "raised_at": now}
    Alert.objects.create(key="a", kind="temperature", **alert)
    Alert.objects.create(key="b", kind="temperature", **alert)
    Alert.objects.create(key="c", kind="xid", cleared_at=now, **alert)

    families = scrape()

    sandboxes = families["gpushare_sandboxes"]
    assert one(sandboxes, state="running", tier="dedicated", mode="dedicated").value == 1
    assert one(sandboxes, state="running", tier="mig", mode="mig").value == 1
    assert one(sandboxes, state="queued", tier="dedicated").value == 2
    assert one(sandboxes, state="stopped", tier="dedicated").value == 1
    assert one(sandboxes, state="queued", tier="mps", mode="mps").value == 0
    assert families["gpushare_queue_length"][0].value == 2
    assert 90 <= families["gpushare_queue_oldest_wait_seconds"][0].value < 120

    gpus = families["gpushare_gpus"]
    assert one(gpus, state="drained").value == 1
    assert one(gpus, state="available").value == Gpu.objects.count() - 1
    assert one(gpus, state="unavailable").value == 0
    hosts = families["gpushare_hosts"]
    assert [(s.labels["state"], s.value) for s in hosts] == [("draining", 1), ("lost", 0), ("up", 1)]
    info = one(families["gpushare_gpu_info"], UUID=held.uuid)
    assert info.value == 1
    assert info.labels == {
        "UUID": held.uuid,
        "Hostname": held.host.name,
        "gpu": str(held.index),
        "modelName": held.name,
        "model": held.model,
        "state": "drained",
        "mode": "dedicated",
        "simulated": "true",
    }
    assert one(families["gpushare_gpu_info"], UUID=running["instance"].gpu.uuid).labels["mode"] == "mig"

    alerts = families["gpushare_alerts_open"]
    assert one(alerts, kind="temperature").value == 2
    assert one(alerts, kind="xid").value == 0
    assert {s.labels["kind"] for s in alerts} == set(Alert.Kind.values)

    cost = families["gpushare_usage_cost_micros"]
    assert {s.name for s in cost} == {"gpushare_usage_cost_micros_total"}
    # Vision: one GPU for an hour (2.50) plus a MIG slice just started; NLP: the ended 1.25.
    assert one(cost, project="nlp", currency="EUR").value == 1_250_000
    assert one(cost, project="vision", currency="EUR").value == pytest.approx(2_500_000, abs=20_000)
    assert UsageRecord.objects.filter(ended_at__isnull=True).count() == 2
    assert families["gpushare_telemetry_store_up"][0].value == 1


def test_redis_down_still_serves_the_database_series(
    running: dict[str, Any], token: str, settings: Any
) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/11"  # nothing listens there
    families = scrape()
    assert families["gpushare_telemetry_store_up"][0].value == 0
    assert not [name for name in families if name.startswith("DCGM_")]
    assert families["gpushare_gpus"]


def test_query_count_does_not_grow_with_the_fleet(running: dict[str, Any], token: str) -> None:
    def sample_everything() -> None:
        for host in Host.objects.prefetch_related("gpus__mig_instances"):
            messages = [message(g.uuid, host.name) for g in host.gpus.all()]
            messages += [
                message(m.uuid, host.name, parent=g.uuid)
                for g in host.gpus.all()
                for m in g.mig_instances.all()
            ]
            store(host.name, *messages)

    def queries() -> int:
        sample_everything()
        with CaptureQueriesContext(connection) as captured:
            scrape()
        return len(captured.captured_queries)

    small = queries()
    for n in range(4):
        seed_host(f"big{n}", "H100-80GB:8:mig=0,1")
    people, catalog = running["people"], running["catalog"]
    for _ in range(3):
        request(people["member"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    for sandbox in Sandbox.objects.filter(state="starting"):
        start(sandbox)
    assert Gpu.objects.count() >= 40
    assert queries() == small
    assert small <= 12


def test_clock_event_bits_are_nvml_bits() -> None:
    for name, bit in CLOCK_EVENT_BITS.items():
        assert decode_clock_reasons(bit) == (name,)
    assert clock_event_bits(["sw_thermal", "hw_slowdown", "not-a-reason"]) == 0x20 | 0x8


# --- who may read it -----------------------------------------------------------------------------


def status(client: Client, **headers: str) -> int:
    return client.get("/metrics", headers=headers).status_code


def test_prometheus_with_the_token_and_staff_sessions_may_read(people: Any, token: str) -> None:
    assert status(Client(), Authorization=f"Bearer {TOKEN}") == 200
    assert status(client_for(people["admin"])) == 200


def test_everyone_else_is_refused(people: Any, token: str) -> None:
    anonymous = Client().get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    assert status(Client(), Authorization="Bearer wrong-token") == 401
    assert status(Client(), Authorization=f"Basic {TOKEN}") == 401
    assert status(client_for(people["member"])) == 403
    assert status(client_for(people["outsider"])) == 403
    # A token presented is judged alone: a wrong one is refused even beside a staff session.
    assert status(client_for(people["admin"]), Authorization="Bearer wrong-token") == 401


def test_without_a_token_configured_only_staff_sessions_work(people: Any, settings: Any) -> None:
    settings.METRICS_TOKEN = ""
    assert status(Client(), Authorization="Bearer ") == 401
    assert status(Client(), Authorization="Bearer anything") == 401
    assert status(client_for(people["admin"])) == 200
    assert status(client_for(people["member"])) == 403


def test_only_get(people: Any, token: str) -> None:
    response = Client().post("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 405
