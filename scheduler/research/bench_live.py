"""The product's scheduler on the FGD paper's traces: the live engine against FGD.

    python -m scheduler.research.bench_live [--seeds 10] [--workers 2] [--out BENCHMARKS.md]

Every one of the 17 traces the paper published results for, at seeds 42-51: gpushare
through ``run_cycle`` (``replay_live``, 100 arrivals per cycle, the portal's default
policy learning online) and FGD as the paper runs it (our re-implementation, checked
against the published curves in the ``trace`` section). Per trace: unallocated GPU % at
arrived 90/100/130 (median over seeds), the multi-GPU demand that failed before arrived
100 % and where the first multi-GPU pod failed; then the default trace's whole curve from
arrived 50 to 130 %. A second section, from the same replays, gives each class's failures
(multi-GPU, 1 GPU, shares: ``bench_classes``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

from scheduler.research.bench_classes import MULTI, class_failures, median_by_class
from scheduler.research.bench_classes import render as classes_render
from scheduler.research.bench_markdown import without_markers, write_section
from scheduler.research.bench_trace import (
    TRACES,
    Curve,
    anchored_traces,
    bucket_curve,
    published_at_100,
    published_curves,
    unallocated,
)
from scheduler.research.live_replay import DEFAULT_BATCH, replay_live
from scheduler.research.replay import replay
from scheduler.research.result import ReplayResult
from scheduler.research.trace import Workload, build_workload, load_nodes, load_pods

SEEDS = tuple(range(42, 52))
POINTS = (90, 100, 130)
CURVE_POINTS = tuple(range(50, 131, 10))
NODES = TRACES / "openb_node_list_gpu_node.csv"
POLICIES = ("gpushare", "fgd")  # gpushare: the live engine; fgd: the paper's replay
BEGIN, END = "<!-- bench:live-traces:begin -->", "<!-- bench:live-traces:end -->"


@dataclass
class Runs:
    """One policy's replays of one trace, per seed."""

    curves: dict[int, Curve] = field(default_factory=dict)
    multi_failed_pct: dict[int, float] = field(default_factory=dict)
    first_multi_failure: dict[int, float | None] = field(default_factory=dict)
    walls: list[float] = field(default_factory=list)
    # Per seed: % of each class's GPU demand that failed before arrived 100 % (bench_classes).
    class_failed: dict[int, dict[str, float]] = field(default_factory=dict)


def first_multi_gpu_failure(workload: Workload, result: ReplayResult) -> float | None:
    """The arrived % at the first multi-GPU pod that failed (None: none did)."""
    for pod, node, arrived in zip(workload.pods, result.node, result.arrived_milli, strict=True):
        if pod.num_gpu > 1 and node < 0:
            return result.pct(arrived)
    return None


def run_job(
    job: tuple[str, str, int],
) -> tuple[str, str, int, Curve, float, float | None, float, dict[str, float]]:
    trace, policy, seed = job
    workload = build_workload(load_nodes(NODES), load_pods(TRACES / f"{trace}.csv"), seed, 1.3)
    result = replay_live(workload, DEFAULT_BATCH) if policy == "gpushare" else replay(workload, policy)
    curve = bucket_curve(
        [result.pct(m) for m in result.arrived_milli], [result.pct(m) for m in result.used_milli]
    )
    classes = class_failures(workload.pods, [n < 0 for n in result.node], workload.capacity_milli)
    failed, first = classes.get(MULTI, 0.0), first_multi_gpu_failure(workload, result)
    return trace, policy, seed, curve, failed, first, result.wall_s, classes


