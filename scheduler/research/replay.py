"""Replay a pod trace against a GPU cluster the way the FGD paper's simulator does.

    python -m scheduler.research.replay --nodes NODES.csv --pods PODS.csv --policy fgd --seed 42 \\
        --tune 1.3 --out DIR
    python -m scheduler.research.replay --engine live --nodes NODES.csv --pods PODS.csv --seed 42 \\
        --tune 1.3 [--batch 100] --out DIR

``--engine offline`` (the default) runs one of the FGD paper's six policies, or the
product's ``gpushare`` asked one pod at a time; ``--engine live`` runs the product's
scheduling cycle itself with its default policy (scheduler/research/live_replay.py).

Pods arrive one at a time and never leave; each goes to the feasible node with the
highest score (ties: the node's random priority) or fails when no node can take it.
Writes DIR/curve.csv and DIR/placements.csv. The curve has one row per pod, after it:
arrived_pct (GPU milli requested so far, failed pods included) and allocated_pct, both
as % of the cluster's GPU capacity computed as the paper's analysis does, and frag_pct,
FGD's fragmentation sum of F(n) as % of capacity (the paper's Fig. 7a measure).
placements.csv says where each pod went (node empty when it failed).

Speed: a node's feasibility and score for a pod depend only on that node's state and the
pod's shape, and one placement changes one node. So for every pod shape the replay keeps
each node's last (score, priority) key and, when that shape comes again, re-scores only
the nodes changed since; picking the winner is then one ``max`` over a list of ints.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scheduler.placement import DEFAULT_POLICY
from scheduler.placement.fragmentation import Fragmentation
from scheduler.research.live_replay import replay_live, replay_offline
from scheduler.research.paper import PAPER_POLICIES
from scheduler.research.paper.base import ReplayContext, TracePolicy
from scheduler.research.paper.cluster import Cluster
from scheduler.research.result import ReplayResult
from scheduler.research.trace import PodSpec, Workload, build_workload, load_nodes, load_pods

PolicyFactory = Callable[[ReplayContext], TracePolicy]
POLICIES: dict[str, PolicyFactory] = dict(PAPER_POLICIES)
# The product's policy: it places on the live model of the fleet, not on ``Cluster``.
PRODUCT_POLICY = DEFAULT_POLICY
ENGINES = ("offline", "live")

# Scores are shifted into positive ints so -1 can mean "infeasible" in the per-shape keys.
_SCORE_OFFSET = 1 << 20
_INFEASIBLE = -1

_ShapeKey = tuple[int, int, int, int, tuple[str, ...]]


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy available to ``replay`` and the CLI by name."""
    POLICIES[name] = factory


@dataclass
class _ShapeCache:
    keys: list[int]
    seen: int  # length of the change log when ``keys`` was last brought up to date


def _shape(pod: PodSpec) -> _ShapeKey:
    return (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.models)


def replay(workload: Workload, policy_name: str) -> ReplayResult:
    """Schedule every pod of ``workload`` in order with the named policy."""
    if policy_name == PRODUCT_POLICY:
        return replay_offline(workload, policy_name)
    start = time.perf_counter()
    nodes = workload.nodes
    count = len(nodes)
    cluster = Cluster(nodes)
    frag = Fragmentation(workload.typical)
    rng = random.Random()
    rng.setstate(workload.rng_state)  # continue the seed's stream where the workload left it
    policy = POLICIES[policy_name](ReplayContext(cluster, frag, rng))
    # max() over keys must prefer the smallest priority among equal scores.
    tiebreak = [count - 1 - p for p in workload.priority]
    node_by_tiebreak = [0] * count
    for n, t in enumerate(tiebreak):
        node_by_tiebreak[t] = n

    def node_frag(n: int) -> float:
        return frag.amount(nodes[n].model, cluster.cpu_left[n], tuple(sorted(cluster.free[n])))

    frags = [node_frag(n) for n in range(count)]
    shapes: dict[_ShapeKey, _ShapeCache] = {}
    changes: list[int] = []  # node changed by each successful placement, in order
    result = ReplayResult(workload)
    arrived = used = 0
    fits, score = cluster.fits, policy.score

    for pod in workload.pods:
        began = time.perf_counter()
        arrived += pod.total_gpu_milli
        cache = shapes.get(_shape(pod))
        if cache is None or len(changes) - cache.seen >= count:
            stale: range | set[int] = range(count)
            if cache is None:
                cache = shapes[_shape(pod)] = _ShapeCache([_INFEASIBLE] * count, 0)
        else:
            stale = set(changes[cache.seen :])
        keys = cache.keys
        for n in stale:
            keys[n] = (score(n, pod) + _SCORE_OFFSET) * count + tiebreak[n] if fits(n, pod) else _INFEASIBLE
        cache.seen = len(changes)

        chosen = -1
        if policy.random_node:
            feasible = [n for n, k in enumerate(keys) if k != _INFEASIBLE]
            if len(feasible) == 1:  # a lone feasible node is bound without scoring
                chosen = feasible[0]
            elif feasible:
                chosen = feasible[rng.randrange(len(feasible))]
        else:
            best = max(keys)
            if best != _INFEASIBLE:
                chosen = node_by_tiebreak[best % count]

        gpus: tuple[int, ...] = ()
        if chosen >= 0:
            gpus = policy.pick_gpus(chosen, pod)
            cluster.allocate(chosen, pod, gpus)
            changes.append(chosen)
            used += pod.gpu_milli * len(gpus)
            frags[chosen] = node_frag(chosen)
        result.decision_s.append(time.perf_counter() - began)
        result.node.append(chosen)
        result.gpus.append(gpus)
        result.arrived_milli.append(arrived)
        result.used_milli.append(used)
        result.frag_milli.append(sum(frags))
    result.wall_s = time.perf_counter() - start
    return result


