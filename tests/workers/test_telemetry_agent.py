"""The agent's side of telemetry: alert rules with hysteresis, one-minute rollups, and one
sampling tick end to end (groups, rollups to control, alerts, the newest-sample store)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from redis.asyncio import Redis as AsyncRedis

from wire.spec import SandboxSpec
from wire.telemetry import GpuSampleMessage, SandboxFigures, read_latest
from workers.drivers.process import ProcessDriver
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host import sampler as sampler_module
from workers.host.agent import Agent
from workers.host.alerts import XID_QUIET_S, AlertTracker
from workers.host.rollups import MinuteRollups


def sample(t_ms: int = 0, **values: Any) -> GpuSampleMessage:
    base: dict[str, Any] = {
        "type": "gpu.sample",
        "gpu": "GPU-1",
        "host": "h",
        "t": t_ms,
        "temp_c": 50.0,
        "util_pct": 10.0,
        "mem_used_mib": 1000,
        "mem_total_mib": 80000,
        "power_w": 100.0,
        "sm_clock_mhz": 1500,
        "throttle": [],
        "simulated": True,
        "sandboxes": {},
        "ecc_corrected": 0,
        "ecc_uncorrected": 0,
        "xid": 0,
        "parent": "",
    }
    base.update(values)
    return GpuSampleMessage(**base)  # type: ignore[typeddict-item]


def run(tracker: AlertTracker, readings: list[dict[str, Any]], start_s: int = 0) -> list[Any]:
    """Feed one sample a second; returns every change with the second it happened."""
    out = []
    for second, values in enumerate(readings, start=start_s):
        for change in tracker.observe_gpu(sample(second * 1000, **values), second * 1000):
            out.append((second, change["state"], change["kind"], change))
    return out


def test_temperature_raises_after_its_hold_and_does_not_flap() -> None:
    tracker = AlertTracker("h")
    # 20 s at 86 °C (hold 10 s) -> raised at second 10; then hovering 81-84 °C changes nothing;
    # under 80 °C for 10 s clears it.
    readings = (
        [{"temp_c": 86.0}] * 20 + [{"temp_c": 81.0 + (i % 4)} for i in range(60)] + [{"temp_c": 70.0}] * 15
    )
    changes = run(tracker, readings)
    assert [(s, st, k) for s, st, k, _ in changes] == [
        (10, "raised", "temperature"),
        (90, "cleared", "temperature"),
    ]
    raised, cleared = changes[0][3], changes[1][3]
    assert raised["key"] == cleared["key"] and raised["key"].startswith("h:gpu:GPU-1:temperature:")
    assert raised["value"] == 86.0 and raised["threshold"] == 85 and "86 °C" in raised["message"]


def test_a_short_spike_raises_nothing() -> None:
    tracker = AlertTracker("h")
    readings = ([{"temp_c": 90.0}] * 5 + [{"temp_c": 60.0}]) * 10
    assert run(tracker, readings) == []


def test_utilization_must_stay_high_for_long_and_memory_is_a_share() -> None:
    tracker = AlertTracker("h")
    tracker.set_policy({"version": "v1", "fleet": {"util_s": 120, "hold_s": 5}})
    busy = [{"util_pct": 99.0, "mem_used_mib": 78000}] * 130  # memory 97.5 % of 80000 MiB
    changes = run(tracker, busy)
    assert [(s, k) for s, _, k, _ in changes] == [(5, "memory"), (120, "utilization")]
    assert tracker.version == "v1"


def test_unmeasured_utilization_neither_raises_nor_clears() -> None:
    """Guards review §1.3: a MIG device without GPM has util_pct None; the rules skip it
    (the old 0.0 would have read as a measured idle GPU)."""
    tracker = AlertTracker("h")
    tracker.set_policy({"version": "v1", "fleet": {"util_s": 10, "hold_s": 5}})
    high = run(tracker, [{"util_pct": 99.0}] * 12)
    assert [(s, k) for s, _, k, _ in high] == [(10, "utilization")]
    assert run(tracker, [{"util_pct": None}] * 30, start_s=12) == []  # still open, not cleared


def test_rollups_leave_unmeasured_utilization_out() -> None:
    """Guards review §1.3: unmeasured samples are not averaged in as 0 (idle); a minute that
    measured none says None (null in the stored rollup)."""
    rollups = MinuteRollups()
    rollups.roll(60_000)
    for second, util in enumerate([None, 80.0, None, 60.0]):
        rollups.add_gpu(sample(60_000 + second * 1000, util_pct=util))
        rollups.add_sandbox("9", {"mem_mib": 1, "util_pct": util}, sample(0))
    rollups.add_gpu(sample(61_000, gpu="MIG-1", util_pct=None))
    closed = rollups.roll(120_000)
    assert closed is not None
    assert closed["gpus"]["GPU-1"]["util_pct"] == [60.0, 70.0, 80.0]
    assert closed["gpus"]["GPU-1"]["samples"] == 4
    assert closed["sandboxes"]["9"]["util_pct"] == [60.0, 70.0, 80.0]
    assert closed["gpus"]["MIG-1"]["util_pct"] is None


def test_throttling_and_xid() -> None:
    tracker = AlertTracker("h")
    tracker.set_policy({"version": "v2", "fleet": {"throttle_s": 3}})
    changes = run(tracker, [{"throttle": ["gpu_idle"]}] * 5 + [{"throttle": ["hw_thermal"]}] * 5)
    assert [(s, k) for s, _, k, _ in changes] == [(8, "throttle")]
    assert "hw_thermal" in changes[0][3]["message"]
    [gpu_alert] = tracker.note_fault("GPU-1", "xid", 79, "XID 79", 20_000)  # a device fault: the GPU's
    [box_alert] = tracker.note_fault("GPU-1", "xid", 31, "XID 31", 20_000, [7])  # the tenant's own
    assert (gpu_alert["kind"], gpu_alert["sandbox"], box_alert["sandbox"]) == ("xid", None, 7)
    assert tracker.note_fault("GPU-1", "xid", 79, "XID 79", 21_000) == []  # open: not raised twice
    quiet = run(tracker, [{}] * 3, start_s=21 + XID_QUIET_S)
    assert ("cleared", "xid") in {(st, k) for _, st, k, _ in quiet}


def test_tier_rules_apply_to_its_sandboxes_and_gone_subjects_clear() -> None:
    tracker = AlertTracker("h")
    tracker.set_policy(
        {"version": "v3", "fleet": {}, "tiers": {"gold": {"mem_high_pct": 50, "mem_clear_pct": 40}}}
    )
    device = sample(0, mem_used_mib=30000)
    out = []
    for second in range(12):
        out += tracker.observe_sandbox(
            5, "gold", "GPU-1", device, 6000, 10000, second * 1000
        )  # 60 % of 10 GiB
        out += tracker.observe_sandbox(
            6, "silver", "GPU-1", device, 6000, 10000, second * 1000
        )  # fleet rules
    assert [(c["sandbox"], c["kind"]) for c in out] == [(5, "memory")]
    [cleared] = tracker.forget({"gpu:GPU-1"}, 13_000)
    assert cleared["state"] == "cleared" and cleared["key"] == out[0]["key"] and cleared["sandbox"] == 5


def test_disabled_rules_clear_what_is_open() -> None:
    tracker = AlertTracker("h")
    assert run(tracker, [{"temp_c": 95.0}] * 11)[0][1] == "raised"
    tracker.set_policy({"version": "off", "fleet": {"enabled": False}})
    assert [st for _, st, _, _ in run(tracker, [{"temp_c": 95.0}], start_s=12)] == ["cleared"]


def test_rollups_close_a_minute_when_the_next_begins() -> None:
    rollups = MinuteRollups()
    assert rollups.roll(60_000) is None
    for second, temp in enumerate([40.0, 50.0, 60.0]):
        rollups.add_gpu(
            sample(60_000 + second * 1000, temp_c=temp, throttle=["sw_thermal"] if second else [])
        )
        figures = SandboxFigures(mem_mib=1000 + second, util_pct=50.0)
        rollups.add_sandbox("9", figures, sample(0, temp_c=temp))
    assert rollups.roll(119_999) is None  # same minute
    closed = rollups.roll(120_000)
    assert closed is not None and closed["minute"] == 60
    gpu = closed["gpus"]["GPU-1"]
    assert gpu["samples"] == 3 and gpu["temp_c"] == [40.0, 50.0, 60.0] and gpu["throttled"] == 2
    box = closed["sandboxes"]["9"]
    assert box["mem_mib"] == [1000, 1001, 1002] and box["temp_max_c"] == 60.0
    assert "cost_micros" not in box  # the portal's billing computes every cost
    assert rollups.roll(180_000) is None  # nothing folded in the minute since


class FakeLayer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        self.sent.append((group, message))


@pytest.fixture
def latest() -> Any:
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter(match="gpushare:telemetry:latest:*"):
        client.delete(key)
    return client


def test_a_tick_streams_rolls_up_raises_and_stores(
    tmp_path: Path, sent_tasks: Any, latest: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:2:mig=1"))
    agent = Agent("h", backend, ProcessDriver(tmp_path / "sandboxes", host="h"), tmp_path)
    agent.context.inventory.refresh()
    plain, mig_gpu = backend.list_gpus()
    device = mig_gpu.mig_devices[0].uuid
    agent.context.sandboxes.running["a1"] = SandboxSpec(
        "a1", 7, "h", "vision", "olivia", "img", (), (plain.uuid,), False, tier="dedicated"
    )
    agent.context.sandboxes.running["a2"] = SandboxSpec(
        "a2", 8, "h", "vision", "olivia", "img", (), (device,), False, tier="mig"
    )
    backend.inject_overheat(plain.uuid, 95.0)
    layer = FakeLayer()
    clock = {"now": 60_000}
    monkeypatch.setattr(sampler_module, "now_ms", lambda: clock["now"])

    closed: list[Any] = []

    async def ticks(n: int) -> None:
        client = AsyncRedis.from_url(settings.REDIS_URL)
        for tick in range(n):
            if (minute := agent.sampler.close_minute()) is not None:
                closed.append(minute)
            await agent.sampler.publish_all(layer, tick, client)
            clock["now"] += 1000
        await client.aclose()

    asyncio.run(ticks(12))
    groups = {g for g, _ in layer.sent}
    assert {
        f"host.h.gpu.{plain.uuid}",
        f"host.h.gpu.{mig_gpu.uuid}",
        "host.h.sandbox.7",
        "host.h.sandbox.8",
        "host.h.fleet",
    } <= groups
    fleet = [m for g, m in layer.sent if g == "host.h.fleet" and m["type"] == "fleet.samples"]
    assert len(fleet) == 3  # ticks 0, 5 and 10: the host's GPUs together, one message a tick
    assert [m["gpu"] for m in fleet[0]["samples"]] == [plain.uuid, mig_gpu.uuid]
    box = next(m for g, m in layer.sent if g == "host.h.sandbox.7" and m["type"] == "gpu.sample")
    assert set(box["sandboxes"]["7"]) == {"mem_mib", "util_pct"}  # no cost: the agent knows no price
    mig_sample = next(m for g, m in layer.sent if g == "host.h.sandbox.8")
    assert mig_sample["gpu"] == device and mig_sample["parent"] == mig_gpu.uuid
    # 95 °C held 10 s: raised for the GPU (fleet rules) and for the sandbox on it, live and to control.
    raised = [m for g, m in layer.sent if g == "host.h.fleet" and m["type"] == "alert.changed"]
    assert {(m["kind"], m["sandbox"]) for m in raised} == {("temperature", None), ("temperature", 7)}
    [(_q, _t, (host, changes))] = [t for t in sent_tasks if t[1] == "telemetry_alerts"]
    assert host == "h" and len(changes) == 2
    assert any(g == "host.h.sandbox.7" and m["type"] == "alert.changed" for g, m in layer.sent)
    # Crossing into the next minute closes the minute's rollups, for the caller to send.
    clock["now"] = 120_500
    asyncio.run(ticks(1))
    [payload] = closed
    assert payload["minute"] == 60 and set(payload["gpus"]) == {plain.uuid, mig_gpu.uuid}
    assert payload["gpus"][plain.uuid]["samples"] == 12 and set(payload["sandboxes"]) == {"7", "8"}
    stored = read_latest(latest)
    assert {plain.uuid, mig_gpu.uuid, device} <= set(stored)  # GPUs and the sampled MIG device
    assert stored[device]["parent"] == mig_gpu.uuid


def test_heartbeat_carries_the_alert_policy_version(tmp_path: Path, sent_tasks: Any) -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    agent = Agent("h", backend, ProcessDriver(tmp_path / "sandboxes", host="h"), tmp_path)
    agent.set_alert_policy({"version": "abc", "fleet": {"temp_high_c": 70, "temp_clear_c": 60}})
    agent.reports.heartbeat()
    [(_q, _t, ([sent],))] = [t for t in sent_tasks if t[1] == "agent_heartbeats"]
    assert sent["alerts_version"] == "abc" and agent.context.alerts.fleet["temp_high_c"] == 70
