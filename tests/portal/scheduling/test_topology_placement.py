"""GPU topology from the agent to the placement (issue 40 item 7): an inventory's NUMA nodes
and links reach the fleet's rows and the scheduler's snapshot; a multi-GPU request on a
simulated HGX host gets four NVLink-connected GPUs and the request form's answer names them;
an agent that reports no topology is placed as before."""

from __future__ import annotations

from typing import Any

import pytest

from portal.control.faults import do_drain_gpu
from portal.fleet.inventory import BadInventory, do_sync_inventory
from portal.fleet.models import Gpu
from portal.sandboxes import actions
from portal.scheduling import digest
from portal.scheduling.preview import preview_request
from portal.scheduling.snapshot import build_snapshot
from scheduler.topology import NO_TOPOLOGY, NVLINK, SYSTEM
from tests.conftest import seed_host
from tests.portal.helpers import client_for

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def ask(people: Any, catalog: Any, gpu_count: int) -> actions.SandboxRequest:
    return actions.SandboxRequest(
        project=people["project"], tier=catalog["dedicated"], image=catalog["image"], isolation="container",
        gpu_count=gpu_count,
    )  # fmt: skip


def test_an_inventory_carries_topology_into_the_rows_and_the_snapshot() -> None:
    seed_host("hgx", "H100-80GB:8")
    gpu = Gpu.objects.get(host__name="hgx", index=5)
    assert gpu.numa_node == 1
    assert gpu.links == {str(p): NVLINK for p in range(8) if p != 5}
    [host] = build_snapshot().hosts
    assert host.topology.numa == {i: i // 4 for i in range(8)}
    assert host.topology.link(0, 7) == NVLINK


def test_a_four_gpu_request_on_an_hgx_host_gets_four_nvlink_gpus_and_the_answer_names_them(
    people: Any, catalog: Any, sent_tasks: Any
) -> None:
    seed_host("hgx", "H100-80GB:8")
    # one GPU of NUMA node 0 out of service: the first four idle would straddle the sockets
    do_drain_gpu(Gpu.objects.get(host__name="hgx", index=1).uuid, "test")
    answer = preview_request(people["owner"], ask(people, catalog, 4))
    assert answer.verdict == "now"
    assert answer.message == "starts now on hgx (GPUs 4-7, all linked by NVLink, on NUMA node 1)"
    by_uuid = dict(Gpu.objects.values_list("uuid", "index"))
    assert sorted(by_uuid[uuid] for uuid in answer.devices) == [4, 5, 6, 7]


def test_an_agent_that_reports_no_topology_is_placed_as_before(
    people: Any, catalog: Any, sent_tasks: Any
) -> None:
    seed_host("old", "H100-80GB:8")
    Gpu.objects.update(numa_node=None, links={})  # what an agent from before topology leaves
    do_drain_gpu(Gpu.objects.get(host__name="old", index=1).uuid, "test")
    [host] = build_snapshot().hosts
    assert host.topology is NO_TOPOLOGY
    answer = preview_request(people["owner"], ask(people, catalog, 4))
    assert answer.message == "starts now on old"
    by_uuid = dict(Gpu.objects.values_list("uuid", "index"))
    assert sorted(by_uuid[uuid] for uuid in answer.devices) == [0, 2, 3, 4]  # the first idle ones


def _gpu(index: int, **extra: Any) -> dict[str, Any]:
    return {
        "uuid": f"GPU-{index}", "index": index, "name": "NVIDIA A100 80GB PCIe", "model": "A100-80GB",
        "memory_mib": 81920, "mig_enabled": False, "mig_devices": [], **extra,
    }  # fmt: skip


def test_the_inventory_checks_links_and_keeps_them_up_to_date() -> None:
    do_sync_inventory("pcie", "nvml", "docker", [_gpu(0, numa_node=0, links=[[1, "nvlink"], [2, "warp"]])])
    gpu = Gpu.objects.get(uuid="GPU-0")
    assert (gpu.numa_node, gpu.links) == (0, {"1": "nvlink"})  # a level not known here: unknown
    do_sync_inventory("pcie", "nvml", "docker", [_gpu(0, numa_node=1, links=[[1, "system"]])])
    gpu.refresh_from_db()
    assert (gpu.numa_node, gpu.links) == (1, {"1": SYSTEM})
    for bad in ([["one", "nvlink"]], "nvlink", [[1]], [[1, 2]]):
        with pytest.raises(BadInventory, match="link"):
            do_sync_inventory("pcie", "nvml", "docker", [_gpu(0, links=bad)])
    with pytest.raises(BadInventory, match="numa_node"):
        do_sync_inventory("pcie", "nvml", "docker", [_gpu(0, numa_node=-1)])


def test_the_preview_digest_keeps_the_topology() -> None:
    seed_host("hgx", "H100-80GB:8")
    [host] = build_snapshot().hosts
    row = digest._host_row(host)
    assert digest._host(row).topology == host.topology
    assert digest._host(row[:8]).topology is NO_TOPOLOGY  # a digest from before topology


def test_the_fleet_page_shows_how_a_hosts_gpus_are_linked(people: Any) -> None:
    seed_host("hgx", "H100-80GB:8")
    seed_host("plain", "T4:2")  # a trace model: nothing known of its board, nothing shown
    page = client_for(people["admin"]).get("/console/fleet/").content.decode()
    assert "NVLink: all 8 GPUs linked · NUMA 0: GPUs 0-3 · NUMA 1: GPUs 4-7 (simulated)" in page
    assert page.count('class="small muted topology"') == 1
