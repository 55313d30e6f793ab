"""How fast a live cycle decides with fair share, quotas, preemption and backfill at work.

``measure_live()`` returns the figures; ``python -m scheduler.research.bench_cycle`` prints them.
The fleet is ``scheduler.bench``'s synthetic one (a quarter of the GPUs in each sharing
mode), half filled by sandboxes of 20 projects with known end times, some preemptible and
some borrowed, and a queue of mixed requests, a tenth of them of a higher priority class.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace

from scheduler.bench import synthetic_fleet, synthetic_queue
from scheduler.cluster import (
    FairShareState,
    Place,
    Preempt,
    ProjectShare,
    Request,
    Reserve,
    Running,
    Snapshot,
    book,
)
from scheduler.cycle import run_cycle
from scheduler.placement import DEFAULT_POLICY, get_policy

PROJECTS = 20
NOW = 1_800_000_000.0


def live_cluster(
    hosts: int, queue_size: int, seed: int = 42, fill: float = 0.5
) -> tuple[Snapshot, list[Request], FairShareState]:
    """A fleet ``fill`` full (by requests), its queue and the projects' shares, from one seed."""
    rng = random.Random(seed)
    snapshot = synthetic_fleet(hosts, 8, rng)
    filler = [
        replace(r, id=1_000_000 + r.id, max_duration_s=rng.choice((3600.0, 4 * 3600.0, 24 * 3600.0)))
        for r in synthetic_queue(int(hosts * 8 * fill), rng)
    ]
    gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    by_id = {r.id: r for r in filler}
    for decision in run_cycle(snapshot, filler, get_policy("first-fit"), NOW - 1800):
        if not isinstance(decision, Place):
            continue
        request = by_id[decision.request_id]
        for grant in decision.grants:
            book(gpus[grant.gpu_uuid], grant)
        snapshot.running.append(
            Running(
                request.id,
                request.project,
                decision.host,
                decision.grants,
                priority=request.priority,
                started_at=NOW - rng.uniform(0, request.max_duration_s),
                ends_at=NOW + rng.uniform(60, request.max_duration_s),
                preemptible=rng.random() < 0.5,
                borrowed=rng.random() < 0.2,
            )
        )
    queue = [
        replace(
            r,
            submitted_at=NOW - queue_size + r.submitted_at,
            priority=200 if rng.random() < 0.1 else r.priority,
            max_duration_s=rng.choice((1800.0, 3600.0, 8 * 3600.0)),
        )
        for r in synthetic_queue(queue_size, rng)
    ]
    shares = {
        f"p{i}": ProjectShare(
            weight=1.0 + i % 3,
            guaranteed_milli=hosts * 8 * 1000 // PROJECTS,
            limit_milli=hosts * 8 * 1000 // 4,
            usage_gpu_s=rng.uniform(0, 50_000),
        )
        for i in range(PROJECTS)
    }
    return snapshot, queue, FairShareState(shares, half_life_s=86400.0, usage_at=NOW - 300)


def measure_live(
    hosts: int = 63, queue_size: int = 1000, repeats: int = 5, fill: float = 0.5
) -> dict[str, float]:
    """Cycle time and what it decided, for ``hosts`` hosts of 8 GPUs and ``queue_size`` queued.

    ``fill`` above 1 saturates the fleet, so that most high-priority requests preempt.
    """
    snapshot, queue, fairshare = live_cluster(hosts, queue_size, fill=fill)
    policy = get_policy(DEFAULT_POLICY)
    times: list[float] = []
    cpu: list[float] = []
    decisions = []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        decisions = run_cycle(snapshot, queue, policy, NOW, fairshare=fairshare)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "hosts": hosts,
        "gpus": hosts * 8,
        "running": len(snapshot.running),
        "queue": queue_size,
        "placed": sum(1 for d in decisions if isinstance(d, Place)),
        "preempted": sum(1 for d in decisions if isinstance(d, Preempt)),
        "reserved": sum(1 for d in decisions if isinstance(d, Reserve)),
        "p50_ms": statistics.median(times) * 1000,
        "max_ms": max(times) * 1000,
        # CPU time of the cycle alone: what wall time would be on an otherwise idle machine.
        "cpu_p50_ms": statistics.median(cpu) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", type=int, default=63)
    parser.add_argument("--queue", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for fill in (0.5, 3.0):
        print({"fill": fill, **measure_live(args.hosts, args.queue, args.repeats, fill)})


if __name__ == "__main__":
    main()