def write_outputs(result: ReplayResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    capacity = result.workload.capacity_milli
    with (out / "curve.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arrived_pct", "allocated_pct", "frag_pct"])
        for arrived, used, frag in zip(
            result.arrived_milli, result.used_milli, result.frag_milli, strict=True
        ):
            writer.writerow([repr(result.pct(arrived)), repr(result.pct(used)), repr(100 * frag / capacity)])
    write_placements(result, out)


def write_placements(result: ReplayResult, out: Path) -> None:
    """DIR/placements.csv: where each pod went (the twin writes its own the same way)."""
    nodes = result.workload.nodes
    with (out / "placements.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seq", "pod", "source", "node", "gpus", "milli_per_gpu"])
        for seq, (pod, n, gpus) in enumerate(
            zip(result.workload.pods, result.node, result.gpus, strict=True)
        ):
            node = nodes[n].name if n >= 0 else ""
            writer.writerow([seq, pod.name, pod.source, node, ";".join(map(str, gpus)), pod.gpu_milli])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(result: ReplayResult) -> str:
    pods = len(result.node)
    if not pods:
        return "no pods"
    return (
        f"{pods} pods, {pods - result.failed} placed, {result.failed} failed; "
        f"allocated {result.pct(result.used_milli[-1]):.2f}% of {result.workload.total_gpus} GPUs "
        f"at arrived {result.pct(result.arrived_milli[-1]):.2f}%; "
        f"decision p50 {statistics.median(result.decision_s) * 1e3:.3f} ms, "
        f"p99 {percentile(result.decision_s, 0.99) * 1e3:.3f} ms; replay {result.wall_s:.2f} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=Path, required=True, help="node list CSV (GPU nodes are kept)")
    parser.add_argument("--pods", type=Path, required=True, help="pod list CSV")
    parser.add_argument("--engine", choices=ENGINES, default="offline")
    parser.add_argument(
        "--policy",
        choices=sorted([*POLICIES, PRODUCT_POLICY]),
        help=f"offline engine: which policy (the live engine runs the portal's, {PRODUCT_POLICY})",
    )
    parser.add_argument("--batch", type=int, default=100, help="live engine: arrivals per cycle")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--tune", type=float, default=1.3, help="target GPU request / GPU capacity")
    parser.add_argument("--out", type=Path, required=True, help="folder for curve.csv and placements.csv")
    args = parser.parse_args(argv)
    if args.engine == "offline" and args.policy is None:
        parser.error("--engine offline needs --policy")
    if args.engine == "live" and args.policy not in (None, PRODUCT_POLICY):
        parser.error(f"--engine live runs the portal's policy, {PRODUCT_POLICY}")
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    started = time.perf_counter()
    workload = build_workload(load_nodes(args.nodes), load_pods(args.pods), args.seed, args.tune)
    if args.engine == "live":
        result, label = replay_live(workload, args.batch), f"{PRODUCT_POLICY} (live, batch {args.batch})"
    else:
        result, label = replay(workload, args.policy), args.policy
    write_outputs(result, args.out)
    print(f"{label} seed {args.seed}: {summary(result)}; total {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
