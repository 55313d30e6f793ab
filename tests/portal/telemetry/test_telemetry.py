"""The control side of telemetry: rollups stored once and purged after the retention, the
history endpoints behind the WebSockets' permission, alerts recorded once, notified,
pushed to agents as a policy and delivered to a signed webhook."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.billing.pricing import cost_micros
from portal.fleet.models import Gpu
from portal.sandboxes import actions
from portal.sandboxes.models import Notification, Sandbox
from portal.telemetry.alerts import alert_policy, do_record_alerts
from portal.telemetry.consumers import SandboxSamples
from portal.telemetry.models import Alert, AlertPolicy, GpuRollup, SandboxRollup
from portal.telemetry.rollups import do_purge_rollups, do_store_rollups
from portal.webhooks.models import WebhookDelivery, WebhookEndpoint
from tests.factories import beat, inventory
from tests.portal.helpers import client_for, place_all, request
from wire.telemetry import AlertMessage, host_sandbox_group, sandbox_group


@pytest.fixture
def sandbox(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> Any:
    box = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    box.refresh_from_db()
    return box


def minute_payload(minute: datetime, gpu_uuid: str, sandbox_id: int, temp: float = 60.0) -> dict[str, Any]:
    return {
        "minute": int(minute.timestamp()),
        "gpus": {
            gpu_uuid: {
                "samples": 60, "temp_c": [temp - 5, temp, temp + 5], "util_pct": [10.0, 50.0, 90.0],
                "mem_mib": [1000, 2000, 3000], "mem_total_mib": 81559, "power_w": [100.0, 200.0, 300.0],
                "sm_clock_mean_mhz": 1700, "throttled": 3,
            },
            "GPU-unknown": {"samples": 1},  # not ours: skipped, not an error
        },
        "sandboxes": {
            str(sandbox_id): {
                "samples": 60, "mem_mib": [900, 1000, 1100], "util_pct": [40.0, 50.0, 60.0],
                "temp_max_c": temp + 5, "power_mean_w": 200.0,
                "cost_micros": 12345,  # an agent from before the portal computed every cost: ignored
            }
        },
    }  # fmt: skip


def this_minute(minus: int = 0) -> datetime:
    return timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=minus)


def test_rollups_are_stored_once_and_purged_after_the_retention(sandbox: Any, settings: Any) -> None:
    gpu = sandbox.allocations.get().gpu
    host, other = gpu.host.name, ({"h100", "a100"} - {gpu.host.name}).pop()
    minute = this_minute(2)
    assert do_store_rollups([(host, minute_payload(minute, gpu.uuid, sandbox.pk))]) == (1, 1)
    # Redelivered, with a later figure: the same rows, rewritten.
    assert do_store_rollups([(host, minute_payload(minute, gpu.uuid, sandbox.pk, temp=70.0))]) == (1, 1)
    row = GpuRollup.objects.get()
    assert (row.minute, row.temp_max_c, row.throttled_samples, row.samples) == (minute, 75.0, 3, 60)
    # From another host, the GPU is not its: nothing written.
    assert do_store_rollups([(other, minute_payload(minute, gpu.uuid, 999999))]) == (0, 0)
    # Nor is the sandbox: another host's figures never land in this tenant's history.
    assert do_store_rollups([(other, minute_payload(this_minute(1), gpu.uuid, sandbox.pk))]) == (0, 0)
    settings.TELEMETRY_RETENTION_DAYS = 1
    old = datetime(2020, 1, 1, tzinfo=UTC)
    do_store_rollups([(host, minute_payload(old, gpu.uuid, sandbox.pk))])
    assert do_purge_rollups(timezone.now()) == 2
    assert GpuRollup.objects.count() == 1 and SandboxRollup.objects.count() == 1


def test_a_round_of_hosts_minutes_is_stored_in_one_transaction(
    sandbox: Any, django_assert_max_num_queries: Any
) -> None:
    """A process serving many hosts sends a minute of every host together: one call, a
    fixed number of statements, each GPU on its own host only, a minute sent twice once."""
    gpus = list(Gpu.objects.select_related("host"))
    minute = this_minute(2)
    rollups = [(g.host.name, minute_payload(minute, g.uuid, sandbox.pk)) for g in gpus]
    rollups.append(rollups[0])  # redelivered within the round
    rollups.append(("elsewhere", minute_payload(minute, gpus[0].uuid, sandbox.pk)))  # not its GPU
    with django_assert_max_num_queries(8):
        assert do_store_rollups(rollups) == (len(gpus), 1)
    assert GpuRollup.objects.count() == len(gpus)


def test_an_unmeasured_minute_is_stored_and_served_as_null(people: Any, sandbox: Any) -> None:
    """Guards review §1.3: a MIG device without GPM measures no utilization; its minute is
    stored with null utilization (the columns were NOT NULL, so only a fake 0 fitted)."""
    gpu = sandbox.allocations.get().gpu
    payload = minute_payload(this_minute(1), gpu.uuid, sandbox.pk)
    payload["gpus"][gpu.uuid]["util_pct"] = None
    payload["sandboxes"][str(sandbox.pk)]["util_pct"] = None
    assert do_store_rollups([(gpu.host.name, payload)]) == (1, 1)
    row = GpuRollup.objects.get()
    assert (row.util_min_pct, row.util_mean_pct, row.util_max_pct, row.temp_mean_c) == (
        None,
        None,
        None,
        60.0,
    )
    assert SandboxRollup.objects.get().util_mean_pct is None
    body = client_for(people["owner"]).get(f"/telemetry/sandboxes/{sandbox.pk}/history/").json()
    assert body["util_pct"] == {"min": [None], "mean": [None], "max": [None]}


def test_an_ended_sandboxs_history_is_its_last_hour_not_the_clocks(people: Any, sandbox: Any) -> None:
    """A sandbox that ended yesterday still shows what it recorded: its window ends at its
    end (the page's chart asked for the last 60 minutes of today and drew nothing)."""
    gpu = sandbox.allocations.get().gpu
    now = this_minute()  # read once: a minute turning between readings would move the window

    def ago(minutes: int) -> datetime:
        return now - timedelta(minutes=minutes)

    for back in (26 * 60, 24 * 60 + 50, 24 * 60 + 5):
        do_store_rollups([(gpu.host.name, minute_payload(ago(back), gpu.uuid, sandbox.pk))])
    Sandbox.objects.filter(pk=sandbox.pk).update(state="stopped", ended_at=ago(24 * 60))
    member = client_for(people["member"])
    history = member.get(f"/telemetry/sandboxes/{sandbox.pk}/history/?minutes=60").json()
    assert history["t"] == [int(ago(m).timestamp()) for m in (24 * 60 + 50, 24 * 60 + 5)]


def test_history_endpoints_follow_the_streams_permissions(people: Any, sandbox: Any) -> None:
    gpu = sandbox.allocations.get().gpu
    start = timezone.now().replace(second=0, microsecond=0)  # once: a run crossing a minute's
    # end must not shift the minutes between the ones stored and the ones asserted

    def minute(minus: int = 0) -> datetime:
        return start - timedelta(minutes=minus)

    for back in (3, 2, 1):
        do_store_rollups(
            [(gpu.host.name, minute_payload(minute(back), gpu.uuid, sandbox.pk, temp=50.0 + back))]
        )
    # Running since 4 minutes ago: the chart's cost at each minute's end is billing's, from
    # the ledger (the agents send none).
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, minute(4))
    price = sandbox.tier.price_per_gpu_hour_micros
    member = client_for(people["member"])
    history = member.get(f"/telemetry/sandboxes/{sandbox.pk}/history/?minutes=10").json()
    assert len(history["t"]) == 3
    assert history["cost_micros"] == [cost_micros(price, 1000, s * 1_000_000) for s in (120, 180, 240)]
    assert history["mem_mib"]["max"] == [1100] * 3 and history["currency"] == sandbox.tier.currency
    gpu_history = member.get(f"/telemetry/gpus/{gpu.uuid}/history/").json()
    assert gpu_history["temp_c"]["mean"] == [53.0, 52.0, 51.0] and gpu_history["mem_total_mib"] == 81559
    outsider = client_for(people["outsider"])
    assert outsider.get(f"/telemetry/sandboxes/{sandbox.pk}/history/").status_code == 403
    assert outsider.get(f"/telemetry/gpus/{gpu.uuid}/history/").status_code == 403
    assert member.get("/telemetry/fleet/history/").status_code == 403
    bad = member.get(f"/telemetry/gpus/{gpu.uuid}/history/?minutes=-5")
    assert bad.status_code == 400 and "minutes" in bad.json()
    admin = client_for(people["admin"])
    fleet = admin.get("/telemetry/fleet/history/?minutes=5&metric=mem_pct").json()
    row = next(g for g in fleet["gpus"] if g["uuid"] == gpu.uuid)
    assert len(fleet["t"]) == 6 and round(row["values"][2], 1) == round(100 * 2000 / 81559, 1)
    assert len(fleet["gpus"]) == Gpu.objects.count()
    assert admin.get("/telemetry/fleet/history/?metric=fan").json() == {
        "metric": ["One of util_pct, temp_c, power_w, mem_pct."]
    }
    # Stopped half a minute into the last minute: that minute's cost is the closed interval's.
    actions.do_mark_stopped(sandbox.allocation_key, minute(1) + timedelta(seconds=30))
    history = member.get(f"/telemetry/sandboxes/{sandbox.pk}/history/?minutes=10").json()
    assert history["cost_micros"] == [cost_micros(price, 1000, s * 1_000_000) for s in (120, 180, 210)]
    assert history["cost_micros"][-1] == UsageRecord.objects.get(sandbox=sandbox).cost_micros


