"""Which work a policy fails: per class of request, from the placements alone.

    python -m scheduler.research.bench_classes --pods PODS.csv --seed 42 DIR [DIR ...]

A policy can lower the unallocated GPU share by failing the requests that are hardest to
place, the multi-GPU ones, and filling their room with small ones. This counts, per class
of GPU request (several whole GPUs, one whole GPU, a share of one GPU), the part of that
class's GPU demand arriving before the cluster's arrived demand reached 100 % that no
node took. It reads only where each pod went (``placements.csv``'s empty node, or a
replay's node -1) and the trace's pods, so any engine's output, the twin's included, is
judged alike. ``bench_live`` counts the same for all 17 lists and renders the table
(``render``) into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from scheduler.research.bench_markdown import framed, table
from scheduler.research.bench_trace import TRACES
from scheduler.research.trace import PodSpec, build_workload, load_nodes, load_pods

MULTI, ONE, SHARES = "multi-GPU", "1 GPU", "shares"
CLASSES = (MULTI, ONE, SHARES)
BEFORE_PCT = 100  # demand arriving before the cluster's arrived demand reaches this % counts


def pod_class(pod: PodSpec) -> str | None:
    """The class of a pod's GPU request; None for a CPU-only pod (no GPU demand)."""
    if pod.num_gpu > 1:
        return MULTI
    if pod.num_gpu == 1 and pod.gpu_milli >= 1000:
        return ONE
    if pod.num_gpu == 1 and pod.gpu_milli > 0:
        return SHARES
    return None


def class_failures(pods: Sequence[PodSpec], failed: Sequence[bool], capacity_milli: int) -> dict[str, float]:
    """% of each class's GPU demand arriving before arrived ``BEFORE_PCT`` % that failed.

    A pod counts when the demand arrived before it is under the mark (the pod that crosses
    it counts, as in ``bench_live``'s first-failure figure); a class with no demand is left out.
    """
    asked: dict[str, int] = {}
    lost: dict[str, int] = {}
    arrived = 0
    for pod, pod_failed in zip(pods, failed, strict=True):
        kind = pod_class(pod)
        if kind is not None and 100 * arrived < BEFORE_PCT * capacity_milli:
            asked[kind] = asked.get(kind, 0) + pod.total_gpu_milli
            if pod_failed:
                lost[kind] = lost.get(kind, 0) + pod.total_gpu_milli
        arrived += pod.total_gpu_milli
    return {kind: 100 * lost.get(kind, 0) / asked[kind] for kind in CLASSES if asked.get(kind)}


def failed_in(placements: Path) -> list[bool]:
    """Per pod, in order, whether no node took it: a ``placements.csv``'s empty node."""
    with placements.open(newline="") as f:
        return [not row["node"] for row in csv.DictReader(f)]


def median_by_class(per_seed: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    return {
        kind: statistics.median(values)
        for kind in CLASSES
        if (values := [f[kind] for f in per_seed.values() if kind in f])
    }


def render(
    rows: Mapping[str, tuple[dict[str, float], dict[str, float]]], seeds: Sequence[int], command: str
) -> str:
    """The BENCHMARKS.md section: per trace, (live engine, FGD) medians per class."""

    def cell(ours: dict[str, float], fgd: dict[str, float], kind: str) -> str:
        if kind not in ours or kind not in fgd:
            return "-"
        mark = "**" if ours[kind] > fgd[kind] else ""
        return f"{mark}{ours[kind]:.2f} / {fgd[kind]:.2f}{mark}"

    body = [
        [trace.removeprefix("openb_pod_list_"), *(cell(ours, fgd, kind) for kind in CLASSES)]
        for trace, (ours, fgd) in rows.items()
    ]
    not_above = sum(1 for ours, fgd in rows.values() if ours.get(MULTI, 0) <= fgd.get(MULTI, 0))
    return framed(
        "packing-classes",
        [
            "## Which work fails: per class of request (live engine vs FGD)",
            "",
            "Part of each class's GPU demand arriving before the cluster's arrived demand reached",
            f"100 % that no node took, %, median over seeds {seeds[0]}-{seeds[-1]}: gpushare through",
            "`run_cycle` (the live engine) / FGD as the paper replays it; counted from the placements",
            "alone (`scheduler.research.bench_classes`). Bold: gpushare fails more of that class than FGD.",
            f"Made by `{command}`.",
            "",
            *table(["trace", "multi-GPU", "1 GPU", "shares"], body, "lrrr"),
            "",
            f"Multi-GPU demand failed no more than under FGD on {not_above} of {len(rows)} traces.",
        ],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=Path, default=TRACES / "openb_node_list_gpu_node.csv")
    parser.add_argument("--pods", type=Path, required=True, help="the pod list the replays ran")
    parser.add_argument("--seed", type=int, required=True, help="the seed the replays ran with")
    parser.add_argument("--tune", type=float, default=1.3)
    parser.add_argument("dirs", type=Path, nargs="+", help="replay outputs, each with a placements.csv")
    args = parser.parse_args(argv)
    workload = build_workload(load_nodes(args.nodes), load_pods(args.pods), args.seed, args.tune)
    for folder in args.dirs:
        failed = failed_in(folder / "placements.csv")
        if len(failed) != len(workload.pods):
            parser.error(f"{folder}: {len(failed)} placements for {len(workload.pods)} pods (another seed?)")
        shares = class_failures(workload.pods, failed, workload.capacity_milli)
        print(folder, "  ".join(f"{kind} {shares[kind]:.2f}" for kind in CLASSES if kind in shares))


if __name__ == "__main__":
    main()
