"""Reproduce the FGD paper's openb results: every policy x seeds 42-51 on one trace.

    python -m scheduler.research.bench_trace [--pods CSV] [--policies fgd,bestfit] [--out BENCHMARKS.md]
    python -m scheduler.research.bench_trace --all-traces --policies fgd,gpushare [--out BENCHMARKS.md]

Each run's curve is bucketed as the paper's ``merge_alloc_discrete.py`` does, and the
unallocated GPU % (100 - median over seeds of allocated %) at arrived 90/100/130 % is
compared with the published per-seed results in shared/anchors. ``--all-traces`` runs
the policies on the 17 traces that have published anchors and renders one row per trace.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

from scheduler.research.bench_markdown import write_section
from scheduler.research.live_replay import DEFAULT_BATCH, replay_live
from scheduler.research.replay import percentile, replay
from scheduler.research.trace import build_workload, load_nodes, load_pods

SHARED = Path(__file__).resolve().parents[3] / "shared"
TRACES = SHARED / "traces" / "openb"
ANCHORS = SHARED / "anchors"
SEEDS = tuple(range(42, 52))
POINTS = (90, 100, 130)  # arrived % at which the table compares
MAX_ARRIVED = 130
BEGIN, END = "<!-- bench:trace:begin -->", "<!-- bench:trace:end -->"
ALL_BEGIN, ALL_END = "<!-- bench:traces17:begin -->", "<!-- bench:traces17:end -->"
# Our names and the paper's ``sc_policy`` labels, in the paper's order.
PAPER_LABELS = {
    "random": "01-Random",
    "dotprod": "02-DotProd",
    "clustering": "03-GpuClustering",
    "packing": "04-GpuPacking",
    "bestfit": "05-BestFit",
    "fgd": "06-FGD",
}

# The portal's own scheduler through its scheduling cycle (scheduler/research/live_replay.py),
# timed beside the paper's policies in the same run; the paper has no figures for it.
LIVE = "gpushare-live"

Curve = list[float | None]  # allocated % per arrived % 0..130; None where no event is near


def bucket_curve(arrived_pct: list[float], allocated_pct: list[float]) -> Curve:
    """Mean allocated % per whole arrived %, as the paper's merge does.

    Arrived rounds half to even (numpy's and Python's ``round``), allocated is rounded
    to 2 decimals per event before averaging; an empty bucket borrows its neighbours'.
    """
    buckets: dict[int, list[float]] = {}
    for arrived, allocated in zip(arrived_pct, allocated_pct, strict=True):
        buckets.setdefault(round(arrived), []).append(round(allocated, 2))
    curve: Curve = []
    for x in range(MAX_ARRIVED + 1):
        values = buckets.get(x) or [v for k in (x - 1, x, x + 1) for v in buckets.get(k, [])]
        curve.append(round(statistics.fmean(values), 2) if values else None)
    return curve


def run_one(job: tuple[Path, Path, str, int, float]) -> tuple[str, int, Curve, float]:
    """One replay, in a worker process: returns its bucketed curve and wall time."""
    nodes, pods, policy, seed, tune = job
    workload = build_workload(load_nodes(nodes), load_pods(pods), seed, tune)
    result = replay_live(workload, DEFAULT_BATCH) if policy == LIVE else replay(workload, policy)
    arrived = [result.pct(m) for m in result.arrived_milli]
    allocated = [result.pct(m) for m in result.used_milli]
    return policy, seed, bucket_curve(arrived, allocated), result.wall_s


def run_matrix(
    nodes: Path,
    pods: Path,
    policies: list[str],
    seeds: tuple[int, ...] = SEEDS,
    tune: float = 1.3,
    workers: int = 2,
) -> tuple[dict[str, dict[int, Curve]], dict[str, list[float]]]:
    """Curves per policy and seed, and replay wall times per policy."""
    jobs = [(nodes, pods, policy, seed, tune) for policy in policies for seed in seeds]
    curves: dict[str, dict[int, Curve]] = {p: {} for p in policies}
    walls: dict[str, list[float]] = {p: [] for p in policies}
    with Pool(workers) as pool:
        for policy, seed, curve, wall in pool.imap_unordered(run_one, jobs):
            curves[policy][seed] = curve
            walls[policy].append(wall)
    return curves, walls


@dataclass(frozen=True)
class TraceRuns:
    """One policy's replays of one trace over the seeds."""

    curves: dict[int, Curve]
    walls: list[float]  # replay seconds per seed
    p50_ms: list[float]  # per seed: median per-pod decision time
    p99_ms: list[float]


