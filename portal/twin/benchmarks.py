"""The twin's section of BENCHMARKS.md, written from its runs' summary.json files
(``manage.py twin_charts ... --bench-out BENCHMARKS.md``), so that every figure in it is
one a run measured."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from portal.twin.departures import CLASSES

BEGIN, END = "<!-- bench:twin:begin -->", "<!-- bench:twin:end -->"
Summary = dict[str, Any]


def _mean(run: Summary, field: str) -> float:
    return statistics.fmean(s[field] for s in run["samples"]) if run["samples"] else 0.0


def _peak(run: Summary, field: str) -> float:
    return float(max((s[field] for s in run["samples"]), default=0.0))


def _spread(figures: dict[str, Any], *keys: str) -> str:
    return " / ".join("—" if figures[k] is None else f"{figures[k]:.2f}" for k in keys)


def _mean_peak(field: str) -> Callable[[Summary], str]:
    return lambda run: f"{_mean(run, field):.2f} / {_peak(run, field):.2f}"


def _plans(run: Summary) -> str:
    plans = run.get("plans")
    if plans is None:
        return "not counted"
    mig, consolidation = (sum(plans[kind].values()) for kind in ("mig_relayout", "consolidation"))
    return f"{mig} / {consolidation} ({plans['gpus_freed_by_consolidation']})"


def _rollups(run: Summary) -> str:
    kept = run.get("rollups")
    return "not counted" if kept is None else f"{kept['minutes']}, {kept['complete']}"


def _withdrawn(run: Summary) -> str:
    return f"{run['withdrawn_while_waiting']} ({run.get('pods_living_less_than_a_cycle', 'not counted')})"


def _wait(klass: str) -> Callable[[Summary], str]:
    def cell(run: Summary) -> str:
        wall = run["queue_wait"][klass]["wall_s"]
        return f"{_spread(wall, 'p50', 'p95', 'p99')} ({wall['count']})"

    return cell


ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    ("GPUs allocated, mean / peak (%)", _mean_peak("gpu_allocated_pct")),
    ("hosts ever lost", lambda r: f"{_peak(r, 'hosts_lost'):.0f}"),
    ("heartbeat lag p50 / p99 / max (s)", lambda r: _spread(r["heartbeat_lag_s"], "p50", "p99", "max")),
    ("heartbeat age p99, worst sample (s)", lambda r: f"{_peak(r, 'heartbeat_age_p99_s'):.1f}"),
    ("scheduling cycle p50 / p99 / max (s)", lambda r: _spread(r["cycle_s"], "p50", "p99", "max")),
    ("control queue, longest (messages)", lambda r: f"{_peak(r, 'control_queue'):.0f}"),
    ("all hosts' queues, longest (messages)", lambda r: f"{_peak(r, 'host_queues'):.0f}"),
    ("control worker CPU, mean / peak (cores)", _mean_peak("control_cores")),
    ("agent process CPU, mean (cores)", lambda r: f"{_mean(r, 'agents_cores'):.2f}"),
    ("Redis operations per second, mean", lambda r: f"{_mean(r, 'redis_ops_per_s'):,.0f}"),
    ("database growth per trace day (MiB)", lambda r: f"{r['database_mib_per_trace_day']:.1f}"),
    ("placements failing the feasibility check", lambda r: f"{len(r['feasibility_problems'])}"),
    ("plans run: MIG re-layouts / consolidations (GPUs freed)", _plans),
    ("minutes of rollups stored, with every GPU", _rollups),
    ("pods withdrawn while waiting (pods living less than a cycle)", _withdrawn),
    *((f"queue wait, {k}: p50 / p95 / p99 (wall s; requests)", _wait(k)) for k in CLASSES),
]  # fmt: skip


def _timed(runs: dict[str, Summary]) -> list[str]:
    first = next(iter(runs.values()))
    minutes = first["days"] * 86400 / first["speed"] / 60
    lines = [
        f"{first['hosts']:,} simulated hosts ({first['gpus']:,} GPUs) in one agent process, one control "
        "worker (4 threads), beat, PostgreSQL and Redis on this 2-core machine. The pods of trace days "
        f"{first['window_days'][0]:.1f} to {first['window_days'][1]:.1f} ({first['pods']:,} pods, "
        f"{first['departures']:,} deletions) requested and stopped on the trace's clock, "
        f"{first['speed']:.0f} trace seconds per second ({minutes:.0f} minutes), by 32 users in 8 projects. "
        "Sampled every 5 s from outside (`samples.csv`).",
        "",
        "| | " + " | ".join(runs) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    lines += [f"| {name} | " + " | ".join(cell(r) for r in runs.values()) + " |" for name, cell in ROWS]
    lines.append("")
    for label, run in runs.items():
        before = run.get("heartbeat_lag_s_before_the_run")
        if before is None:
            lines.append(
                f"*{label}*: run before the twin told the fleet's cold start apart, so its heartbeat lag "
                "includes the first beats, held back while the control worker stored every host's first "
                "inventory; "
                "its queue waits include the pods already running when the window opened, requested "
                "together before the first cycle."
            )
        elif before["count"]:
            lines.append(
                f"*{label}*: before the run, while the fleet came up, {before['count']} heartbeat messages "
                f"waited behind the first inventories, up to {before['max']:.1f} s (a cold start; no host "
                "was lost)."
            )
    return [*lines, ""]


def _batched(label: str, run: Summary) -> list[str]:
    comparison = run["comparison"]
    failed = comparison["failed"]
    return [
        f"**{label}**: {run['hosts']:,} hosts; the default trace's workload (seed {run['seed']}, tune "
        f"{run['tune']}) in batches of {run['batch']} through the request form, {run['projects']} "
        "project(s); "
        f"{comparison['pods']:,} pods, to arrived 101 %. The same pods through `replay_live`: "
        f"{comparison['same_node_pct']:.1f} % on the same node; failed {failed['twin']} (twin) and "
        f"{failed['replay_live']} (replay); placements failing the feasibility check: "
        f"{len(run['feasibility_problems'])}.",
        "",
        "| arrived % | unallocated, twin | unallocated, replay_live | difference (points) |",
        "|---:|---:|---:|---:|",
        *(
            f"| {x} | {p['twin']:.2f} | {p['replay_live']:.2f} | {p['difference']:+.2f} |"
            for x, p in comparison["unallocated_pct_at_arrived"].items()
        ),
        "",
    ]


def section(runs: dict[str, Summary], charts: list[str]) -> str:
    """Markdown for the runs, by label: runs with departures first, then those without."""
    lines = [BEGIN, "## The openb cluster live (`make twin`)", ""]
    timed = {label: r for label, r in runs.items() if r["mode"] == "departures"}
    if timed:
        lines += _timed(timed)
    for label, run in runs.items():
        if run["mode"] != "departures":
            lines += _batched(label, run)
    lines += [f"![{name}](docs/{name})" for name in charts]
    lines += [
        "",
        '`make twin` (README, "The Alibaba cluster, live"); the charts and this section: '
        "`manage.py twin_charts LABEL=DIR ... --out docs --bench-out BENCHMARKS.md`.",
        END,
    ]
    return "\n".join(lines)
