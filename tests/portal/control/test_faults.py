"""GPU faults: they drain a GPU with an alert, admins drain and undrain, and drained GPUs
take no new sandboxes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from django.test import Client

from portal.control.faults import do_drain_gpu, do_fault_event, do_undrain_gpu
from portal.fleet.models import FleetEvent, Gpu
from portal.telemetry.alerts import do_record_alerts
from portal.telemetry.models import Alert
from tests.portal.helpers import place_all, request
from wire.messages import FaultReport
from wire.telemetry import AlertMessage
from workers.drivers.process import ProcessDriver
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.agent import Agent

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def first_gpu(fleet: Any) -> Gpu:
    return Gpu.objects.filter(mig_enabled=False).order_by("host__name", "index").first()  # type: ignore[return-value]


def test_an_xid_drains_the_gpu_once(fleet: Any) -> None:
    gpu = first_gpu(fleet)
    event = FaultReport(uuid=gpu.uuid, kind="xid", xid=79, detail="fell off the bus", t_ms=0)
    assert do_fault_event(gpu.host.name, event) is True
    assert do_fault_event(gpu.host.name, event) is False  # the same fault again: nothing new
    gpu.refresh_from_db()
    assert gpu.state == "drained" and gpu.drain_reason == "XID error 79: fell off the bus"
    # One alert per fault, the agent's (tests/workers/test_agent_faults.py): the drain is
    # an event of the fleet's log, not a second alert.
    [drained] = FleetEvent.objects.filter(gpu=gpu)
    assert (drained.kind, drained.severity) == ("xid", "info")


@pytest.mark.parametrize("kind", ["app_xid", "xid"])  # "xid": an agent from before issue 18
def test_an_application_xid_is_recorded_and_never_drains(fleet: Any, kind: str) -> None:
    """Guards review §0 #2: XID 31 (a tenant's page fault) drained the whole GPU, on MIG
    every tenant's. Now it is an info event and the GPU stays available."""
    gpu = Gpu.objects.filter(mig_instances__isnull=False).distinct().first()
    assert gpu is not None
    instance = gpu.mig_instances.first()
    assert instance is not None
    event = FaultReport(uuid=instance.uuid, kind=kind, xid=31, detail="XID 31", t_ms=0)
    assert do_fault_event(gpu.host.name, event) is False
    gpu.refresh_from_db()
    assert gpu.state == "available" and gpu.drain_reason == ""
    [noted] = FleetEvent.objects.filter(gpu=gpu)
    assert (noted.kind, noted.severity) == ("app_xid", "info")
    assert noted.message.startswith("XID 31: GPU memory page fault") and instance.uuid in noted.message
    assert not do_fault_event("other-host", event)
    assert (
        do_fault_event(
            gpu.host.name, FaultReport(uuid=instance.uuid, kind="xid", xid=48, detail="XID 48", t_ms=0)
        )
        is True
    )  # a device XID


def test_a_fault_on_a_mig_device_drains_its_gpu(fleet: Any) -> None:
    mig_gpu = Gpu.objects.filter(mig_instances__isnull=False).distinct().first()
    assert mig_gpu is not None
    instance = mig_gpu.mig_instances.first()
    assert instance is not None
    assert do_fault_event(
        mig_gpu.host.name, FaultReport(uuid=instance.uuid, kind="ecc_dbe", detail="1", t_ms=0)
    )
    mig_gpu.refresh_from_db()
    assert mig_gpu.state == "drained" and "double-bit ECC" in mig_gpu.drain_reason


def test_unknown_kinds_and_devices_are_ignored(fleet: Any) -> None:
    gpu = first_gpu(fleet)
    assert not do_fault_event(gpu.host.name, FaultReport(uuid=gpu.uuid, kind="cosmic-ray", detail="", t_ms=0))
    assert not do_fault_event(gpu.host.name, FaultReport(uuid="GPU-nope", kind="xid", detail="", t_ms=0))
    assert not do_fault_event("other-host", FaultReport(uuid=gpu.uuid, kind="xid", detail="", t_ms=0))
    assert not Gpu.objects.filter(state="drained").exists()