def run_timed(job: tuple[Path, Path, str, int, float]) -> tuple[str, str, int, Curve, float, float, float]:
    """Like ``run_one``, also returning the trace name and the per-pod decision p50/p99 in ms."""
    nodes, pods, policy, seed, tune = job
    result = replay(build_workload(load_nodes(nodes), load_pods(pods), seed, tune), policy)
    arrived = [result.pct(m) for m in result.arrived_milli]
    allocated = [result.pct(m) for m in result.used_milli]
    p50 = percentile(result.decision_s, 0.5) * 1e3
    p99 = percentile(result.decision_s, 0.99) * 1e3
    return pods.stem, policy, seed, bucket_curve(arrived, allocated), result.wall_s, p50, p99


def anchored_traces(path: Path = ANCHORS / "fgd_unallocated_at_100.csv") -> list[str]:
    """The workloads the paper published results for (17 of the 25 openb traces)."""
    with path.open(newline="") as f:
        return [row["workload"] for row in csv.DictReader(f)]


def run_traces(
    nodes: Path,
    workloads: list[str],
    policies: list[str],
    seeds: tuple[int, ...] = SEEDS,
    tune: float = 1.3,
    workers: int = 2,
) -> dict[str, dict[str, TraceRuns]]:
    """Every (trace, policy, seed) in one pool, so that slow traces do not leave a worker idle."""
    jobs = [(nodes, TRACES / f"{w}.csv", p, s, tune) for w in workloads for p in policies for s in seeds]
    runs = {w: {p: TraceRuns({}, [], [], []) for p in policies} for w in workloads}
    with Pool(workers) as pool:
        for workload, policy, seed, curve, wall, p50, p99 in pool.imap_unordered(run_timed, jobs):
            run = runs[workload][policy]
            run.curves[seed] = curve
            run.walls.append(wall)
            run.p50_ms.append(p50)
            run.p99_ms.append(p99)
    return runs


def render_traces(runs: dict[str, dict[str, TraceRuns]], command: str, cpus: int) -> str:
    """One row per trace: each policy's unallocated % at 90/100/130, the paper's FGD at 100."""
    policies = list(next(iter(runs.values())))
    first, rest = policies[0], policies[1:]
    seeds = sorted({s for r in runs.values() for p in policies for s in r[p].curves})
    head = ["trace", *(f"{p} @{x}" for x in POINTS for p in policies), "paper fgd @100"]
    head += [f"Δ @100 {p} - {first}" for p in rest]
    lines = [
        ALL_BEGIN,
        f"## Trace replay on the {len(runs)} anchored openb traces ({', '.join(policies)}; tune 1.3)",
        "",
        f"Unallocated GPU % = 100 - median over seeds {seeds[0]}-{seeds[-1]} of allocated % at arrived x %,",
        "bucketed as the paper's `merge_alloc_discrete.py` (lower is better); 'paper fgd' is the",
        f"published median. Made by `{command}` on {cpus} worker processes.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    wins = dict.fromkeys(rest, 0)
    for workload, by_policy in runs.items():
        values = {(p, x): unallocated(by_policy[p].curves, x) for p in policies for x in POINTS}
        paper = published_at_100(workload).get("fgd")
        cells = [workload.removeprefix("openb_pod_list_")]
        cells += [_fmt(values[p, x]) for x in POINTS for p in policies]
        cells.append(_fmt(paper))
        for p in rest:
            ours, base = values[p, 100], values[first, 100]
            if ours is None or base is None:
                cells.append("-")
                continue
            cells.append(f"{ours - base:+.2f}")
            wins[p] += ours < base
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| policy | below " + first + " @100 | replay s p50 (max) | decision p50 ms | decision p99 ms |",
    ]
    lines.append("|---|---:|---:|---:|---:|")
    for p in policies:
        walls = [w for r in runs.values() for w in r[p].walls]
        p50 = statistics.median(v for r in runs.values() for v in r[p].p50_ms)
        p99 = statistics.median(v for r in runs.values() for v in r[p].p99_ms)
        below = f"{wins[p]} of {len(runs)}" if p in wins else "-"
        lines.append(
            f"| {p} | {below} | {statistics.median(walls):.2f} ({max(walls):.2f}) | {p50:.3f} | {p99:.3f} |"
        )
    lines += [
        "",
        "Decision times are the medians over all runs of each run's per-pod p50 / p99 (ms).",
    ]
    return "\n".join([*lines, ALL_END])


def unallocated(curves: dict[int, Curve], x: int) -> float | None:
    """100 - the median over seeds of allocated % at arrived x (the paper's Fig. 9 line)."""
    values = [v for c in curves.values() if (v := c[x]) is not None]
    return round(100 - statistics.median(values), 2) if values else None


