"""What the load benchmark (tests/bench/test_load.py) reads besides locust's statistics: each
process's CPU and memory over time, and what the WebSocket clients received.

Processes are read from /proc (psutil is not a dependency): the platform's (every uvicorn
worker on its own), the load's own (locust, the socket clients), the PostgreSQL backends
serving the test database (found in pg_stat_activity at each sample) and the Redis server
(its pid from INFO; the server may be shared with other work on the machine).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024
# Their RSS counts the shared buffers each has touched, once per backend: an upper bound.
BACKENDS = "postgres backends (summed)"


def cpu_and_rss(pid: int) -> tuple[float, int] | None:
    """(user + system CPU seconds, resident KiB) of one process, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    if not pages:  # exited, not yet reaped: its figures ended with its last sample
        return None
    return (int(stat[11]) + int(stat[12])) / CLK_TCK, pages * PAGE_KIB  # proc(5) fields 14, 15


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@dataclass
class Sample:
    at: float  # epoch seconds
    figures: dict[str, tuple[float, int]]  # name -> (CPU seconds so far, RSS KiB)


@dataclass
class ProcessSampler:
    """Every ``every_s`` seconds, each named process's CPU seconds and RSS, in a thread.
    ``named``: name -> pid; a uvicorn master's workers are read as ``web[1]``, ``web[2]``...;
    ``database`` (a psycopg connection string): its backends' CPU and RSS, summed."""

    named: dict[str, int]
    database: str = ""
    redis_pid: int = 0
    every_s: float = 5.0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def pids(self) -> dict[str, int]:
        found = {}
        for name, pid in self.named.items():
            workers = children(pid) if name == "web" else []
            found[name] = pid
            for index, child in enumerate(sorted(workers), 1):
                found[f"{name}[{index}]"] = child
        if self.redis_pid:
            found["redis-server (shared)"] = self.redis_pid
        return found

    def backends(self) -> list[int]:
        import psycopg

        with psycopg.connect(self.database, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchall()
        return [int(row[0]) for row in rows]

    def take(self) -> None:
        figures = {}
        for name, pid in self.pids().items():
            read = cpu_and_rss(pid)
            if read is not None:
                figures[name] = read
        if self.database:
            # Backends come and go (each process's pool opens and retires them): their CPU so
            # far is summed per sample, so only a backend's life within the window counts.
            backends = [r for r in (cpu_and_rss(pid) for pid in self.backends()) if r is not None]
            figures[BACKENDS] = (sum(b[0] for b in backends), sum(b[1] for b in backends))
        self.samples.append(Sample(time.time(), figures))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.take()

    def start(self) -> None:
        self.take()
        self._thread = threading.Thread(target=self._run, name="process-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.take()

    def over(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """Per process: CPU % of one core between the samples nearest ``start`` and ``end``,
        RSS (MiB) at ``start`` (warm-up over), at ``end`` and at most in between."""
        inside = [s for s in self.samples if start - self.every_s <= s.at <= end + self.every_s]
        if len(inside) < 2:
            return {}
        first = inside[0]
        wall = inside[-1].at - first.at
        result: dict[str, dict[str, float]] = {}
        for name in first.figures:
            last = next(s for s in reversed(inside) if name in s.figures)  # the load's own exit first
            cpu = last.figures[name][0] - first.figures[name][0]
            if name == BACKENDS:  # a sum over backends that changed: per interval
                cpu = sum(
                    max(0.0, b.figures[name][0] - a.figures[name][0])
                    for a, b in itertools.pairwise(inside)
                    if name in a.figures and name in b.figures
                )
            result[name] = {
                "cpu_pct": cpu / wall * 100 if wall > 0 else 0.0,
                "rss_start_mib": first.figures[name][1] / 1024,
                "rss_end_mib": last.figures[name][1] / 1024,
                "rss_max_mib": max(s.figures[name][1] for s in inside if name in s.figures) / 1024,
            }
        return result


def percentile(ordered: list[float], q: float) -> float:
    """Nearest rank; 0 when nothing was measured."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def socket_figures(results: list[dict[str, Any]]) -> dict[str, float]:
    """From telemetry_clients.py's output: sample ages, and samples lost. A sample one client
    of a page got and another client of the same page did not is lost (what the agent put in
    the group is whatever any of its clients received); so is a socket the server closed."""
    ages = sorted(row[2] - row[1] for client in results for row in client["rows"])
    by_path: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for client in results:
        by_path[client["path"]].update((row[0], row[1]) for row in client["rows"])
    lost = sum(
        len(by_path[client["path"]] - {(row[0], row[1]) for row in client["rows"]}) for client in results
    )
    return {
        "sockets": len(results),
        "samples": len(ages),
        "age_p50_ms": percentile(ages, 50),
        "age_p99_ms": percentile(ages, 99),
        "age_max_ms": ages[-1] if ages else 0.0,
        "lost": lost,
        "closed": sum(1 for client in results if client["closed"] is not None),
    }