def change(state: str, key: str, **extra: Any) -> AlertMessage:
    return cast(AlertMessage, {
        "type": "alert.changed", "key": key, "state": state, "kind": "temperature", "host": "h100",
        "gpu": extra.pop("gpu", ""), "sandbox": None, "value": 88.0, "threshold": 85.0,
        "message": "GPU hot", "t": 1_700_000_000_000, **extra,
    })  # fmt: skip


def test_the_sandbox_stream_adds_billings_running_cost_to_its_samples(people: Any, sandbox: Any) -> None:
    """Agents send no cost; the sandbox's socket adds the ledger's cost at each sample's time
    (a sample of an older agent, with a cost of its own, gets billing's too)."""
    # One reading of the clock: read twice, a minute turning in between made it 11 minutes.
    now = this_minute()
    started = now - timedelta(minutes=10)
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, started)
    consumer = SandboxSamples()
    consumer.scope = {"url_route": {"kwargs": {"sandbox_id": sandbox.pk}}}
    consumer.init_stream()
    # The portal's notices of it, and its own figures from the host it is placed on alone.
    assert consumer.authorize(people["member"]) == {
        sandbox_group(sandbox.pk),
        host_sandbox_group(sandbox.host.name, sandbox.pk),
    }
    key, gpu = str(sandbox.pk), sandbox.allocations.get().gpu.uuid
    price = sandbox.tier.price_per_gpu_hour_micros
    older_agents = {"mem_mib": 1024, "util_pct": None, "cost_micros": 7}
    for figures in ({"mem_mib": 1024, "util_pct": 50.0}, older_agents):
        at_ms = int(now.timestamp() * 1000)
        sample = {"type": "gpu.sample", "gpu": gpu, "t": at_ms, "sandboxes": {key: figures}}
        asyncio.run(consumer.gpu_sample(sample))
        [sent] = consumer._latest.values()
        assert sent["sandboxes"][key] == {**figures, "cost_micros": cost_micros(price, 1000, 600_000_000)}
    assert consumer.authorize(people["outsider"]) is None