def published_curves(
    workload: str, path: Path = ANCHORS / "fgd_alloc_by_arrived.csv"
) -> dict[str, dict[int, Curve]]:
    """The paper's per-seed allocated % curves for one trace, keyed by our policy names."""
    names = {label: name for name, label in PAPER_LABELS.items()}
    out: dict[str, dict[int, Curve]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row["workload"] != workload or row["sc_policy"] not in names:
                continue
            curve: Curve = [float(row[str(x)]) if row[str(x)] else None for x in range(MAX_ARRIVED + 1)]
            out.setdefault(names[row["sc_policy"]], {})[int(row["seed"])] = curve
    return out


def published_at_100(workload: str, path: Path = ANCHORS / "fgd_unallocated_at_100.csv") -> dict[str, float]:
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row["workload"] == workload:
                return {name: float(row[label]) for name, label in PAPER_LABELS.items()}
    return {}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def spread(curves: dict[int, Curve], x: int) -> str:
    """Mean +- sd over seeds of unallocated % at x: tells seed noise from a real gap."""
    values = [100 - v for c in curves.values() if (v := c[x]) is not None]
    if len(values) < 2:
        return "-"
    return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}"


def render(
    workload: str, curves: dict[str, dict[int, Curve]], walls: dict[str, list[float]], cpus: int
) -> str:
    paper = published_curves(workload)
    at_100 = published_at_100(workload)
    lines = [
        BEGIN,
        f"## Trace replay vs the FGD paper ({workload}, tune 1.3)",
        "",
        "Unallocated GPU % = 100 - median over seeds 42-51 of allocated % at arrived x %, bucketed as",
        "the paper's `merge_alloc_discrete.py`; 'paper' is the same statistic of its published runs",
        f"(shared/anchors). Measured by `python -m scheduler.research.bench_trace` on {cpus} worker",
        "processes; replay time is the median over seeds of one replay (build the workload excluded). The",
        f"mean ± sd columns are over the seeds at arrived 100 %. {LIVE}: the portal's policy through its",
        "scheduling cycle (`--engine live`, 100 arrivals a cycle), timed beside the others in the same run.",
        "",
        "| policy | ours @90 | paper @90 | ours @100 | paper @100 | Δ @100 | ours @130 | paper @130 "
        "| ours mean ± sd | paper mean ± sd | replay s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, seeds in curves.items():
        ours = {x: unallocated(seeds, x) for x in POINTS}
        theirs = {x: unallocated(paper[policy], x) if policy in paper else None for x in POINTS}
        if policy in at_100:
            theirs[100] = at_100[policy]
        delta = None if ours[100] is None or theirs[100] is None else ours[100] - theirs[100]
        lines.append(
            f"| {policy} | {_fmt(ours[90])} | {_fmt(theirs[90])} | {_fmt(ours[100])} | {_fmt(theirs[100])} | "
            f"{'-' if delta is None else f'{delta:+.2f}'} | {_fmt(ours[130])} | {_fmt(theirs[130])} | "
            f"{spread(seeds, 100)} | {spread(paper.get(policy, {}), 100)} | "
            f"{statistics.median(walls[policy]):.2f} |"
        )
    return "\n".join([*lines, END])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=Path, default=TRACES / "openb_node_list_gpu_node.csv")
    parser.add_argument("--pods", type=Path, default=TRACES / "openb_pod_list_default.csv")
    parser.add_argument(
        "--policies",
        default=",".join([*PAPER_LABELS, LIVE]),
        help=f"comma-separated policy names ({LIVE}: the live engine)",
    )
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="how many seeds from 42")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, help="Markdown file to update (e.g. BENCHMARKS.md)")
    parser.add_argument(
        "--all-traces", action="store_true", help="run the 17 anchored traces instead of --pods"
    )
    args = parser.parse_args(argv)
    seeds = tuple(range(42, 42 + args.seeds))
    if args.all_traces:
        command = "python -m scheduler.research.bench_trace " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        runs = run_traces(
            args.nodes, anchored_traces(), args.policies.split(","), seeds, workers=args.workers
        )
        section = render_traces(runs, command.strip(), args.workers)
        print(section.replace(ALL_BEGIN, "").replace(ALL_END, "").strip())
        if args.out:
            write_section(args.out, section)
        return
    curves, walls = run_matrix(args.nodes, args.pods, args.policies.split(","), seeds, workers=args.workers)
    section = render(args.pods.stem, curves, walls, args.workers)
    print(section.replace(BEGIN, "").replace(END, "").strip())
    if args.out:
        write_section(args.out, section)


if __name__ == "__main__":
    main()