def test_drained_gpus_take_no_new_sandboxes(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    dedicated = Gpu.objects.filter(sharing_mode="dedicated", state="available")
    for gpu in dedicated:
        assert do_drain_gpu(gpu.uuid, "maintenance")
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "queued" and sandbox.pending_reason
    for gpu in dedicated:
        assert do_undrain_gpu(gpu.uuid, people["admin"])
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "starting"


def test_undrain_closes_the_gpus_fault_alerts(people: Any, fleet: Any) -> None:
    gpu = first_gpu(fleet)
    fault: dict[str, Any] = {
        "key": f"{gpu.host.name}:gpu:ecc:1",  # as the agent makes keys: under its host
        "state": "raised",
        "kind": "ecc",
        "gpu": gpu.uuid,
        "sandbox": None,
    }
    hot = {**fault, "key": f"{gpu.host.name}:gpu:temperature:1", "kind": "temperature"}
    # What a rule's alert carries that these do not is read with defaults: partial on purpose.
    do_record_alerts(
        gpu.host.name,
        cast(list[AlertMessage], [{**fault, "message": "2 double-bit ECC errors", "t": 0}, hot]),
    )
    do_fault_event(gpu.host.name, FaultReport(uuid=gpu.uuid, kind="ecc_dbe", detail="2", t_ms=0))
    assert do_undrain_gpu(gpu.uuid, people["admin"])
    # The agent never sees an ECC error go away: undraining is what clears it. A temperature
    # alert clears itself as the GPU cools.
    assert [(a.kind, a.cleared_at is None) for a in Alert.objects.order_by("kind")] == [
        ("ecc", False),
        ("temperature", True),
    ]
    assert Alert.objects.get(kind="ecc").clear_reason == f"GPU undrained by {people['admin']}"
    assert FleetEvent.objects.filter(kind="undrained", actor=people["admin"]).exists()
    assert not do_undrain_gpu(gpu.uuid, people["admin"])  # idempotent


def test_console_drain_needs_staff_and_a_reason(people: Any, fleet: Any) -> None:
    gpu = first_gpu(fleet)
    url = f"/console/gpus/{gpu.uuid}/drain/"
    user = Client()
    user.force_login(people["owner"])
    assert user.post(url, {"reason": "x"}).status_code == 302  # to the admin login
    gpu.refresh_from_db()
    assert gpu.state == "available"
    admin = Client()
    admin.force_login(people["admin"])
    assert admin.get(url).status_code == 405
    page = admin.post(url, {"reason": ""}, follow=True).content.decode()
    assert "Say why" in page
    admin.post(url, {"reason": "fan replacement"})
    gpu.refresh_from_db()
    assert gpu.state == "drained" and gpu.drain_reason == "fan replacement"
    page = admin.get("/console/fleet/").content.decode()
    assert "fan replacement" in page and "Undrain" in page
    admin.post(f"/console/gpus/{gpu.uuid}/undrain/")
    gpu.refresh_from_db()
    assert gpu.state == "available"


def test_agent_keeps_a_utilization_window_per_sandbox(tmp_path: Path) -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    agent = Agent("h", backend, ProcessDriver(tmp_path / "sandboxes", host="h"), tmp_path)
    agent.context.utilization.window_s = 60
    assert agent.context.utilization.over_window("a1") is None
    for second, util in enumerate([90.0] * 30 + [0.0] * 90):
        agent.context.utilization.note("a1", second * 1000, util)
    # Only the last 60 s count: the busy start has left the window.
    assert agent.context.utilization.over_window("a1") == (0.0, 60.0)
    agent.context.utilization.note("a1", 121_000, 60.0)
    assert agent.context.utilization.over_window("a1") == (1.0, 60.0)
