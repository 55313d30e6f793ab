"""``manage.py twin``: the openb trace through the real control plane (portal/twin/run.py)."""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.twin.arrivals import TwinError
from portal.twin.departures import DepartureOptions, run_with_departures
from portal.twin.population import WEIGHTS
from portal.twin.run import TwinOptions, TwinSetupError, run_without_departures

TRACES = Path(__file__).resolve().parents[4].parent / "shared" / "traces" / "openb"


class Command(BaseCommand):
    help = (
        "Bring up the trace's nodes as simulated hosts on a fresh PostgreSQL database and Redis, "
        "request its pods as sandboxes, and report what the control plane did (DIR/summary.json, "
        "DIR/placements.csv). Wipes the database DATABASE_URL names, which must say 'twin'."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--nodes", type=Path, default=TRACES / "openb_node_list_gpu_node.csv")
        parser.add_argument("--pods", type=Path, default=TRACES / "openb_pod_list_default.csv")
        parser.add_argument("--seed", type=int, default=42)
        parser.add_argument("--tune", type=float, default=1.3, help="GPU request / capacity, as the replay")
        parser.add_argument("--batch", type=int, default=100, help="requests per batch (no departures)")
        parser.add_argument(
            "--no-departures", action="store_true", help="pods never leave; batches as the replay"
        )
        parser.add_argument("--days", type=float, default=7.0, help="departures: trace days replayed")
        parser.add_argument(
            "--speed",
            type=float,
            default=336.0,
            help="departures: trace seconds per wall second (336: a week in 30 min)",
        )
        parser.add_argument(
            "--start-day", type=float, help="departures: where the window opens (default: the last days)"
        )
        parser.add_argument("--until-arrived", type=float, default=101.0, help="stop at this arrived %%")
        parser.add_argument(
            "--projects",
            type=int,
            default=len(WEIGHTS),
            help="projects the users belong to (fair-share weights 4, 2, 2, 1...)",
        )
        parser.add_argument("--out", type=Path, required=True, help="folder for the run's files")

    def handle(self, *args: Any, **opts: Any) -> None:
        for name in ("nodes", "pods"):
            if not opts[name].is_file():
                raise CommandError(f"--{name}: no file at {opts[name]}")
        if opts["projects"] < 1:
            raise CommandError("--projects must be at least 1")
        if opts["batch"] < 1:
            raise CommandError("--batch must be at least 1")
        if opts["days"] <= 0 or opts["speed"] <= 0:
            raise CommandError("--days and --speed must be above zero")
        options = TwinOptions(
            nodes=opts["nodes"], pods=opts["pods"], out=opts["out"], seed=opts["seed"], tune=opts["tune"],
            batch=opts["batch"], until_arrived_pct=opts["until_arrived"], projects=opts["projects"],
        )  # fmt: skip
        # One line per sandbox transition is the portal's INFO; here that is thousands a minute.
        logging.getLogger("portal.sandboxes.transitions").setLevel(logging.WARNING)
        # Stopped with SIGTERM (a timeout, an operator's kill): unwind, so the processes the
        # twin started are stopped too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        departures = DepartureOptions(
            nodes=opts["nodes"], pods=opts["pods"], out=opts["out"], days=opts["days"], speed=opts["speed"],
            start_day=opts["start_day"], projects=opts["projects"],
        )  # fmt: skip
        try:
            summary = (
                run_without_departures(options) if opts["no_departures"] else run_with_departures(departures)
            )
        except (TwinSetupError, TwinError) as exc:
            raise CommandError(str(exc)) from exc
        brief = {k: v for k, v in summary.items() if k != "samples"}
        self.stdout.write(json.dumps(brief, indent=2))