def run_all(traces: list[str], seeds: tuple[int, ...], workers: int) -> dict[str, dict[str, Runs]]:
    jobs = [(t, p, s) for t in traces for p in POLICIES for s in seeds]
    # Slowest first, so no worker is left with a long live replay at the end.
    jobs.sort(key=lambda j: j[1] != "gpushare")
    runs = {t: {p: Runs() for p in POLICIES} for t in traces}
    with Pool(workers) as pool:
        for trace, policy, seed, curve, failed, first, wall, classes in pool.imap_unordered(run_job, jobs):
            run = runs[trace][policy]
            run.class_failed[seed] = classes
            run.curves[seed], run.multi_failed_pct[seed], run.first_multi_failure[seed] = curve, failed, first
            run.walls.append(wall)
    return runs


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(runs: dict[str, dict[str, Runs]], command: str, workers: int) -> str:
    seeds = sorted({s for r in runs.values() for s in r["gpushare"].curves})
    lines = [
        BEGIN,
        "## The portal's scheduler on the paper's traces (live engine vs FGD)",
        "",
        f"gpushare is replayed through `run_cycle` ({DEFAULT_BATCH} arrivals per cycle, the portal's default",
        "policy and queue order, learning the typical requests from the pods already arrived); fgd is",
        "the paper's policy replayed as the paper does, with the trace's typical pods known in advance.",
        f"Unallocated GPU % = 100 - median over seeds {seeds[0]}-{seeds[-1]} of allocated % at arrived x %",
        "(lower is better). *multi-GPU failed* is the part of the multi-GPU demand arriving before",
        "arrived 100 % that no host could take (median over seeds); *first failure* the median arrived %",
        f"at the first multi-GPU pod that failed. Made by `{command}` on {workers} worker processes.",
        "",
        "| trace | gpushare @90 | fgd @90 | gpushare @100 | fgd @100 | paper fgd @100 | gpushare @130 "
        "| fgd @130 | multi-GPU failed % gpushare / fgd | first failure gpushare / fgd |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    below = 0
    for trace, by_policy in runs.items():
        ours, fgd = by_policy["gpushare"], by_policy["fgd"]
        at = {(p, x): unallocated(by_policy[p].curves, x) for p in POLICIES for x in POINTS}
        if at["gpushare", 100] is not None and at["fgd", 100] is not None:
            below += at["gpushare", 100] < at["fgd", 100]
        firsts = [_median([v for v in r.first_multi_failure.values() if v is not None]) for r in (ours, fgd)]
        paper_100 = published_at_100(trace).get("fgd")
        lines.append(
            f"| {trace.removeprefix('openb_pod_list_')} | {_fmt(at['gpushare', 90])} | {_fmt(at['fgd', 90])} "
            f"| {_fmt(at['gpushare', 100])} | {_fmt(at['fgd', 100])} | {_fmt(paper_100)} "
            f"| {_fmt(at['gpushare', 130])} | {_fmt(at['fgd', 130])} "
            f"| {_fmt(_median(list(ours.multi_failed_pct.values())), 1)} / "
            f"{_fmt(_median(list(fgd.multi_failed_pct.values())), 1)} "
            f"| {_fmt(firsts[0], 1)} / {_fmt(firsts[1], 1)} |"
        )
    walls = [w for r in runs.values() for w in r["gpushare"].walls]
    lines += [
        "",
        f"gpushare below fgd at arrived 100 % on {below} of {len(runs)} traces; one live replay takes "
        f"{statistics.median(walls):.1f} s (median; max {max(walls):.1f} s).",
    ]
    default = "openb_pod_list_default"
    if default in runs:
        paper = published_curves(default).get("fgd", {})
        lines += [
            "",
            "Unallocated GPU % along the default trace's arrivals:",
            "",
            "| arrived % | " + " | ".join(str(x) for x in CURVE_POINTS) + " |",
            "|---|" + "---:|" * len(CURVE_POINTS),
        ]
        for label, curves in (
            ("gpushare (live)", runs[default]["gpushare"].curves),
            ("fgd (ours)", runs[default]["fgd"].curves),
            ("fgd (paper)", paper),
        ):
            cells = [_fmt(unallocated(curves, x)) for x in CURVE_POINTS]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, END])


def classes_section(runs: dict[str, dict[str, Runs]], command: str) -> str:
    """The per-class failure table (``bench_classes``) from the same replays."""
    seeds = sorted({s for r in runs.values() for s in r["gpushare"].class_failed})
    rows = {
        trace: (median_by_class(r["gpushare"].class_failed), median_by_class(r["fgd"].class_failed))
        for trace, r in runs.items()
    }
    return classes_render(rows, seeds, command)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="how many seeds from 42")
    parser.add_argument("--traces", help="comma-separated trace names (default: the 17 anchored ones)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, help="Markdown file to update (e.g. BENCHMARKS.md)")
    args = parser.parse_args(argv)
    traces = args.traces.split(",") if args.traces else anchored_traces()
    runs = run_all(traces, tuple(range(42, 42 + args.seeds)), args.workers)
    command = "python -m scheduler.research.bench_live " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    sections = [render(runs, command.strip(), args.workers), classes_section(runs, command.strip())]
    for section in sections:
        print(without_markers(section), end="\n\n")
        if args.out:
            write_section(args.out, section)


if __name__ == "__main__":
    main()
