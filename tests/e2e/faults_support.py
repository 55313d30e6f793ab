"""Helpers for the fault-recovery tests (tests/e2e/test_fault_recovery.py).

Private servers a test may kill and restart at will (a redis-server, a PostgreSQL cluster),
a small client of the REST API, and ``converge``: the check every fault test ends with.
The platform is observed with plain SQL (psycopg) on the database its processes use and
with the Docker engine, so the test process's own Django settings never matter.

Run as ``python -m tests.e2e.faults_support twice celery ...`` it is a Celery launcher in
which every message the process sends (``wire.dispatch``) is sent twice: the broker
delivers each report and each order two times.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

PLACED = ("placing", "starting", "running", "stopping")
TRANSIENT = ("placing", "starting", "stopping")
ENDED = ("stopped", "failed", "preempted", "expired")
SLACK = timedelta(seconds=2)  # clocks of the agent (Docker's StartedAt) and the database


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# --- private servers -----------------------------------------------------------------------


class PrivateRedis:
    """A redis-server of the test's own, on a free port, without persistence: a restart
    loses every queued message, as a crashed broker without AOF does."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir)]  # fmt: skip
        log = (self.dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(self.ping, 15, "the private redis-server")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=15)
        self.proc = None

    def restart(self, down_s: float = 0.0, sig: signal.Signals = signal.SIGKILL) -> None:
        self.stop(sig)
        time.sleep(down_s)
        self.start()


PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (initdb as the postgres user, trust auth)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpushare-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/gpushare"

    @staticmethod
    def available() -> bool:
        return (PG_BIN / "initdb").exists() and shutil.which("runuser") is not None and os.geteuid() == 0

    def _as_postgres(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["runuser", "-u", "postgres", "--", *argv], check=check, capture_output=True, timeout=120
        )

    def init(self) -> None:
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self.start()
        self._as_postgres(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "gpushare")

    def _ctl(self, *args: str) -> None:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", opts, "-w", "-t", "60", *args)

    def start(self) -> None:
        self._ctl("-l", str(self.dir / "server.log"), "start")

    def restart(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown that ends every session; ``immediate``: a crash (every
        server process killed at once, recovery at the next start)."""
        self._ctl("-m", mode, "stop")
        self.start()

    def remove(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop",
                              check=False)  # fmt: skip
        shutil.rmtree(self.dir, ignore_errors=True)


# --- the REST API --------------------------------------------------------------------------


class Api:
    def __init__(self, base: str, key: str) -> None:
        self.base, self.key = base, key

    def call(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(  # noqa: S310 - our own server
            self.base + path,
            data=data,
            method="POST",
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read()[:300].decode(errors="replace")}

    def request(self, tier: str = "dedicated", image: str = "busybox") -> int:
        body = {"project": "vision", "tier": tier, "image": image, "isolation": "container",
                "gpu_count": 1, "duration_hours": 1}  # fmt: skip
        code, answer = self.call("/api/v1/sandboxes/", body)
        assert code == 201, (code, answer)
        return int(answer["id"])

    def stop(self, sandbox_id: int) -> int:
        return self.call(f"/api/v1/sandboxes/{sandbox_id}/stop/")[0]


# --- observing the platform -----------------------------------------------------------------


def query(db_url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(db_url, connect_timeout=5) as conn:
        return list(conn.execute(sql, args).fetchall())


def states(db_url: str, ids: list[int] | None = None) -> dict[int, str]:
    rows = query(db_url, "SELECT id, state FROM sandboxes_sandbox")
    return {pk: state for pk, state in rows if ids is None or pk in ids}


def wait_states(db_url: str, want: Any, timeout: float, what: str, logs: Any = None) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    now: dict[int, str] = {}
    while time.monotonic() < deadline:
        now = states(db_url)
        if want(now):
            return now
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}: {now}\n{logs() if logs else ''}")


def containers(docker_client: Any, host: str) -> list[dict[str, Any]]:
    """The host's containers, running or not, as the engine lists them (no inspect)."""
    found = docker_client.api.containers(all=True, filters={"label": f"io.gpushare.host={host}"})
    return [{"key": c["Labels"]["io.gpushare.allocation"], "state": c["State"], "id": c["Id"]} for c in found]


@dataclass
class Picture:
    sandboxes: dict[int, tuple[str, str, int | None]]  # id -> (state, allocation key, host id)
    active: Counter[int]  # sandbox id -> active allocations
    open_usage: dict[int, list[str]]  # sandbox id -> allocation keys of open intervals
    boxes: list[dict[str, Any]]

    def problems(self, quiet: bool) -> list[str]:
        """What is not true yet. ``quiet``: nothing may still be on its way (placing...)."""
        found = []
        by_key = {key: pk for pk, (_, key, _) in self.sandboxes.items() if key}
        per_key = Counter(b["key"] for b in self.boxes)
        for box in self.boxes:
            pk = by_key.get(box["key"])
            state = self.sandboxes[pk][0] if pk is not None else None
            if state not in PLACED or (quiet and (state != "running" or box["state"] != "running")):
                found.append(f"orphan container {box['key']} ({box['state']}) of sandbox {pk} ({state})")
        for pk, (state, key, host) in self.sandboxes.items():
            if quiet and state in TRANSIENT:
                found.append(f"sandbox {pk} still {state}")
            if state in ("queued", *ENDED) and (self.active[pk] or self.open_usage.get(pk)):
                found.append(f"sandbox {pk} is {state} but holds {self.active[pk]} allocations, "
                             f"open usage {self.open_usage.get(pk)}")  # fmt: skip
            if state == "queued" and host is not None:
                found.append(f"queued sandbox {pk} still has host {host}")
            if state in PLACED and not self.active[pk]:
                found.append(f"sandbox {pk} is {state} without an allocation (a half-done placement)")
            if state == "running":
                if self.open_usage.get(pk) != [key]:
                    found.append(
                        f"running sandbox {pk} has open usage {self.open_usage.get(pk)}, not [{key}]"
                    )
                if per_key[key] != 1:
                    found.append(f"running sandbox {pk} has {per_key[key]} containers")
        return found


def picture(db_url: str, docker_client: Any, host: str) -> Picture:
    sandboxes = {
        pk: (state, key, host_id)
        for pk, state, key, host_id in query(
            db_url, "SELECT id, state, allocation_key, host_id FROM sandboxes_sandbox"
        )
    }
    active = Counter(
        dict(
            query(
                db_url,
                "SELECT sandbox_id, count(*) FROM sandboxes_allocation WHERE active GROUP BY sandbox_id",
            )
        )
    )
    open_usage: dict[int, list[str]] = {}
    for pk, key in query(
        db_url, "SELECT sandbox_id, allocation_key FROM billing_usagerecord WHERE ended_at IS NULL"
    ):
        open_usage.setdefault(pk, []).append(key)
    return Picture(sandboxes, active, open_usage, containers(docker_client, host))


def converge(
    db_url: str, docker_client: Any, host: str, heartbeat_s: float = 1, timeout: float = 45, logs: Any = None
) -> float:
    """Wait until the platform is quiet and true, then check the ledger; returns how long
    it took. Quiet: nothing placing/starting/stopping, no orphan, and the same picture one
    reconcile period (a heartbeat's report) and a margin later."""
    began = time.monotonic()
    deadline = began + timeout
    last: list[str] = []
    settled: Picture | None = None
    while time.monotonic() < deadline:
        now = picture(db_url, docker_client, host)
        last = now.problems(quiet=True)
        if not last and settled is not None and _same(settled, now):
            check_ledger(db_url)
            return time.monotonic() - began
        settled = None if last else now
        time.sleep(heartbeat_s + 0.5)
    raise AssertionError(f"no convergence after {timeout}s: {last}\n{logs() if logs else ''}")


def _same(a: Picture, b: Picture) -> bool:
    return a.sandboxes == b.sandboxes and sorted(x["id"] for x in a.boxes) == sorted(x["id"] for x in b.boxes)


def check_ledger(db_url: str) -> None:
    """No usage second lost or counted twice: each sandbox's intervals, one per time it ran,
    never overlap, each lies within the run its events record (from placement to the event
    that ended the run), closed ones carry their own duration, and only a running sandbox
    has one open (its last)."""
    events: dict[int, list[tuple[datetime, str]]] = {}
    for pk, at, to in query(
        db_url, "SELECT sandbox_id, at, to_state FROM sandboxes_sandboxevent ORDER BY at, id"
    ):
        events.setdefault(pk, []).append((at, to))
    records: dict[int, list[tuple[datetime, datetime | None, timedelta | None]]] = {}
    for pk, start, end, duration in query(
        db_url,
        "SELECT sandbox_id, started_at, ended_at, duration FROM billing_usagerecord ORDER BY started_at, id",
    ):
        records.setdefault(pk, []).append((start, end, duration))
    state = dict(query(db_url, "SELECT id, state FROM sandboxes_sandbox"))
    for pk, evs in events.items():
        runs = _runs(evs)
        got = records.get(pk, [])
        assert len(got) == len(runs), f"sandbox {pk}: {len(got)} usage intervals for {len(runs)} runs {evs}"
        for i, ((start, end, duration), (placed, running, ended, last_before)) in enumerate(
            zip(got, runs, strict=True)
        ):
            where = f"sandbox {pk} run {i}: usage {start}..{end}, events {evs}"
            assert placed - SLACK <= start <= running + SLACK, where
            if end is None:
                assert ended is None and i == len(got) - 1 and state[pk] == "running", where
                continue
            assert ended is not None, where
            assert duration == end - start, where
            assert last_before - SLACK <= end <= ended + SLACK, where
            if i + 1 < len(got):
                assert end <= got[i + 1][0], f"{where}: overlaps the next"


def _runs(evs: list[tuple[datetime, str]]) -> list[tuple[datetime, datetime, datetime | None, datetime]]:
    """(placed, running, ended or None, running again) for each time it ran: the usage
    must end between the run's start and the event that ended it (a report taken before
    that event, a stop confirmed by the agent)."""
    runs: list[tuple[datetime, datetime, datetime | None, datetime]] = []
    placed: datetime | None = None
    i = 0
    while i < len(evs):
        at, to = evs[i]
        if to == "placing":
            placed = at
        if to == "running":
            assert placed is not None, evs
            end = next(((j, t) for j, (t, s) in enumerate(evs) if j > i and s in ("queued", *ENDED)), None)
            if end is None:
                runs.append((placed, at, None, at))
                break
            runs.append((placed, at, end[1], at))
            i = end[0]
        i += 1
    return runs


def reported(db_url: str, name: str) -> str:
    return str(query(db_url, "SELECT state FROM fleet_host WHERE name = %s", name)[0][0])


# --- a Celery launcher that sends every message twice ------------------------------------------


def _twice() -> None:
    from wire import dispatch

    once_control, once_host = dispatch.to_control, dispatch.to_host

    def control_twice(task: str, *args: Any) -> None:
        once_control(task, *args)
        once_control(task, *args)

    def host_twice(host: str, task: str, *args: Any) -> None:
        once_host(host, task, *args)
        once_host(host, task, *args)

    dispatch.to_control, dispatch.to_host = control_twice, host_twice
    from celery.__main__ import main

    sys.argv = ["celery", *sys.argv[3:]]
    main()


if __name__ == "__main__" and sys.argv[1:3] == ["twice", "celery"]:
    _twice()
