"""How a host's GPUs are connected, and which of its idle GPUs a multi-GPU request takes.

A host agent reads, per pair of GPUs, whether they talk over NVLink (NVML's
``nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK)``: directly, through an NVLink
bridge or through NVSwitch) and otherwise the closest PCIe ancestor they share
(``nvmlDeviceGetTopologyCommonAncestor``); and per GPU the NUMA node of the CPUs nearest to
it. A job across GPUs runs at the pace of its slowest link and of memory copies through the
CPUs it was given, so the GPUs of a multi-GPU grant are chosen as ``best_connected`` says:

1. every pair linked by NVLink (an HGX/DGX board's NVSwitch links them all);
2. then on as few NUMA nodes as it can, and on one if the host has room there;
3. then the most pairs that are close (NVLink, one board, one PCIe switch): on a PCIe host
   of NVLink-bridged pairs a 4-GPU request gets two pairs;
4. then the nearest PCIe ancestors overall; then the lowest indices.

Only which of the chosen host's GPUs: never which host, nor how hosts score (the FGD trace
figures do not see topology). A host that reports none (an agent from before this, a model
whose board nobody knows) gets its first idle GPUs, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from math import comb
from operator import attrgetter
from typing import Any, Protocol, TypeVar

# Link levels between two GPUs of a host, closest first. All but NVLINK are NVML's
# nvmlGpuTopologyLevel_t, for pairs that have no NVLink between them.
NVLINK = "nvlink"  # P2P over NVLink: a direct link, an NVLink bridge or an NVSwitch
INTERNAL = "internal"  # on one board (a dual-GPU card)
SINGLE = "single"  # behind one PCIe switch
MULTIPLE = "multiple"  # behind several PCIe switches, below one host bridge
HOSTBRIDGE = "hostbridge"  # below one PCIe host bridge
NODE = "node"  # on one NUMA node, across host bridges
SYSTEM = "system"  # across NUMA nodes: traffic crosses the sockets' interconnect
LEVELS = (NVLINK, INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM)
_RANK = {level: rank for rank, level in enumerate(LEVELS)}
_UNKNOWN = len(LEVELS)  # a pair nobody reported: farther than any known level
# Pairs that exchange data without going through a CPU's root complex.
_CLOSE = _RANK[SINGLE]
# Sets of GPUs looked at one by one up to this many (C(16, 4) = 1,820); beyond, a greedy
# search (16-GPU hosts asked for 5 to 11 GPUs), so a placement never costs more than a few ms.
MAX_SETS_ENUMERATED = 2000


class _Indexed(Protocol):
    @property
    def index(self) -> int: ...


@dataclass(frozen=True)
class Topology:
    """One host's GPU topology. Immutable: snapshot copies share it."""

    # GPU index -> NUMA node of its nearest CPUs; absent: unknown.
    numa: Mapping[int, int] = field(default_factory=dict)
    # (lower index, higher index) -> one of LEVELS; absent: unknown.
    links: Mapping[tuple[int, int], str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.numa or self.links)

    def __deepcopy__(self, memo: object) -> Topology:
        return self

    def link(self, a: int, b: int) -> str | None:
        return self.links.get((a, b) if a < b else (b, a))

    @classmethod
    def from_gpus(cls, gpus: Iterable[tuple[int, int | None, Mapping[int, str]]]) -> Topology:
        """From what each GPU reports: (its index, its NUMA node, the level of its link to
        each peer by the peer's index). Where two GPUs of a pair say different things, the
        farther level counts; a level this version does not know is unknown."""
        numa: dict[int, int] = {}
        links: dict[tuple[int, int], str] = {}
        for index, node, peers in gpus:
            if node is not None:
                numa[index] = node
            for peer, level in peers.items():
                if level not in _RANK or peer == index:
                    continue
                pair = (index, peer) if index < peer else (peer, index)
                known = links.get(pair)
                if known is None or _RANK[level] > _RANK[known]:
                    links[pair] = level
        return cls(numa, links) if numa or links else NO_TOPOLOGY

    def row(self) -> list[list[list[int | str]]] | None:
        """As plain JSON (the preview's digest); None when empty."""
        if not self:
            return None
        return [
            [[i, n] for i, n in sorted(self.numa.items())],
            [[a, b, level] for (a, b), level in sorted(self.links.items())],
        ]

    @classmethod
    def from_row(cls, row: Any) -> Topology:
        """``row``'s inverse; an absent or empty row is no topology."""
        if not row:
            return NO_TOPOLOGY
        nodes, pairs = row
        return cls({int(i): int(n) for i, n in nodes}, {(int(a), int(b)): str(lv) for a, b, lv in pairs})


NO_TOPOLOGY = Topology()
G = TypeVar("G", bound=_Indexed)


def best_connected(gpus: Sequence[G], count: int, topology: Topology) -> list[G]:
    """``count`` of ``gpus`` (a host's idle GPUs that can take the request), the best
    connected as the module says; the first ``count`` when the host reports no topology."""
    if count <= 1 or len(gpus) <= count or not topology:
        return list(gpus[:count])
    ordered = sorted(gpus, key=attrgetter("index"))
    indices = [g.index for g in ordered]
    ranks = [[_rank(topology.link(a, b)) for b in indices] for a in indices]
    numa = [topology.numa.get(i) for i in indices]
    positions = range(len(ordered))
    if comb(len(ordered), count) <= MAX_SETS_ENUMERATED:
        # combinations() comes in lexicographic order and min() keeps the first of equals:
        # ties go to the lowest indices.
        best = min(combinations(positions, count), key=lambda s: _key(s, ranks, numa))
    else:
        best = _greedy(len(ordered), count, ranks, numa)
    return [ordered[p] for p in best]


