"""``make bench``: every scheduler benchmark, printed and written to BENCHMARKS.md.

Each benchmark renders a Markdown section framed by its own ``<!-- bench:NAME:begin -->``
/ ``<!-- bench:NAME:end -->`` markers; ``write_section`` replaces just that section, so
benchmarks can be re-run one at a time (``--only``) without losing the others.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from scheduler.cluster import GpuState, HostState, MigSlot, Request, Snapshot
from scheduler.cycle import run_cycle
from scheduler.gpus import MODELS
from scheduler.placement import DEFAULT_POLICY, get_policy

MODES = ("dedicated", "mig", "mps", "timeslice")
BEGIN, END = "<!-- bench:cycle:begin -->", "<!-- bench:cycle:end -->"


def synthetic_fleet(hosts: int, gpus_per_host: int, rng: random.Random) -> Snapshot:
    h100 = MODELS["H100-80GB"]
    layout = [("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)]
    snapshot = Snapshot(hosts=[])
    for h in range(hosts):
        host = HostState(f"host{h:04d}", True)
        for i in range(gpus_per_host):
            mode = MODES[(h + i) % 4]
            uuid = f"GPU-{h}-{i}"
            mig = [MigSlot(f"MIG-{h}-{i}-{s}", p, s, h100.profile(p).memory_slices) for p, s in layout]
            host.gpus.append(
                GpuState(
                    uuid,
                    host.name,
                    i,
                    h100.name,
                    h100.memory_mib,
                    mode,
                    mig=mig if mode == "mig" else [],
                    replicas=4 if mode == "timeslice" else 0,
                )
            )
        snapshot.hosts.append(host)
    return snapshot


def synthetic_queue(size: int, rng: random.Random) -> list[Request]:
    queue = []
    for i in range(size):
        mode = rng.choice(MODES)
        queue.append(
            Request(
                id=i,
                project=f"p{rng.randrange(20)}",
                priority=rng.choice((50, 100, 200)),
                submitted_at=float(i),
                mode=mode,
                gpu_count=rng.choice((1, 1, 2, 4)),
                mig_profile=rng.choice(("1g.10gb", "2g.20gb", "3g.40gb")),
                mps_memory_mib=rng.choice((5120, 10240, 20480)),
                mps_thread_pct=rng.choice((10, 25, 50)),
            )
        )
    return queue


def measure(hosts: int, gpus: int, queue_size: int, repeats: int) -> dict[str, float]:
    rng = random.Random(42)
    snapshot, queue = synthetic_fleet(hosts, gpus, rng), synthetic_queue(queue_size, rng)
    policy = get_policy(DEFAULT_POLICY)
    times, placed = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        decisions = run_cycle(snapshot, queue, policy, now=0.0)
        times.append(time.perf_counter() - start)
        placed = sum(1 for d in decisions if hasattr(d, "grants"))
    return {
        "hosts": hosts,
        "gpus": hosts * gpus,
        "queue": queue_size,
        "placed": placed,
        "p50_ms": statistics.median(times) * 1000,
        "max_ms": max(times) * 1000,
    }


def render(rows: list[dict[str, float]]) -> str:
    lines = [
        BEGIN,
        "## Cycle scaling on a synthetic fleet (the portal's policy, no fair share)",
        "",
        "One `run_cycle` over a queue of mixed requests (dedicated 1-4 GPUs, MIG, MPS, time-slice)",
        "on H100 hosts with 8 GPUs, a quarter in each sharing mode. Measured by `make bench`",
        "(`python -m scheduler.bench`) on the development machine (2 cores); 5 repeats.",
        "",
        "| hosts | GPUs | queued | placed | cycle p50 (ms) | cycle max (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['hosts']} | {r['gpus']} | {r['queue']} | {r['placed']} | {r['p50_ms']:.1f} | "
        f"{r['max_ms']:.1f} |"
        for r in rows
    ]
    return "\n".join([*lines, END])


def write_section(path: Path, section: str) -> None:
    """Replace the section framed by ``section``'s first and last lines (its markers)."""
    lines = section.strip().splitlines()
    begin, end = lines[0], lines[-1]
    text = path.read_text() if path.exists() else "# Benchmarks\n\nFigures measured by `make bench`.\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section.strip() + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section.strip() + "\n"
    path.write_text(text)