def test_alerts_are_recorded_once_notified_and_listed(
    people: Any, sandbox: Any, sent_tasks: Any, django_capture_on_commit_callbacks: Any
) -> None:
    gpu = sandbox.allocations.get().gpu
    WebhookEndpoint.objects.create(url="http://127.0.0.1:9/hook", events=["alert.raised", "alert.cleared"])
    raised = [
        change("raised", "h100:k1", gpu=gpu.uuid),
        change("raised", "h100:k2", gpu=gpu.uuid, sandbox=sandbox.pk),
    ]
    with django_capture_on_commit_callbacks(execute=True):
        assert [s for _, s in do_record_alerts("h100", raised)] == ["raised", "raised"]
        assert do_record_alerts("h100", raised) == []  # redelivered: nothing new
    assert Alert.objects.filter(cleared_at__isnull=True).count() == 2
    assert Notification.objects.filter(user=people["owner"], kind="alert").count() == 1
    # Each raised alert is a webhook delivery, sent after commit (tests/portal/webhooks/test_webhooks.py).
    raised_events = WebhookDelivery.objects.filter(event="alert.raised")
    assert sorted(d.payload["key"] for d in raised_events) == ["h100:k1", "h100:k2"]
    assert [t[2] for t in sent_tasks if t[1] == "deliver_webhook"] == [
        (d.pk,) for d in raised_events.order_by("pk")
    ]
    do_record_alerts("h100", [change("cleared", "h100:k1", message="cleared: back to normal")])
    k1 = Alert.objects.get(key="h100:k1")
    assert k1.cleared_at is not None and k1.clear_reason == "cleared: back to normal"
    listed = client_for(people["member"]).get(f"/telemetry/alerts/?sandbox={sandbox.pk}").json()["alerts"]
    assert [(a["key"], a["state"]) for a in listed] == [("h100:k2", "raised")]  # its own, as streamed
    on_gpu = client_for(people["admin"]).get(f"/telemetry/alerts/?gpu={gpu.uuid}").json()["alerts"]
    assert [(a["key"], a["state"]) for a in on_gpu] == [("h100:k2", "raised"), ("h100:k1", "cleared")]
    assert client_for(people["outsider"]).get(f"/telemetry/alerts/?sandbox={sandbox.pk}").status_code == 403
    assert client_for(people["member"]).get("/telemetry/alerts/").status_code == 403
    # Unknown kinds and hosts are logged and ignored.
    assert do_record_alerts("h100", [change("raised", "h100:k3", kind="fan")]) == []
    # Another host speaks for itself alone (issue 38): it cannot clear h100's alert, take one of
    # its keys, or put its alert on h100's sandbox (whose owner it would notify).
    assert do_record_alerts("a100", [change("cleared", "h100:k2"), change("raised", "h100:k9")]) == []
    assert Alert.objects.get(key="h100:k2").cleared_at is None
    do_record_alerts("a100", [change("raised", "a100:k1", gpu=gpu.uuid, sandbox=sandbox.pk)])
    stray = Alert.objects.get(key="a100:k1")
    assert stray.sandbox is None and stray.gpu is None
    assert Notification.objects.filter(user=people["owner"], kind="alert").count() == 1
    assert do_record_alerts("nowhere", raised) == []


