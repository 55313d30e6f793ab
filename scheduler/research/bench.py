"""``make bench``: every scheduler benchmark, printed and written to BENCHMARKS.md.

    python -m scheduler.research.bench [--out BENCHMARKS.md] [--only NAME ...]
    python -m scheduler.research.bench scale [--json]

Each benchmark renders one Markdown section between its own markers
(``bench_markdown.write_section`` replaces just that section), so ``--only`` re-runs one
without losing the others. The benchmarks live beside this entry in ``scheduler.research``:
the product package (``scheduler``) never imports them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import cache
from pathlib import Path

from scheduler.research.bench_consolidation import matrix as consolidation_matrix
from scheduler.research.bench_consolidation import render as consolidation_render
from scheduler.research.bench_cycle import cycle_section, live_section, measure_cycle, measure_live
from scheduler.research.bench_defrag import mig_replay_table, run_mig_replay
from scheduler.research.bench_live import Runs, classes_section, run_all
from scheduler.research.bench_live import render as live_traces_render
from scheduler.research.bench_markdown import framed, without_markers, write_section
from scheduler.research.bench_scale import print_json
from scheduler.research.bench_scale import render as scale_render
from scheduler.research.bench_scale import rows as scale_rows
from scheduler.research.bench_trace import LIVE, PAPER_LABELS, SEEDS, TRACES, anchored_traces, run_matrix
from scheduler.research.bench_trace import render as trace_render

NODES, DEFAULT_PODS = TRACES / "openb_node_list_gpu_node.csv", TRACES / "openb_pod_list_default.csv"


def mig_relayout_section() -> str:
    return framed(
        "mig",
        [
            "## MIG re-layout (defragmentation planner)",
            "",
            "64 H100-80GB in MIG mode, a seeded stream of 8,000 requests for 1g-7g profiles",
            "arriving and leaving at 95% offered load, replayed with and without re-layout",
            "(`python -m scheduler.research.bench_defrag`).",
            "",
            mig_replay_table(run_mig_replay()).strip(),
        ],
    )


def trace_section() -> str:
    """The six FGD-paper policies on the default trace, seeds 42-51, against the paper: the
    check that the replay harness is the paper's. The product's own figures are the live
    engine's (``live-traces``), through the cycle the portal runs; its row here times it
    beside FGD's in the same run."""
    curves, walls = run_matrix(NODES, DEFAULT_PODS, [*PAPER_LABELS, LIVE], SEEDS, workers=2)
    return trace_render(DEFAULT_PODS.stem, curves, walls, 2)


@cache
def live_trace_runs() -> dict[str, dict[str, Runs]]:
    """The 17 traces' replays, run once for both sections that report them."""
    return run_all(anchored_traces(), tuple(range(42, 52)), workers=2)


def live_traces_section() -> str:
    return live_traces_render(live_trace_runs(), "python -m scheduler.research.bench --only live-traces", 2)


def packing_classes_section() -> str:
    return classes_section(live_trace_runs(), "python -m scheduler.research.bench --only packing-classes")


SECTIONS: dict[str, Callable[[], str]] = {
    "cycle": lambda: cycle_section(
        [measure_cycle(h, 8, q, 5) for h, q in ((25, 200), (125, 1000), (500, 4000))]
    ),
    "live": lambda: live_section(
        [measure_live(fill=fill, departments=tree) for tree in (False, True) for fill in (0.5, 3.0)]
    ),
    "mig": mig_relayout_section,
    "trace": trace_section,
    "consolidation": lambda: consolidation_render(
        consolidation_matrix(NODES, DEFAULT_PODS, ["bestfit", "fgd"], 42)
    ),
    "scale": lambda: scale_render(scale_rows()),
    "live-traces": live_traces_section,
    "packing-classes": packing_classes_section,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", nargs="?", choices=("scale",), help="scale: only the cycle at scale")
    parser.add_argument("--json", action="store_true", help="scale: one JSON object per line")
    parser.add_argument("--out", type=Path, help="Markdown file to update")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these")
    args = parser.parse_args(argv)
    if args.what == "scale" and args.json:
        print_json(scale_rows())
        return
    if args.what == "scale":
        args.only = ["scale"]
    for name in args.only or list(SECTIONS):
        section = SECTIONS[name]()
        print(without_markers(section), end="\n\n")
        if args.out:
            write_section(args.out, section)


if __name__ == "__main__":
    main()
