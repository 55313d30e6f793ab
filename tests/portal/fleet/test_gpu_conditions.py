"""The portal's side of the GPU conditions an agent reads from the board (issue 36, review 3
new #4 and #9): a GPU whose NVLink fabric is not ready is unavailable with the agent's
reason, takes no sandbox, shows why on the fleet page, and comes back by itself once ready;
a failed or pending memory repair drains the GPU like an XID, with words an operator acts on.
"""

from __future__ import annotations

from typing import Any

import pytest

from portal.control.faults import do_drain_gpu, do_fault_event
from portal.fleet.actions import lose_host
from portal.fleet.inventory import do_sync_inventory
from portal.fleet.models import FleetEvent, Gpu, Host
from tests.portal.helpers import client_for, place_all, request
from wire.messages import FaultReport
from workers.gpu.base import MemoryRepairs
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]

FABRIC_WAIT = (
    "NVLink fabric not ready: Fabric Manager has not registered this GPU (state in progress); "
    "CUDA fails with error 802 on it until then; check that nvidia-fabricmanager runs, at the "
    "driver's version"
)
# The fleet fixture's dedicated GPUs: (host, spec, indexes).
DEDICATED = (("h100", "H100-80GB:4:mig=0,1", (2, 3)), ("a100", "A100-80GB:4", (0, 1)))


def report(host: str, spec: str, not_ready: dict[int, str]) -> None:
    """The host's agent sends its inventory, with these GPUs' fabrics not ready."""
    backend = SimulatedBackend(host, parse_sim_spec(spec))
    for gpu in backend.list_gpus():
        backend.set_fabric_problem(gpu.uuid, not_ready.get(gpu.index, ""))
    do_sync_inventory(host, "nvml", "docker", [g.to_json() for g in backend.list_gpus()])


def dedicated_gpus() -> list[Gpu]:
    return list(Gpu.objects.filter(sharing_mode="dedicated").order_by("host__name", "index"))


def test_a_gpu_whose_fabric_is_not_ready_takes_no_sandbox_and_comes_back_once_ready(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    for host, spec, indexes in DEDICATED:
        report(host, spec, {i: FABRIC_WAIT for i in indexes})
    assert {(g.state, g.unavailable_reason) for g in dedicated_gpus()} == {("unavailable", FABRIC_WAIT[:200])}
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "queued"  # no dedicated GPU is offered

    page = client_for(people["admin"]).get("/console/fleet/").content.decode()
    assert "NVLink fabric not ready: Fabric Manager has not registered this GPU (state in progress)" in page

    for host, spec, _ in DEDICATED:  # Fabric Manager registered them: no admin needed
        report(host, spec, {})
    assert {(g.state, g.unavailable_reason) for g in dedicated_gpus()} == {("available", "")}
    back = FleetEvent.objects.filter(kind="available").first()
    assert back is not None and "it was unavailable: NVLink fabric not ready" in back.message
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "starting"


def test_gpus_reported_ready_or_by_an_agent_without_fabric_checks_stay_available(fleet: Any) -> None:
    report("a100", "A100-80GB:4", {})
    backend = SimulatedBackend("h100", parse_sim_spec("H100-80GB:4:mig=0,1"))
    older = [{k: v for k, v in g.to_json().items() if k != "not_ready"} for g in backend.list_gpus()]
    do_sync_inventory("h100", "nvml", "docker", older)
    assert set(Gpu.objects.values_list("state", flat=True)) == {"available"}
    assert not FleetEvent.objects.filter(kind="unavailable").exists()


def test_a_drained_gpu_stays_drained_and_a_lost_hosts_gpu_takes_the_fabric_reason(fleet: Any) -> None:
    first, second = dedicated_gpus()[:2]  # a100 #0 and #1
    assert do_drain_gpu(first.uuid, "fan replacement")
    lose_host(Host.objects.select_for_update().get(name="a100"), "missed heartbeats")
    second.refresh_from_db()
    assert (second.state, second.unavailable_reason) == ("unavailable", "host a100 lost")
    report("a100", "A100-80GB:4", {0: FABRIC_WAIT, 1: FABRIC_WAIT})
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.state, first.drain_reason) == ("drained", "fan replacement")
    assert (second.state, second.unavailable_reason) == ("unavailable", FABRIC_WAIT[:200])


def test_a_failed_row_remap_drains_the_gpu_saying_it_needs_replacement(people: Any, fleet: Any) -> None:
    gpu = dedicated_gpus()[0]
    [(kind, detail)] = MemoryRepairs(0, 4, remap_failed=True).faults()
    assert do_fault_event(gpu.host.name, FaultReport(uuid=gpu.uuid, kind=kind, detail=detail, t_ms=0))
    gpu.refresh_from_db()
    assert gpu.state == "drained"
    assert gpu.drain_reason.startswith("row remapping failed: the GPU needs replacement (RMA)")
    assert FleetEvent.objects.filter(gpu=gpu, kind="remap_failed").exists()
    page = client_for(people["admin"]).get("/console/fleet/").content.decode()
    assert "row remapping failed: the GPU needs replacement (RMA)" in page


@pytest.mark.parametrize(
    ("repairs", "reason"),
    [
        (MemoryRepairs(0, 1, remap_pending=True), "a row remap is pending: reset the GPU when idle"),
        (
            MemoryRepairs(retired_pages_dbe=2, retirement_pending=True),
            "a page retirement is pending: reset the GPU",
        ),
    ],
)
def test_a_pending_memory_repair_drains_the_gpu_for_a_reset_and_keeps_its_sandboxes(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, repairs: MemoryRepairs, reason: str
) -> None:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    gpu = Gpu.objects.get(allocations__sandbox=sandbox, allocations__active=True)
    [(kind, detail)] = repairs.faults()
    assert do_fault_event(gpu.host.name, FaultReport(uuid=gpu.uuid, kind=kind, detail=detail, t_ms=0))
    gpu.refresh_from_db()
    assert gpu.state == "drained" and gpu.drain_reason.startswith(reason)
    sandbox.refresh_from_db()
    assert sandbox.state == "starting"  # not stopped: it keeps running until its owner is done
    assert not [t for t in sent_tasks if t[1] == "stop_sandbox"]
