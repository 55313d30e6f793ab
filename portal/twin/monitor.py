"""What the twin samples while it runs, every few seconds, from outside the control plane:
the database, Redis and /proc, as an operator's monitoring would."""

from __future__ import annotations

import csv
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import redis
from django.db import connection, connections
from django.db.models import Count, Sum
from django.utils import timezone

from portal.fleet.models import Gpu, Host
from portal.sandboxes.models import Allocation, Sandbox, SandboxState
from portal.twin.cluster import Services, cpu_seconds
from wire.celery import CONTROL_QUEUE, host_queue

SAMPLE_S = 5.0


@dataclass
class Sample:
    wall_s: float  # since the run began
    hosts_up: int
    hosts_lost: int
    gpu_allocated_pct: float
    queued: int  # sandboxes waiting in the portal's queue
    running: int
    control_queue: int  # messages waiting in the control worker's Celery queue
    host_queues: int  # messages waiting in all hosts' queues together
    control_cores: float  # CPU the control worker used over the interval, in cores
    agents_cores: float
    # now - the last heartbeat applied, over the hosts that are up: a sawtooth between the
    # processing lag and the beat interval plus it, whose phase the sampling clock picks.
    heartbeat_age_p99_s: float
    redis_ops_per_s: float
    database_mib: float


class Monitor:
    def __init__(
        self, services: Services, client: redis.Redis, hosts: list[str], gpus: int, out: Path
    ) -> None:
        self.out = out / "samples.csv"  # written as it goes: a run that stalls still shows why
        self.services = services
        self.client = client
        self.hosts = hosts
        self.capacity_milli = gpus * 1000
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twin-monitor", daemon=True)
        self._began = time.monotonic()

    def start(self) -> None:
        self._began = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = self._counters()
        try:
            while not self._stop.wait(SAMPLE_S):
                now = self._counters()
                sample = self._sample(last, now)
                self._write(sample)
                self.samples.append(sample)
                last = now
        finally:
            connections.close_all()  # this thread's own connection

    def _counters(self) -> dict[str, float]:
        return {
            "t": time.monotonic(),
            "control": cpu_seconds(self.services.pid("control")),
            "agents": cpu_seconds(self.services.pid("agents")),
            "redis": float(cast(dict[str, Any], self.client.info("stats"))["total_commands_processed"]),
        }

    def _sample(self, last: dict[str, float], now: dict[str, float]) -> Sample:
        elapsed = max(1e-6, now["t"] - last["t"])
        states = dict(Host.objects.values_list("state").annotate(n=Count("pk")).order_by())
        held = Allocation.objects.filter(active=True).aggregate(milli=Sum("milli_gpu"))["milli"] or 0
        sandboxes = dict(
            Sandbox.objects.filter(state__in=[SandboxState.QUEUED, SandboxState.RUNNING])
            .values_list("state")
            .annotate(n=Count("pk"))
            .order_by()
        )
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(CONTROL_QUEUE)
        for host in self.hosts:
            pipe.llen(host_queue(host))
        control_queue, *host_queues = pipe.execute()
        return Sample(
            wall_s=round(now["t"] - self._began, 1),
            hosts_up=states.get(Host.State.UP, 0),
            hosts_lost=states.get(Host.State.LOST, 0),
            gpu_allocated_pct=round(100 * held / self.capacity_milli, 3) if self.capacity_milli else 0.0,
            queued=sandboxes.get(SandboxState.QUEUED, 0),
            running=sandboxes.get(SandboxState.RUNNING, 0),
            control_queue=control_queue,
            host_queues=sum(host_queues),
            control_cores=round((now["control"] - last["control"]) / elapsed, 3),
            agents_cores=round((now["agents"] - last["agents"]) / elapsed, 3),
            heartbeat_age_p99_s=round(heartbeat_age_p99(), 2),
            redis_ops_per_s=round((now["redis"] - last["redis"]) / elapsed, 1),
            database_mib=round(database_bytes() / 2**20, 1),
        )

    def _write(self, sample: Sample) -> None:
        row = asdict(sample)
        new = not self.out.exists()
        with self.out.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)

    def rows(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.samples]


def heartbeat_age_p99() -> float:
    now = timezone.now()
    beats = Host.objects.filter(state=Host.State.UP).values_list("last_heartbeat_at", flat=True)
    ages = sorted((now - at).total_seconds() for at in beats if at is not None)
    return ages[min(len(ages) - 1, int(0.99 * len(ages)))] if ages else 0.0


def database_bytes() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_database_size(current_database())")
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def fleet_size() -> tuple[int, int]:
    """Hosts and GPUs the database knows."""
    return Host.objects.count(), Gpu.objects.count()
