"""Whole hosts for the pynvml fake (nvml_fake.py), with the topology NVML reports for them
(issue 40 item 7), as ``nvidia-smi topo -m`` shows such machines:

- ``hgx_h100``: an HGX/DGX H100 board, eight SXM GPUs on NVSwitch: every pair NVLink
  (NV18); GPUs 0-3 on NUMA node 0, 4-7 on node 1 (their PCIe paths NODE within a node, SYS
  across).
- ``pcie_a100``: eight PCIe A100s: (0,1), (2,3), (4,5), (6,7) each behind one PCIe switch
  (PIX), the first two pairs NVLink-bridged as well; 0-3 on NUMA node 0, 4-7 on node 1.
- ``mixed``: an H100 NVL pair (NVLink-bridged) on NUMA node 0 beside two A100 PCIe cards on
  one switch on node 1.
"""

from __future__ import annotations

from itertools import combinations

import pynvml

from tests.workers.nvml_fake import A100_PROFILES, H100_PROFILES, Dev, FakeNvml, Profiles

_H100 = ("NVIDIA H100 80GB HBM3", 81559, H100_PROFILES)
_A100_PCIE = ("NVIDIA A100 80GB PCIe", 81920, A100_PROFILES)
_H100_NVL = ("NVIDIA H100 NVL", 95830, H100_PROFILES)


def board_uuid(index: int) -> str:
    return f"GPU-b0a4d000-0000-0000-0000-{index:012d}"


def _gpus(fake: FakeNvml, kinds: list[tuple[str, int, Profiles]], numa: list[int]) -> list[Dev]:
    """The fake's GPUs replaced by these, MIG off, each on its NUMA node."""
    fake.gpus = [
        Dev(board_uuid(i), name, memory, profiles=profiles, numa_node=numa[i])
        for i, (name, memory, profiles) in enumerate(kinds)
    ]
    fake.instances.clear()
    return fake.gpus


def _pcie(fake: FakeNvml, gpus: list[Dev], switches: list[tuple[int, int]]) -> None:
    """PCIe paths: PIX within a switch, NODE across switches of one NUMA node, SYS across nodes."""
    for a, b in combinations(range(len(gpus)), 2):
        if (a, b) in switches:
            level = pynvml.NVML_TOPOLOGY_SINGLE
        elif gpus[a].numa_node == gpus[b].numa_node:
            level = pynvml.NVML_TOPOLOGY_NODE
        else:
            level = pynvml.NVML_TOPOLOGY_SYSTEM
        fake.ancestors[frozenset({gpus[a].uuid, gpus[b].uuid})] = level


def _bridge(fake: FakeNvml, gpus: list[Dev], pairs: list[tuple[int, int]]) -> None:
    fake.nvlink |= {frozenset({gpus[a].uuid, gpus[b].uuid}) for a, b in pairs}


def hgx_h100(fake: FakeNvml) -> FakeNvml:
    gpus = _gpus(fake, [_H100] * 8, [i // 4 for i in range(8)])
    for gpu in gpus:  # Fabric Manager has registered them: ready for CUDA
        gpu.fabric = (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS)
    _pcie(fake, gpus, [])
    _bridge(fake, gpus, list(combinations(range(8), 2)))
    return fake


def pcie_a100(fake: FakeNvml) -> FakeNvml:
    gpus = _gpus(fake, [_A100_PCIE] * 8, [i // 4 for i in range(8)])
    _pcie(fake, gpus, [(0, 1), (2, 3), (4, 5), (6, 7)])
    _bridge(fake, gpus, [(0, 1), (2, 3)])
    return fake


def mixed(fake: FakeNvml) -> FakeNvml:
    gpus = _gpus(fake, [_H100_NVL, _H100_NVL, _A100_PCIE, _A100_PCIE], [0, 0, 1, 1])
    _pcie(fake, gpus, [(0, 1), (2, 3)])
    _bridge(fake, gpus, [(0, 1)])
    return fake
