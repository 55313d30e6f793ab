"""How many whole GPUs consolidation frees per migration, on the default trace at 130%.

Replays the Alibaba default trace to its end (arrived 130%) with a policy, then asks the
consolidation planner (``scheduler.defrag.plan_consolidation``) to empty partly used GPUs by moving
sharing pods onto other GPUs: within their node, or to another node that has the CPU and
memory the pod needs (both variants are reported). Whole-GPU pods never move.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from functools import cache
from pathlib import Path
from typing import Any

from scheduler.defrag import HostRoom, Share, SharedGpu, plan_consolidation
from scheduler.research.bench_markdown import section, without_markers, write_section
from scheduler.research.bench_trace import TRACES
from scheduler.research.replay import replay
from scheduler.research.result import ReplayResult
from scheduler.research.trace import Workload, build_workload, load_nodes, load_pods


@cache
def _replayed(nodes_csv: Path, pods_csv: Path, policy: str, seed: int) -> tuple[Workload, ReplayResult]:
    workload = build_workload(load_nodes(nodes_csv), load_pods(pods_csv), seed, 1.3)
    return workload, replay(workload, policy)


def measure(
    nodes_csv: Path, pods_csv: Path, policy: str, seed: int, cross_node: bool, at_pct: int
) -> dict[str, Any]:
    """Consolidate the state the replay had when arrivals reached ``at_pct`` % of capacity."""
    workload, result = _replayed(nodes_csv, pods_csv, policy, seed)
    cutoff = next(
        (i + 1 for i, a in enumerate(result.arrived_milli) if result.pct(a) >= at_pct),
        len(result.node),
    )
    shares: dict[int, dict[int, list[Share]]] = defaultdict(lambda: defaultdict(list))
    cpu_used: dict[int, int] = defaultdict(int)
    memory_used: dict[int, int] = defaultdict(int)
    for seq, (node, gpus) in enumerate(zip(result.node[:cutoff], result.gpus[:cutoff], strict=True)):
        if node < 0:
            continue
        pod = workload.pods[seq]
        cpu_used[node] += pod.cpu_milli
        memory_used[node] += pod.memory_mib
        for gpu in gpus:
            shares[node][gpu].append(
                Share(f"{seq}", pod.gpu_milli, 0, pod.models, pod.cpu_milli, pod.memory_mib)
            )
    gpus_all = [
        SharedGpu(f"{spec.name}/{g}", spec.model, 0, tuple(shares[n][g]), host=spec.name)
        for n, spec in enumerate(workload.nodes)
        for g in range(spec.gpus)
    ]
    if cross_node:
        rooms = {
            spec.name: HostRoom(spec.cpu_milli - cpu_used[n], spec.memory_mib - memory_used[n])
            for n, spec in enumerate(workload.nodes)
        }
        plans = [plan_consolidation(gpus_all, hosts=rooms)]
    else:
        by_node: dict[str, list[SharedGpu]] = defaultdict(list)
        for shared in gpus_all:
            by_node[shared.host].append(shared)
        plans = [plan_consolidation(node_gpus) for node_gpus in by_node.values()]
    freed = sum(len(p.frees) for p in plans)
    migrations = sum(len(p.migrations) for p in plans)
    return {
        "policy": policy,
        "at": at_pct,
        "scope": "any node with room" if cross_node else "within the node",
        "gpus": len(gpus_all),
        "free_before": sum(1 for g in gpus_all if not g.shares),
        "partly_used": sum(1 for g in gpus_all if 0 < sum(s.milli for s in g.shares) < 1000),
        "freed": freed,
        "migrations": migrations,
        "freed_per_migration": freed / migrations if migrations else 0.0,
    }


def render(rows: list[dict[str, Any]]) -> str:
    return section(
        "consolidation",
        "Consolidation on the default trace",
        [
            "Replaying the default trace (seed 42) to arrived 100% and 130%, the consolidation",
            "planner empties partly used GPUs by moving sharing pods to other GPUs: within the",
            "node, or to any node with the CPU and memory the pod needs",
            "(`python -m scheduler.research.bench_consolidation`).",
        ],
        [
            "policy",
            "arrived %",
            "moves to",
            "whole GPUs free",
            "partly used",
            "GPUs freed",
            "migrations",
            "freed per migration",
        ],
        [
            (
                r["policy"],
                r["at"],
                r["scope"],
                r["free_before"],
                r["partly_used"],
                r["freed"],
                r["migrations"],
                f"{r['freed_per_migration']:.2f}",
            )
            for r in rows
        ],
        align="lrlrrrrr",
    )


def matrix(nodes_csv: Path, pods_csv: Path, policies: list[str], seed: int) -> list[dict[str, Any]]:
    """Every policy at arrived 100% and 130%, within nodes and across them."""
    return [
        measure(nodes_csv, pods_csv, policy, seed, cross_node, at)
        for policy in policies
        for at in (100, 130)
        for cross_node in (False, True)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=Path, default=TRACES / "openb_node_list_gpu_node.csv")
    parser.add_argument("--pods", type=Path, default=TRACES / "openb_pod_list_default.csv")
    parser.add_argument("--policies", default="bestfit,fgd")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = matrix(args.nodes, args.pods, args.policies.split(","), args.seed)
    rendered = render(rows)
    print(without_markers(rendered))
    if args.out:
        write_section(args.out, rendered)


if __name__ == "__main__":
    main()
