"""Topology-aware multi-GPU placement (issue 40 item 7): which of a host's idle GPUs a
multi-GPU request takes, on an HGX board, a PCIe host of NVLink-bridged pairs, a mixed
host, and a host that reports nothing (today's first idle GPUs)."""

from __future__ import annotations

import copy
import time
from itertools import combinations

import pytest

from scheduler.cluster import AUTO, DEDICATED, GpuState, HostState, Place, Request, Snapshot
from scheduler.placement import get_policy
from scheduler.placement.gang import place_gang
from scheduler.topology import (
    HOSTBRIDGE,
    NO_TOPOLOGY,
    NODE,
    NVLINK,
    SINGLE,
    SYSTEM,
    Topology,
    best_connected,
    describe_host,
    describe_set,
)


def hgx(gpus: int = 8) -> Topology:
    """An HGX/DGX H100 board: NVSwitch links every pair; GPUs 0-3 on NUMA 0, 4-7 on NUMA 1."""
    half = gpus // 2
    return Topology(
        {i: i // half for i in range(gpus)}, {pair: NVLINK for pair in combinations(range(gpus), 2)}
    )


def pcie_a100() -> Topology:
    """Eight PCIe A100s: pairs (0,1), (2,3), (4,5), (6,7) NVLink-bridged, each pair behind one
    PCIe switch; 0-3 on NUMA 0, 4-7 on NUMA 1."""
    links = {}
    for a, b in combinations(range(8), 2):
        if a // 4 != b // 4:
            links[(a, b)] = SYSTEM
        elif a // 2 == b // 2:
            links[(a, b)] = NVLINK
        else:
            links[(a, b)] = NODE
    return Topology({i: i // 4 for i in range(8)}, links)


def pcie_switch_pairs() -> Topology:
    """As ``pcie_a100`` without the bridges: each pair shares a PCIe switch only."""
    base = pcie_a100()
    return Topology(
        base.numa, {pair: SINGLE if level == NVLINK else level for pair, level in base.links.items()}
    )


def host(topology: Topology, busy: tuple[int, ...] = (), count: int = 8, name: str = "h") -> HostState:
    gpus = [
        GpuState(f"{name}-gpu{i}", name, i, "H100-80GB", 81920, AUTO, exclusive_busy=i in busy)
        for i in range(count)
    ]
    return HostState(name, True, gpus, topology=topology)


def taken(state: HostState, count: int) -> list[int]:
    free = [g for g in state.gpus if g.idle]
    return [g.index for g in best_connected(free, count, state.topology)]


def whole(count: int, request_id: int = 1, nodes: int = 1) -> Request:
    return Request(request_id, "p", 0, 0.0, DEDICATED, gpu_count=count, nodes=nodes)


# --- the acceptance: HGX and PCIe hosts --------------------------------------------------------


def test_four_gpus_on_an_hgx_host_are_four_nvlink_connected_on_one_numa_node():
    state = host(hgx())
    assert taken(state, 4) == [0, 1, 2, 3]
    assert all(state.topology.link(a, b) == NVLINK for a, b in combinations([0, 1, 2, 3], 2))
    # NUMA node 0 half taken: the other half, rather than straddling the sockets
    assert taken(host(hgx(), busy=(1,)), 4) == [4, 5, 6, 7]


def test_four_gpus_on_a_pcie_host_are_two_pairs_on_one_numa_node():
    assert taken(host(pcie_a100()), 4) == [0, 1, 2, 3]
    # GPU 0 busy: NUMA node 0 cannot give two pairs; node 1 can
    assert taken(host(pcie_a100(), busy=(0,)), 4) == [4, 5, 6, 7]
    # The pairs sharing a PCIe switch count the same way when there is no bridge
    assert taken(host(pcie_switch_pairs(), busy=(2,)), 4) == [4, 5, 6, 7]


def test_two_gpus_on_a_pcie_host_are_a_pair():
    assert taken(host(pcie_a100(), busy=(1,)), 2) == [2, 3]
    assert taken(host(pcie_a100(), busy=(1, 2)), 2) == [4, 5]


def test_without_two_pairs_on_one_node_the_fewest_nodes_and_the_most_pairs():
    # one GPU busy on each node: no node has four free; two whole pairs across the sockets
    assert taken(host(pcie_a100(), busy=(1, 5)), 4) == [2, 3, 6, 7]


def test_a_mixed_host_prefers_its_nvlink_board():
    # GPUs 0-3 an NVSwitch board on NUMA 0; 4-7 PCIe cards on NUMA 1, behind host bridges
    links = {pair: NVLINK for pair in combinations(range(4), 2)}
    links.update({(a, b): HOSTBRIDGE for a, b in combinations(range(4, 8), 2)})
    links.update({(a, b): SYSTEM for a in range(4) for b in range(4, 8)})
    mixed = Topology({i: i // 4 for i in range(8)}, links)
    assert taken(host(mixed, busy=(0,)), 3) == [1, 2, 3]
    assert taken(host(mixed, busy=(0,)), 4) == [4, 5, 6, 7]  # one node beats a broken board


def test_no_topology_takes_the_first_idle_gpus_as_before():
    state = host(NO_TOPOLOGY, busy=(0, 2))
    assert taken(state, 4) == [1, 3, 4, 5]
    # the order given, not re-sorted: exactly today's first k
    free = [g for g in reversed(state.gpus) if g.idle]
    assert [g.index for g in best_connected(free, 2, NO_TOPOLOGY)] == [7, 6]


def test_one_gpu_and_a_whole_host_are_not_searched():
    assert taken(host(pcie_a100(), busy=(0,)), 1) == [1]
    assert taken(host(hgx(), busy=(3,)), 7) == [0, 1, 2, 4, 5, 6, 7]


def test_a_sixteen_gpu_host_is_searched_greedily_and_fast():
    # two 8-GPU NVSwitch islands, each half of its own NUMA node (C(16, 6) > MAX_SETS_ENUMERATED)
    links = {(a, b): NVLINK if a // 8 == b // 8 else SYSTEM for a, b in combinations(range(16), 2)}
    big = Topology({i: i // 8 for i in range(16)}, links)
    started = time.perf_counter()
    got = taken(host(big, busy=(0, 1, 2), count=16), 6)
    assert time.perf_counter() - started < 1.0  # a generous ceiling: it is milliseconds
    assert set(got) == set(range(8, 14))  # island 1 is whole: all six NVLink-linked there


def test_a_topology_survives_a_snapshot_copy_shared():
    state = host(hgx())
    clone = copy.deepcopy(Snapshot([state]))
    assert clone.hosts[0].topology is state.topology


def test_from_gpus_keeps_the_farther_of_two_reports_and_drops_unknown_levels():
    topology = Topology.from_gpus([(0, 0, {1: NVLINK, 2: "warp-drive"}), (1, None, {0: NODE}), (2, 1, {})])
    assert topology.link(0, 1) == NODE
    assert topology.link(0, 2) is None
    assert topology.numa == {0: 0, 2: 1}
    assert Topology.from_gpus([(0, None, {}), (1, None, {})]) is NO_TOPOLOGY
    assert Topology.from_row(topology.row()) == topology
    assert Topology.from_row(None) is NO_TOPOLOGY


# --- the policies use it ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["gpushare", "first-fit"])
def test_policies_grant_the_best_connected_set(policy):
    snapshot = Snapshot([host(pcie_a100(), busy=(0,))])
    place = get_policy(policy).place(snapshot, whole(4))
    assert isinstance(place, Place)
    assert [uuid.rsplit("gpu", 1)[1] for uuid in (g.gpu_uuid for g in place.grants)] == ["4", "5", "6", "7"]


def test_the_chosen_host_does_not_depend_on_topology():
    # Two hosts alike but for topology: the policy picks the same host either way.
    def chosen(topology: Topology) -> str:
        hosts = [host(topology, busy=(0,), name="a"), host(topology, busy=(0, 1, 2, 3), name="b")]
        place = get_policy("gpushare").place(Snapshot(hosts), whole(4))
        assert isinstance(place, Place)
        return place.host

    assert chosen(NO_TOPOLOGY) == chosen(pcie_a100()) == chosen(hgx())


def test_a_gang_takes_the_best_connected_set_on_each_node():
    nodes = [host(pcie_a100(), busy=(0,), name=n) for n in ("n1", "n2")]
    for node in nodes:
        node.cluster = "slurm"
    place = place_gang(Snapshot(nodes), whole(4, nodes=2))
    assert isinstance(place, Place)
    assert sorted(g.gpu_uuid for g in place.grants) == [
        f"{n}-gpu{i}" for n in ("n1", "n2") for i in (4, 5, 6, 7)
    ]


# --- what a person reads ------------------------------------------------------------------------


def test_the_set_is_described():
    assert describe_set(hgx(), [0, 1, 2, 3]) == "GPUs 0-3, all linked by NVLink, on NUMA node 0"
    assert describe_set(pcie_a100(), [0, 1, 2, 3]) == "GPUs 0-3 on NUMA node 0 (two NVLink pairs)"
    assert describe_set(pcie_switch_pairs(), [2, 3, 6, 7]) == (
        "GPUs 2, 3, 6, 7 across NUMA nodes 0 and 1 (two pairs on one PCIe switch)"
    )
    assert describe_set(hgx(), [0]) == ""
    assert describe_set(NO_TOPOLOGY, [0, 1]) == ""


def test_the_host_is_described():
    assert describe_host(hgx(), range(8)) == "NVLink: all 8 GPUs linked · NUMA 0: GPUs 0-3 · NUMA 1: GPUs 4-7"
    assert describe_host(pcie_a100(), range(8)) == (
        "NVLink: GPUs 0, 1 · GPUs 2, 3 · GPUs 4, 5 · GPUs 6, 7 · NUMA 0: GPUs 0-3 · NUMA 1: GPUs 4-7"
    )
    assert describe_host(NO_TOPOLOGY, range(8)) == ""
