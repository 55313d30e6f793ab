"""The twin's charts, drawn from its summary.json files (``manage.py twin_charts``): GPU
allocation over trace time, one line per run (policy), and the control plane's queues and
lag over the run, as PNG for BENCHMARKS.md and docs/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server

import matplotlib.pyplot as plt


def load(path: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((path / "summary.json").read_text())
    return summary


def _trace_days(summary: dict[str, Any]) -> list[float]:
    speed = summary.get("speed") or 1.0
    start = (summary.get("window_days") or [0.0])[0]
    return [start + s["wall_s"] * speed / 86400 for s in summary["samples"]]


def allocation_chart(runs: dict[str, dict[str, Any]], out: Path) -> Path:
    """GPU allocation % over trace time, one line per run."""
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    for label, summary in runs.items():
        ax.plot(_trace_days(summary), [s["gpu_allocated_pct"] for s in summary["samples"]], label=label)
    ax.set_xlabel("trace day")
    ax.set_ylabel("GPUs allocated (%)")
    ax.set_title("The openb cluster live: GPU allocation as the trace's pods come and go")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def control_plane_chart(summary: dict[str, Any], title: str, out: Path) -> Path:
    """Queue lengths, heartbeat age and control worker CPU over the run's wall time."""
    samples = summary["samples"]
    minutes = [s["wall_s"] / 60 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.2), dpi=110, sharex=True)
    queues = (
        ("control_queue", "control queue (messages)"),
        ("host_queues", "all hosts' queues (messages)"),
        ("queued", "sandboxes waiting"),
    )
    keeping_up = (
        ("heartbeat_age_p99_s", "heartbeat age p99 (s)"),
        ("control_cores", "control worker (cores)"),
        ("agents_cores", "agent process, every host (cores)"),
    )
    panels = ((top, queues), (bottom, keeping_up))
    for ax, series in panels:
        for field, label in series:
            ax.plot(minutes, [s[field] for s in samples], label=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    top.set_ylabel("length")
    top.set_title(title)
    bottom.set_xlabel("minutes into the run")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
