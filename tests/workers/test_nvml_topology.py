"""The NVML backend reads how a host's GPUs are connected (issue 40 item 7), on the fake's
board presets (nvml_boards.py); what NVML cannot tell is unknown, never an error."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pynvml
import pytest

from scheduler.topology import NODE, NVLINK, SINGLE, SYSTEM, Topology, best_connected, describe_set
from tests.workers.nvml_boards import hgx_h100, mixed, pcie_a100
from tests.workers.nvml_fake import FakeNvml
from workers.gpu.base import GpuInfo
from workers.gpu.nvml import NvmlBackend

TOPOLOGY_CALLS = (
    "nvmlDeviceGetCpuAffinityWithinScope",
    "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetTopologyCommonAncestor",
)


@pytest.fixture
def on_board(fake: FakeNvml) -> Iterator[Callable[[Callable[[FakeNvml], FakeNvml]], NvmlBackend]]:
    """A backend started on the fake turned into one of the presets."""
    started: list[NvmlBackend] = []

    def start(preset: Callable[[FakeNvml], FakeNvml]) -> NvmlBackend:
        preset(fake)
        started.append(NvmlBackend())
        return started[-1]

    yield start
    for backend in started:
        backend.close()


def topology_of(gpus: list[GpuInfo]) -> Topology:
    return Topology.from_gpus((g.index, g.numa_node, dict(g.links)) for g in gpus)


def topology_calls(fake: FakeNvml) -> int:
    return sum(1 for name, _ in fake.calls if name in TOPOLOGY_CALLS)


def test_an_hgx_board_reads_as_all_nvlink_on_two_numa_nodes(on_board, fake: FakeNvml) -> None:
    gpus = on_board(hgx_h100).list_gpus()
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(dict(g.links) == {p: NVLINK for p in range(8) if p != g.index} for g in gpus)
    assert {g.model for g in gpus} == {"H100-80GB"} and not any(g.not_ready for g in gpus)
    topology = topology_of(gpus)
    chosen = [g.index for g in best_connected(gpus, 4, topology)]
    assert chosen == [0, 1, 2, 3]
    assert describe_set(topology, chosen) == "GPUs 0-3, all linked by NVLink, on NUMA node 0"


def test_a_pcie_host_reads_its_bridged_pairs_switches_and_sockets(on_board) -> None:
    gpus = on_board(pcie_a100).list_gpus()
    links = dict(gpus[0].links)
    assert (links[1], links[2], links[4]) == (NVLINK, NODE, SYSTEM)
    assert dict(gpus[4].links)[5] == SINGLE  # a pair on one switch, without a bridge
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    topology = topology_of(gpus)
    assert [g.index for g in best_connected(gpus, 4, topology)] == [0, 1, 2, 3]
    assert [g.index for g in best_connected(gpus[1:], 4, topology)] == [4, 5, 6, 7]


def test_a_mixed_host(on_board) -> None:
    gpus = on_board(mixed).list_gpus()
    assert [g.model for g in gpus] == ["H100-NVL", "H100-NVL", "A100-80GB", "A100-80GB"]
    assert [dict(g.links) for g in gpus[:2]] == [
        {1: NVLINK, 2: SYSTEM, 3: SYSTEM},
        {0: NVLINK, 2: SYSTEM, 3: SYSTEM},
    ]
    assert dict(gpus[2].links)[3] == SINGLE


def test_topology_is_read_once_while_the_gpus_stay_the_same(on_board, fake: FakeNvml) -> None:
    backend = on_board(pcie_a100)
    first = backend.list_gpus()
    calls = topology_calls(fake)
    # a NUMA read per GPU; NVLink per pair, then the PCIe path of the 26 pairs without a bridge
    assert calls == 8 + 28 + 26
    assert backend.list_gpus() == first
    assert topology_calls(fake) == calls


def test_what_nvml_cannot_tell_is_unknown(backend: NvmlBackend, fake: FakeNvml) -> None:
    # the stock fake answers NOT_SUPPORTED to every topology call (a VM's passed-through GPUs)
    gpus = backend.list_gpus()
    assert [(g.numa_node, g.links) for g in gpus] == [(None, ()), (None, ())]
    assert not topology_of(gpus)
    # a driver without the call: the same, and kept
    fake.fail["nvmlDeviceGetCpuAffinityWithinScope"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert backend.list_gpus() == gpus


def test_a_failed_read_is_unknown_and_read_again(on_board, fake: FakeNvml) -> None:
    backend = on_board(hgx_h100)
    fake.fail["nvmlDeviceGetP2PStatus"] = pynvml.NVML_ERROR_UNKNOWN
    gpus = backend.list_gpus()
    assert dict(gpus[0].links)[1] == NODE  # its NVLink unread this time: the PCIe path said
    assert dict(gpus[0].links)[2] == NVLINK
    again = backend.list_gpus()
    assert dict(again[0].links)[1] == NVLINK


def test_a_numa_mask_of_several_nodes_is_unknown(on_board, fake: FakeNvml, monkeypatch) -> None:
    backend = on_board(hgx_h100)

    def two_nodes(handle, size, scope):
        return [0b11] + [0] * (size - 1)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCpuAffinityWithinScope", two_nodes)
    assert {g.numa_node for g in backend.list_gpus()} == {None}
