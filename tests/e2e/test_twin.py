"""``manage.py twin`` end to end on twelve of the openb nodes: its own database and Redis,
its processes, the trace's pods through the request form. Without departures its
placements are the replay's, pod for pod; with departures, hours of the trace play out."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.conf import settings

from tests.bench.openb_fleet import TRACES

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql",
        reason="the twin runs on PostgreSQL, as deployed at the cluster's size",
    ),
]
ROOT = Path(__file__).resolve().parents[2]
NODES = 12


def twin_env() -> dict[str, str]:
    """The suite's servers, with a database and a Redis database of the twin's own (it wipes
    both): the test database's name with _twin, the suite's Redis index less four."""
    database = urlsplit(os.environ["DATABASE_URL"])
    redis_url = urlsplit(os.environ["REDIS_URL"])
    index = int(redis_url.path.strip("/") or 0)
    return {
        **os.environ,
        "DATABASE_URL": urlunsplit(database._replace(path=database.path + "_twin")),
        "REDIS_URL": urlunsplit(redis_url._replace(path=f"/{index - 4 if index > 4 else index + 4}")),
        "SECRET_KEY": secrets.token_urlsafe(64),
        "DEBUG": "false",
    }


def run_twin(tmp_path: Path, name: str, *args: str) -> dict[str, object]:
    nodes = tmp_path / "nodes.csv"
    lines = (TRACES / "openb_node_list_gpu_node.csv").read_text().splitlines()
    nodes.write_text("\n".join(lines[: NODES + 1]) + "\n")
    out = tmp_path / name
    done = subprocess.run(
        [sys.executable, "manage.py", "twin", "--nodes", str(nodes), "--out", str(out), *args],
        cwd=ROOT, env=twin_env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log")))
    assert done.returncode == 0, f"twin {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}{logs}"
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def test_01_without_departures_the_portal_commits_what_the_replay_decides(tmp_path: Path) -> None:
    summary = run_twin(tmp_path, "replayed", "--no-departures", "--projects", "1")
    assert summary["hosts"] == NODES and summary["feasibility_problems"] == []
    comparison = summary["comparison"]
    assert isinstance(comparison, dict)
    assert comparison["same_node_pct"] == 100.0, comparison
    assert comparison["failed"]["twin"] == comparison["failed"]["replay_live"]
    assert (
        (tmp_path / "replayed" / "placements.csv")
        .read_text()
        .startswith("seq,pod,source,node,gpus,milli_per_gpu")
    )


def test_02_with_departures_hours_of_the_trace_play_out(tmp_path: Path) -> None:
    # Six hours of the trace's busiest day, in 15 s.
    summary = run_twin(tmp_path, "hours", "--days", "0.25", "--start-day", "148", "--speed", "1440")
    assert summary["pods"] and summary["departures"] and summary["feasibility_problems"] == []
    samples = summary["samples"]
    assert isinstance(samples, list) and samples and all(s["hosts_lost"] == 0 for s in samples)
    waits = summary["queue_wait"]
    assert isinstance(waits, dict) and sum(c["wall_s"]["count"] for c in waits.values()) > 0
