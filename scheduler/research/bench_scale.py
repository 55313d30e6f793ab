"""How long one scheduling cycle takes at a real cluster's size, the fleet already full.

    python -m scheduler.research.bench scale [--json]

Fleets made of the openb GPU nodes: a sample of 250, the 1,213 of the trace, and the trace
four times over (4,852). Each is filled by the default trace, tuned to its capacity, up to
arrived 100 %, placing with the portal's policy; then ``run_cycle`` decides for a queue of
1,000 or 5,000 more of the trace's pods, most of which cannot start. The cycle runs as the
control worker runs it: on a snapshot built afresh for the cycle (the copy is made outside
the timer, as the portal builds one from the database) with the policy kept between
cycles. One JSON object per line with ``--json``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import replace

from scheduler.cluster import Request, Snapshot
from scheduler.cycle import run_cycle
from scheduler.placement import DEFAULT_POLICY, Policy, get_policy
from scheduler.research.bench_markdown import section
from scheduler.research.bench_trace import TRACES
from scheduler.research.live_replay import learn, mirror_snapshot, pod_request, replay_offline_on
from scheduler.research.trace import NodeSpec, build_workload, load_nodes, load_pods

SIZES = ((250, 1000), (250, 5000), (1213, 1000), (1213, 5000), (4852, 1000), (4852, 5000))
REPEATS = 10
SEED = 42


def fleet_nodes(hosts: int) -> list[NodeSpec]:
    """``hosts`` openb GPU nodes: a seeded sample below the trace's size, copies above it."""
    nodes = load_nodes(TRACES / "openb_node_list_gpu_node.csv")
    if hosts <= len(nodes):
        return sorted(random.Random(SEED).sample(nodes, hosts), key=lambda n: n.name)
    copies = -(-hosts // len(nodes))
    grown = [replace(n, name=f"{n.name}-{c}") for c in range(copies) for n in nodes]
    return sorted(grown[:hosts], key=lambda n: n.name)


def filled(hosts: int) -> tuple[Snapshot, Policy, list[Request]]:
    """The fleet filled to arrived 100 % by the default trace, the policy that filled it, and
    5,000 further pods of the trace as requests, in arrival order."""
    nodes = fleet_nodes(hosts)
    pods = load_pods(TRACES / "openb_pod_list_default.csv")
    workload = build_workload(nodes, pods, SEED, 1.0)
    snapshot = mirror_snapshot(workload.nodes)
    policy = get_policy(DEFAULT_POLICY)
    replay_offline_on(snapshot, policy, workload.pods)
    rng = random.Random(SEED)
    offset = len(workload.pods)
    more = [rng.choice(pods) for _ in range(max(p for _, p in SIZES))]
    for seq, pod in enumerate(more, offset):
        learn(policy, seq, pod)
    return snapshot, policy, [pod_request(seq, pod) for seq, pod in enumerate(more, offset)]


def measure(
    snapshot: Snapshot, policy: Policy, queue: list[Request], repeats: int = REPEATS
) -> dict[str, float]:
    times = []
    placed = 0
    for _ in range(repeats):
        fresh = snapshot.copy()  # what the control worker builds each tick, made untimed
        began = time.perf_counter()
        decisions = run_cycle(fresh, queue, policy, now=0.0, in_place=True)
        times.append(time.perf_counter() - began)
        placed = sum(1 for d in decisions if hasattr(d, "grants"))
    ordered = sorted(times)
    return {
        "hosts": len(snapshot.hosts),
        "gpus": sum(len(h.gpus) for h in snapshot.hosts),
        "pending": len(queue),
        "placed": placed,
        "cycle_p50_s": round(statistics.median(times), 4),
        "cycle_p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
    }


def rows(sizes: tuple[tuple[int, int], ...] = SIZES) -> list[dict[str, float]]:
    out = []
    fleets: dict[int, tuple[Snapshot, Policy, list[Request]]] = {}
    for hosts, pending in sizes:
        if hosts not in fleets:
            fleets[hosts] = filled(hosts)
        snapshot, policy, queue = fleets[hosts]
        out.append(measure(snapshot, policy, queue[:pending]))
    return out


def render(results: list[dict[str, float]]) -> str:
    return section(
        "scale",
        "Scheduling cycle at the Alibaba cluster's size",
        [
            "One `run_cycle` with the portal's policy on fleets of openb GPU nodes filled by the default",
            "trace to arrived 100 %, deciding for 1,000 or 5,000 more of its pods (most cannot start).",
            f"p50 / p99 of {REPEATS} cycles, each on a freshly built snapshot with the policy kept between",
            "cycles, as the control worker runs it. Made by `python -m scheduler.research.bench scale`",
            "(2 cores); the goal on the openb fleet (1,213 hosts) is p99 <= 0.25 s with 1,000 pending,",
            "<= 1 s with 5,000.",
        ],
        ["hosts", "GPUs", "pending", "placed", "cycle p50 (s)", "cycle p99 (s)"],
        [
            (
                r["hosts"],
                r["gpus"],
                r["pending"],
                r["placed"],
                f"{r['cycle_p50_s']:.3f}",
                f"{r['cycle_p99_s']:.3f}",
            )
            for r in results
        ],
    )


def print_json(results: list[dict[str, float]]) -> None:
    for row in results:
        print(json.dumps({k: row[k] for k in ("hosts", "gpus", "pending", "cycle_p50_s", "cycle_p99_s")}))
