"""A plausible GPU topology for a simulated host (issue 40 item 7), as NVML would report the
boards its models come on, so the embedded platform places multi-GPU requests the way a real
fleet would and the console has something true to the model to show:

- SXM boards (H100, H200, H800, A100 SXM4) sit on NVSwitch: every pair NVLink;
- H100 NVL cards come in NVLink-bridged pairs (0,1), (2,3), ...;
- PCIe cards (H100 PCIe, GH200 aside) in pairs behind one PCIe switch;
- a host of four GPUs or more has two sockets: its first half on NUMA node 0, the rest on 1;
  PCIe paths between GPUs are NODE within a socket and SYSTEM across.

A board is a run of GPUs of one model: GPUs of different models are never NVLinked. The
Alibaba trace's models (the cluster twin's hosts) report nothing, as nothing is known of
their boards: they keep being placed as before topology.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.topology import NODE, NVLINK, SINGLE, SYSTEM

_NVSWITCH = frozenset({"H100-80GB", "H200", "H800-80GB", "A100-80GB", "A100-40GB"})
_BRIDGED_PAIRS = frozenset({"H100-NVL"})
_PCIE_PAIRS = frozenset({"H100-PCIe", "GH200-96GB"})
_KNOWN = _NVSWITCH | _BRIDGED_PAIRS | _PCIE_PAIRS

Placement = tuple[int | None, tuple[tuple[int, str], ...]]  # GpuInfo.numa_node, GpuInfo.links


def simulated_topology(models: Sequence[str]) -> list[Placement]:
    """Per GPU (by index) its NUMA node and links; (None, ()) for a host with a model whose
    board is not known."""
    count = len(models)
    if not count or any(m not in _KNOWN for m in models):
        return [(None, ())] * count
    numa = [i * 2 // count if count >= 4 else 0 for i in range(count)]
    board = _boards(models)
    placed: list[Placement] = []
    for a in range(count):
        links = tuple((b, _level(a, b, models, board, numa)) for b in range(count) if b != a)
        placed.append((numa[a], links))
    return placed


def _boards(models: Sequence[str]) -> list[int]:
    """Each GPU's board: a new one wherever the model changes."""
    board, number = [], 0
    for i, model in enumerate(models):
        if i and model != models[i - 1]:
            number += 1
        board.append(number)
    return board


def _level(a: int, b: int, models: Sequence[str], board: list[int], numa: list[int]) -> str:
    first = a - board.index(board[a])  # positions within the board: pairs are (0,1), (2,3)...
    second = b - board.index(board[b])
    same_board, paired = board[a] == board[b], first // 2 == second // 2
    if same_board and (models[a] in _NVSWITCH or (models[a] in _BRIDGED_PAIRS and paired)):
        return NVLINK
    if same_board and paired:
        return SINGLE  # a pair of cards behind one PCIe switch
    return NODE if numa[a] == numa[b] else SYSTEM