def test_heartbeat_sends_a_changed_policy_and_a_restart_closes_alerts(
    people: Any, sandbox: Any, sent_tasks: Any
) -> None:
    from workers import control

    policy = alert_policy()
    control.TASKS["agent_heartbeats"]([beat("h100", alerts_version=policy["version"])])
    assert not [t for t in sent_tasks if t[1] == "set_alert_policy"]
    fleet = AlertPolicy.objects.get(tier__isnull=True)
    fleet.temp_high_c = 80
    fleet.temp_clear_c = 75
    fleet.save()
    AlertPolicy.objects.create(tier=sandbox.tier, mem_high_pct=80, mem_clear_pct=70)
    control.TASKS["agent_heartbeats"]([beat("h100", alerts_version=policy["version"])])
    [(queue, _task, (sent,))] = [t for t in sent_tasks if t[1] == "set_alert_policy"]
    assert queue == "host.h100" and sent["fleet"]["temp_high_c"] == 80
    assert sent["tiers"][sandbox.tier.slug]["mem_high_pct"] == 80 and sent["version"] != policy["version"]
    do_record_alerts("h100", [change("raised", "h100:open-1")])
    control.TASKS["agent_inventories"]([inventory("h100", [], started=True)])
    assert Alert.objects.get(key="h100:open-1").clear_reason == "agent restarted"


def test_a_policy_with_clear_over_raise_is_refused(db: Any) -> None:
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError) as error:
        AlertPolicy(temp_high_c=80, temp_clear_c=85, mem_high_pct=120).full_clean()
    assert {"temp_clear_c", "mem_high_pct"} <= set(error.value.message_dict)
