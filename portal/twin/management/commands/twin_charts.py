"""``manage.py twin_charts``: the charts of twin runs, from their folders' summary.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.twin import benchmarks, charts
from scheduler.research.bench_markdown import write_section


class Command(BaseCommand):
    help = "Draw a twin run's charts: allocation over trace time (one line per run) and its control plane."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("runs", nargs="+", help="LABEL=DIR: a run's folder, as the chart labels it")
        parser.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
        parser.add_argument("--bench-out", type=Path, help="rewrite the twin's section of this BENCHMARKS.md")

    def handle(self, *args: Any, **opts: Any) -> None:
        runs: dict[str, dict[str, Any]] = {}
        for given in opts["runs"]:
            label, _, folder = given.partition("=")
            if not folder or not (Path(folder) / "summary.json").is_file():
                raise CommandError(f"{given!r}: give LABEL=DIR, DIR holding a twin run's summary.json")
            runs[label] = charts.load(Path(folder))
        out: Path = opts["out"]
        out.mkdir(parents=True, exist_ok=True)
        timed = {label: s for label, s in runs.items() if s["mode"] == "departures"}
        written = [charts.allocation_chart(timed, out / "twin-allocation.png")] if timed else []
        for label, summary in timed.items():
            name = "twin-control-plane-" + "".join(c if c.isalnum() else "-" for c in label.lower()) + ".png"
            written.append(charts.control_plane_chart(summary, f"Control plane, {label}", out / name))
        for path in written:
            self.stdout.write(str(path))
        if opts["bench_out"] is not None:
            write_section(opts["bench_out"], benchmarks.section(runs, [p.name for p in written]))
            self.stdout.write(f"{opts['bench_out']}: the twin's section rewritten")
