"""How a host's GPUs are connected, read from NVML once per set of GPUs (scheduler.topology).

Per pair of GPUs: NVLink when ``nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK)``
answers OK (a direct link, an NVLink bridge, or an NVSwitch: an HGX board's every pair),
else the closest PCIe ancestor ``nvmlDeviceGetTopologyCommonAncestor`` names (what
``nvidia-smi topo -m`` prints as PIX, PXB, PHB, NODE, SYS). Per GPU: the NUMA node of its
nearest CPUs, from ``nvmlDeviceGetCpuAffinityWithinScope(..., NVML_AFFINITY_SCOPE_NODE)``
(nvidia-smi's "NUMA Affinity"). Not ``nvmlDeviceGetNumaNodeId``: that is the NUMA node *of*
the GPU's memory, on systems where a GPU is one (Grace Hopper's coherent memory).

Whatever NVML cannot tell (NOT_SUPPORTED, a driver without the call, a failure) is left
unknown, never raised: the scheduler treats unknown as "no preference", as for an agent
from before topology. Readings are kept while the GPUs stay the same, as only a change of
hardware changes them; one that failed for a reason that may pass is read again next time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pynvml

from scheduler.topology import HOSTBRIDGE, INTERNAL, MULTIPLE, NODE, NVLINK, SINGLE, SYSTEM
from workers.gpu.base import GpuInfo

log = logging.getLogger(__name__)

# nvmlGpuTopologyLevel_t -> scheduler.topology's level (NVML_TOPOLOGY_CPU is NODE's old name).
_LEVELS = {
    pynvml.NVML_TOPOLOGY_INTERNAL: INTERNAL,
    pynvml.NVML_TOPOLOGY_SINGLE: SINGLE,
    pynvml.NVML_TOPOLOGY_MULTIPLE: MULTIPLE,
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: HOSTBRIDGE,
    pynvml.NVML_TOPOLOGY_NODE: NODE,
    pynvml.NVML_TOPOLOGY_SYSTEM: SYSTEM,
}
# Answers that stay the same until the hardware or driver changes: unknown for good.
_CANNOT = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_NoPermission,
    pynvml.NVMLError_FunctionNotFound,  # a driver older than the call
    pynvml.NVMLError_InvalidArgument,  # e.g. a pair NVML will not compare (a MIG-mode GPU)
    pynvml.NVMLLibraryMismatchError,
)
# 64-bit words of NUMA node mask asked for: 256 nodes, more than any host has.
_NODE_SET_WORDS = 4

Placement = tuple[int | None, tuple[tuple[int, str], ...]]  # GpuInfo.numa_node, GpuInfo.links


class TopologyReader:
    """Adds each GPU's NUMA node and links to an inventory, reading NVML only when the set
    of GPUs changed (or the last reading was cut short). Its caller holds NVML open."""

    def __init__(self) -> None:
        self._read_for: tuple[str, ...] = ()
        self._read: dict[int, Placement] = {}

    def apply(self, gpus: list[GpuInfo]) -> list[GpuInfo]:
        key = tuple(f"{g.index}:{g.uuid}" for g in gpus)
        if key != self._read_for:
            read, settled = read_topology([g.index for g in gpus])
            self._read, self._read_for = read, key if settled else ()
        else:
            read = self._read
        return [replace(g, numa_node=read[g.index][0], links=read[g.index][1]) for g in gpus]


def read_topology(indices: Sequence[int]) -> tuple[dict[int, Placement], bool]:
    """Per GPU index its (NUMA node, links to the other GPUs), and whether every answer is
    one to keep (False: something failed that may not fail next time)."""
    settled = True
    handles: dict[int, Any] = {}
    for index in indices:
        try:
            handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as err:
            log.info("topology of GPU %d not read: %s", index, err)
            settled = False
    numa: dict[int, int | None] = {}
    for index, handle in handles.items():
        numa[index], answered = _numa_node(handle)
        settled = settled and answered
    links: dict[int, list[tuple[int, str]]] = {index: [] for index in indices}
    present = sorted(handles)
    for position, a in enumerate(present):
        for b in present[position + 1 :]:
            level, answered = _link(handles[a], handles[b])
            settled = settled and answered
            if level is not None:
                links[a].append((b, level))
                links[b].append((a, level))
    return {i: (numa.get(i), tuple(sorted(links[i]))) for i in indices}, settled


def _numa_node(handle: Any) -> tuple[int | None, bool]:
    """The one NUMA node of the GPU's nearest CPUs (None: unknown, or several), and whether
    that answer is one to keep."""
    try:
        words = pynvml.nvmlDeviceGetCpuAffinityWithinScope(
            handle, _NODE_SET_WORDS, pynvml.NVML_AFFINITY_SCOPE_NODE
        )
    except _CANNOT:
        return None, True
    except pynvml.NVMLError as err:
        log.info("NUMA node of a GPU not read: %s", err)
        return None, False
    nodes = [64 * w + bit for w, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1]
    return (nodes[0] if len(nodes) == 1 else None), True


def _link(a: Any, b: Any) -> tuple[str | None, bool]:
    """The level of the link between two GPUs (None: unknown), and whether to keep it."""
    settled = True
    try:
        if (
            pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            == pynvml.NVML_P2P_STATUS_OK
        ):
            return NVLINK, True
    except _CANNOT:
        pass  # no NVLink P2P to ask about: the PCIe path says the rest
    except pynvml.NVMLError as err:
        log.info("NVLink between two GPUs not read: %s", err)
        settled = False
    try:
        return _LEVELS.get(int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b))), settled
    except _CANNOT:
        return None, settled
    except pynvml.NVMLError as err:
        log.info("PCIe path between two GPUs not read: %s", err)
        return None, False