def live_cycle_section() -> str:
    from scheduler.research.bench_cycle import measure_live

    rows = [measure_live(fill=fill) for fill in (0.5, 3.0)]
    lines = [
        "<!-- bench:live:begin -->",
        "## Live scheduling cycle (fair share, quotas, backfill, preemption)",
        "",
        "One `run_cycle` with a `FairShareState` of 20 projects (weights, guarantees, limits,",
        "decayed usage) over 1,000 queued requests on 63 hosts x 8 GPUs, half full and",
        "oversubscribed. *cycle* is wall time (p50 of 5); the goal is <= 1 s.",
        "",
        "| GPUs | running | queued | placed | preempted | reserved | cycle p50 (ms) | cycle max (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['gpus']} | {r['running']} | {r['queue']} | {r['placed']} | {r['preempted']} | "
        f"{r['reserved']} | {r['p50_ms']:.0f} | {r['max_ms']:.0f} |"
        for r in rows
    ]
    return "\n".join([*lines, "<!-- bench:live:end -->"])


def mig_relayout_section() -> str:
    from scheduler.research.bench_defrag import mig_replay_table, run_mig_replay

    return "\n".join(
        [
            "<!-- bench:mig:begin -->",
            "## MIG re-layout (defragmentation planner)",
            "",
            "64 H100-80GB in MIG mode, a seeded stream of 8,000 requests for 1g-7g profiles",
            "arriving and leaving at 95% offered load, replayed with and without re-layout",
            "(`python -m scheduler.research.bench_defrag`).",
            "",
            mig_replay_table(run_mig_replay()).strip(),
            "<!-- bench:mig:end -->",
        ]
    )


def trace_section() -> str:
    """The six FGD-paper policies on the default trace, seeds 42-51, against the paper: the
    check that the replay harness is the paper's. The product's own figures are the live
    engine's (``live-traces``), through the cycle the portal runs."""
    from scheduler.research.bench_trace import PAPER_LABELS, SEEDS, TRACES, render, run_matrix

    pods = TRACES / "openb_pod_list_default.csv"
    curves, walls = run_matrix(
        TRACES / "openb_node_list_gpu_node.csv", pods, list(PAPER_LABELS), SEEDS, workers=2
    )
    return render(pods.stem, curves, walls, 2)


def consolidation_section() -> str:
    from scheduler.research.bench_consolidation import matrix, render
    from scheduler.research.bench_trace import TRACES

    nodes, pods = TRACES / "openb_node_list_gpu_node.csv", TRACES / "openb_pod_list_default.csv"
    return render(matrix(nodes, pods, ["bestfit", "fgd"], 42))


SECTIONS = {
    "cycle": lambda: render([measure(h, 8, q, 5) for h, q in ((25, 200), (125, 1000), (500, 4000))]),
    "live": live_cycle_section,
    "mig": mig_relayout_section,
    "trace": trace_section,
    "consolidation": consolidation_section,
}


def scale_section() -> str:
    from scheduler.research.bench_scale import render, rows

    return render(rows())


def live_traces_section() -> str:
    from scheduler.research.bench_live import render, run_all
    from scheduler.research.bench_trace import anchored_traces

    runs = run_all(anchored_traces(), tuple(range(42, 52)), workers=2)
    return render(runs, "python -m scheduler.bench --only live-traces", 2)


SECTIONS["scale"] = scale_section
SECTIONS["live-traces"] = live_traces_section


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", nargs="?", choices=("scale",), help="scale: only the cycle at scale")
    parser.add_argument("--json", action="store_true", help="scale: one JSON object per line")
    parser.add_argument("--out", type=Path, help="Markdown file to update")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these")
    args = parser.parse_args(argv)
    if args.what == "scale" and args.json:
        from scheduler.research.bench_scale import print_json, rows

        print_json(rows())
        return
    if args.what == "scale":
        args.only = ["scale"]
    for name in args.only or list(SECTIONS):
        section = SECTIONS[name]()
        print("\n".join(section.strip().splitlines()[1:-1]).strip(), end="\n\n")  # without markers
        if args.out:
            write_section(args.out, section)


if __name__ == "__main__":
    main()