def _rank(level: str | None) -> int:
    return _UNKNOWN if level is None else _RANK[level]


def _key(chosen: Sequence[int], ranks: list[list[int]], numa: list[int | None]) -> tuple[int, ...]:
    """Lower is better: not all NVLink, NUMA nodes spanned, close pairs (negated), the sum
    of the pairs' levels."""
    pair_ranks = [ranks[a][b] for a, b in combinations(chosen, 2)]
    return (
        any(pair_ranks),  # NVLink ranks 0
        len({numa[p] for p in chosen}),
        -sum(1 for r in pair_ranks if r <= _CLOSE),
        sum(pair_ranks),
    )


def _greedy(size: int, count: int, ranks: list[list[int]], numa: list[int | None]) -> tuple[int, ...]:
    """From each GPU in turn, add the GPU that keeps the set best until it has ``count``;
    the best of those sets (ties: the lowest indices)."""
    best: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    for seed in range(size):
        chosen = [seed]
        while len(chosen) < count:
            step = min(
                (p for p in range(size) if p not in chosen), key=lambda p: _key([*chosen, p], ranks, numa)
            )
            chosen.append(step)
        found = tuple(sorted(chosen))
        ranked = (_key(found, ranks, numa), found)
        if best is None or ranked < best:
            best = ranked
    assert best is not None  # noqa: S101 - size > count >= 2
    return best[1]


# --- what a person reads ----------------------------------------------------------------------

_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight")


def _count(n: int, noun: str) -> str:
    return f"{_WORDS[n] if n < len(_WORDS) else n} {noun}{'' if n == 1 else 's'}"


def gpu_list(indices: Iterable[int]) -> str:
    """ "GPUs 0-3", "GPUs 0, 1, 4, 5", "GPU 2"."""
    ordered = sorted(indices)
    if len(ordered) == 1:
        return f"GPU {ordered[0]}"
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"GPUs {ordered[0]}-{ordered[-1]}"
    return "GPUs " + ", ".join(str(i) for i in ordered)


def describe_set(topology: Topology, indices: Iterable[int]) -> str:
    """How the GPUs a placement took are connected: "GPUs 0-3, all linked by NVLink, on NUMA
    node 0", "GPUs 0-3 on NUMA node 0 (two NVLink pairs)"; "" for one GPU, or a host that
    reports no topology."""
    chosen = sorted(indices)
    if len(chosen) < 2 or not topology:
        return ""
    nodes = sorted({topology.numa[i] for i in chosen if i in topology.numa})
    known_numa = bool(nodes) and all(i in topology.numa for i in chosen)
    where = ""
    if known_numa:
        where = f"on NUMA node {nodes[0]}" if len(nodes) == 1 else f"across NUMA nodes {_and(nodes)}"
    levels = [topology.link(a, b) for a, b in combinations(chosen, 2)]
    if all(level == NVLINK for level in levels):
        return f"{gpu_list(chosen)}, all linked by NVLink" + (f", {where}" if where else "")
    nvlink = sum(1 for level in levels if level == NVLINK)
    switch = sum(1 for level in levels if level in (INTERNAL, SINGLE))
    pairs = [_count(nvlink, "NVLink pair")] if nvlink else []
    pairs += [_count(switch, "pair") + " on one PCIe switch"] if switch else []
    if not pairs and all(level is not None for level in levels):
        pairs = ["no two linked by NVLink or one PCIe switch"]
    said = f"{gpu_list(chosen)}" + (f" {where}" if where else "")
    return said + (f" ({', '.join(pairs)})" if pairs else "")


def describe_host(topology: Topology, indices: Iterable[int]) -> str:
    """The console's line for a host: "NVLink: all 8 GPUs linked · NUMA 0: GPUs 0-3 · NUMA 1:
    GPUs 4-7", "NVLink: GPUs 0, 1 · GPUs 2, 3 · ..."; "" when it reports no topology."""
    gpus = sorted(indices)
    if not topology or not gpus:
        return ""
    parts = []
    pairs = list(combinations(gpus, 2))
    if pairs and all(topology.link(a, b) == NVLINK for a, b in pairs):
        parts.append(f"NVLink: all {len(gpus)} GPUs linked")
    else:
        groups = [g for g in _nvlink_groups(topology, gpus) if len(g) > 1]
        if groups:
            parts.append("NVLink: " + " · ".join(gpu_list(g) for g in groups))
    by_node: dict[int, list[int]] = {}
    for i in gpus:
        if i in topology.numa:
            by_node.setdefault(topology.numa[i], []).append(i)
    parts += [f"NUMA {node}: {gpu_list(members)}" for node, members in sorted(by_node.items())]
    return " · ".join(parts)


def _nvlink_groups(topology: Topology, gpus: list[int]) -> list[list[int]]:
    """The GPUs NVLink connects, directly or through each other, group by group."""
    groups: list[list[int]] = []
    placed: set[int] = set()
    for start in gpus:
        if start in placed:
            continue
        group, frontier = [start], [start]
        placed.add(start)
        while frontier:
            a = frontier.pop()
            for b in gpus:
                if b not in placed and topology.link(a, b) == NVLINK:
                    placed.add(b)
                    group.append(b)
                    frontier.append(b)
        groups.append(sorted(group))
    return groups


def _and(items: Sequence[int]) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
