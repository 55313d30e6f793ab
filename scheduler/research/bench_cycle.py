"""The scheduling cycle on a synthetic fleet: alone, and live with fair share, quotas,
preemption and backfill at work (the ``cycle`` and ``live`` sections of ``make bench``).

The fleet is H100 hosts of 8 GPUs, a quarter of the GPUs in each sharing mode
(``synthetic_fleet``), and the queue mixed requests of every mode (``synthetic_queue``).
``measure_cycle()`` times ``run_cycle`` with the portal's policy and no fair share;
``measure_live()`` half fills the fleet with sandboxes of 20 projects with known end times,
some preemptible and some borrowed, and queues mixed requests, a tenth of them of a higher
priority class. ``python -m scheduler.research.bench_cycle`` prints the live figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace
from typing import Any

from scheduler.cluster import (
    DepartmentShare,
    FairShareState,
    GpuState,
    HostState,
    MigSlot,
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
from scheduler.gpus import MODELS
from scheduler.placement import DEFAULT_POLICY, get_policy
from scheduler.research.bench_markdown import section

MODES = ("dedicated", "mig", "mps", "timeslice")
PROJECTS = 20
NOW = 1_800_000_000.0


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


def measure_cycle(hosts: int, gpus: int, queue_size: int, repeats: int) -> dict[str, float]:
    """Cycle time of the portal's policy without fair share, and how many requests it placed."""
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


def cycle_section(rows: list[dict[str, float]]) -> str:
    return section(
        "cycle",
        "Cycle scaling on a synthetic fleet (the portal's policy, no fair share)",
        [
            "One `run_cycle` over a queue of mixed requests (dedicated 1-4 GPUs, MIG, MPS, time-slice)",
            "on H100 hosts with 8 GPUs, a quarter in each sharing mode. Measured by `make bench`",
            "(`python -m scheduler.research.bench`) on the development machine (2 cores); 5 repeats.",
        ],
        ["hosts", "GPUs", "queued", "placed", "cycle p50 (ms)", "cycle max (ms)"],
        [
            (r["hosts"], r["gpus"], r["queue"], r["placed"], f"{r['p50_ms']:.1f}", f"{r['max_ms']:.1f}")
            for r in rows
        ],
    )


def live_cluster(
    hosts: int, queue_size: int, seed: int = 42, fill: float = 0.5, departments: bool = False
) -> tuple[Snapshot, list[Request], FairShareState]:
    """A fleet ``fill`` full (by requests), its queue and the projects' shares, from one seed;
    with ``departments``, the projects in four groups under two institutes (a 3-level tree,
    each level with a limit, the groups' guarantees their projects')."""
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
            department=f"group{i % 4}" if departments else None,
        )
        for i in range(PROJECTS)
    }
    tree = {}
    if departments:
        half = hosts * 8 * 1000 // 2
        tree = {
            **{f"inst{i}": DepartmentShare(weight=1.0 + i, limit_milli=half + half // 2) for i in range(2)},
            **{f"group{i}": DepartmentShare(parent=f"inst{i // 2}", limit_milli=half) for i in range(4)},
        }
    return snapshot, queue, FairShareState(shares, tree, half_life_s=86400.0, usage_at=NOW - 300)


def measure_live(
    hosts: int = 63, queue_size: int = 1000, repeats: int = 5, fill: float = 0.5, departments: bool = False
) -> dict[str, Any]:
    """Cycle time and what it decided, for ``hosts`` hosts of 8 GPUs and ``queue_size`` queued.

    ``fill`` above 1 saturates the fleet, so that most high-priority requests preempt.
    """
    snapshot, queue, fairshare = live_cluster(hosts, queue_size, fill=fill, departments=departments)
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
        "tree": "3 levels" if departments else "flat",
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


def live_section(rows: list[dict[str, Any]]) -> str:
    return section(
        "live",
        "Live scheduling cycle (fair share, quotas, backfill, preemption)",
        [
            "One `run_cycle` with a `FairShareState` of 20 projects (weights, guarantees, limits,",
            "decayed usage) over 1,000 queued requests on 63 hosts x 8 GPUs, half full and",
            "oversubscribed; flat, or the projects in four departments under two institutes",
            "(limits at every level, fair share along the tree). *cycle* is wall time (p50 of 5);",
            "the goal is <= 1 s.",
        ],
        [
            "tree",
            "GPUs",
            "running",
            "queued",
            "placed",
            "preempted",
            "reserved",
            "cycle p50 (ms)",
            "cycle max (ms)",
        ],
        [
            (
                r["tree"],
                r["gpus"],
                r["running"],
                r["queue"],
                r["placed"],
                r["preempted"],
                r["reserved"],
                f"{r['p50_ms']:.0f}",
                f"{r['max_ms']:.0f}",
            )
            for r in rows
        ],
    )


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
