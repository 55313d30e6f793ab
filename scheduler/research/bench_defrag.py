"""MIG workload replay: how many requests re-layout saves, and what it costs in moves.

A fleet of H100-80GB GPUs in MIG mode receives a seeded stream of requests for profiles
1g to 7g (Poisson arrivals, exponential durations). Each request is placed without
re-layout when some GPU has a legal free start (fullest GPU first, ``place_mig``);
otherwise it is rejected, or, in the second replay of the same stream, ``plan_mig`` is
asked for a re-layout, which is applied before placing. Instances are destroyed when their
sandbox leaves, so the fleet holds no idle instances.

``run_mig_replay`` returns the figures; ``mig_replay_table`` renders them as markdown.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from scheduler.defrag import MigGpu, MigInstance, apply_mig_plan, place_mig, plan_mig
from scheduler.gpus import CATALOG, COMPUTE_SLICES

MODEL = "H100-80GB"

# Share of requests per profile, assumed (no public trace of MIG requests to take it from):
# many small inference and notebook slices, fewer large training ones, and enough whole-GPU
# requests that fragmentation costs something.
DEFAULT_MIX: dict[str, float] = {
    "1g.10gb": 0.35,
    "1g.20gb": 0.10,
    "2g.20gb": 0.20,
    "3g.40gb": 0.15,
    "4g.40gb": 0.10,
    "7g.80gb": 0.10,
}


@dataclass(frozen=True)
class MigRequest:
    id: int
    arrival: float
    duration: float
    profile: str


def request_stream(
    count: int, gpus: int, load: float, mix: dict[str, float], seed: int, mean_duration: float = 60.0
) -> list[MigRequest]:
    """``count`` requests whose offered compute is ``load`` times the fleet's compute slices."""
    rng = random.Random(seed)
    model = CATALOG[MODEL]
    profiles = sorted(mix)
    weights = [mix[p] for p in profiles]
    mean_slices = sum(w * model.profile(p).compute_slices for p, w in zip(profiles, weights, strict=True))
    mean_slices /= sum(weights)
    # Little's law: busy slices = arrival rate x mean duration x slices per request.
    rate = load * gpus * COMPUTE_SLICES / (mean_duration * mean_slices)
    now, stream = 0.0, []
    for i in range(count):
        now += rng.expovariate(rate)
        profile = rng.choices(profiles, weights)[0]
        stream.append(MigRequest(i, now, rng.expovariate(1 / mean_duration), profile))
    return stream


@dataclass
class _Replay:
    admitted: int = 0
    admitted_slices: int = 0  # compute slices of the admitted requests
    rejected: int = 0
    rejected_by_profile: Counter[str] = field(default_factory=Counter)
    relayouts: int = 0
    moves: int = 0
    disturbed: int = 0
    plan_seconds: float = 0.0
    plan_calls: int = 0


def _replay(stream: list[MigRequest], gpus: int, relayout: bool) -> _Replay:
    fleet = [MigGpu(f"GPU-{i:02d}", MODEL) for i in range(gpus)]
    index = {g.uuid: i for i, g in enumerate(fleet)}
    where: dict[str, str] = {}  # sandbox -> GPU
    departures: list[tuple[float, str]] = []
    stats = _Replay()
    for request in stream:
        while departures and departures[0][0] <= request.arrival:
            _, sandbox = heapq.heappop(departures)
            i = index[where.pop(sandbox)]
            fleet[i] = replace(
                fleet[i], instances=tuple(x for x in fleet[i].instances if x.sandbox != sandbox)
            )
        spot = place_mig(fleet, request.profile)
        if spot is None and relayout:
            began = time.perf_counter()
            plan = plan_mig(fleet, request.profile)
            stats.plan_seconds += time.perf_counter() - began
            stats.plan_calls += 1
            if plan is not None:
                fleet = apply_mig_plan(fleet, plan)
                where = {x.sandbox: g.uuid for g in fleet for x in g.instances}
                stats.relayouts += 1
                stats.moves += len(plan.moves)
                stats.disturbed += len(plan.disturbed)
                spot = plan.gpu, plan.start
        if spot is None:
            stats.rejected += 1
            stats.rejected_by_profile[request.profile] += 1
            continue
        gpu, start = spot
        sandbox = f"sb-{request.id}"
        new = MigInstance(f"{gpu}/{request.profile}@{start}#{request.id}", request.profile, start, sandbox)
        fleet[index[gpu]] = replace(fleet[index[gpu]], instances=(*fleet[index[gpu]].instances, new))
        where[sandbox] = gpu
        heapq.heappush(departures, (request.arrival + request.duration, sandbox))
        stats.admitted += 1
        stats.admitted_slices += CATALOG[MODEL].profile(request.profile).compute_slices
    return stats


def run_mig_replay(
    gpus: int = 64,
    requests: int = 8000,
    load: float = 0.95,
    seed: int = 1,
    mix: dict[str, float] | None = None,
) -> dict[str, float]:
    """Replay one seeded stream without and with re-layout; the figures of both."""
    stream = request_stream(requests, gpus, load, mix or DEFAULT_MIX, seed)
    plain = _replay(stream, gpus, relayout=False)
    defrag = _replay(stream, gpus, relayout=True)
    admitted = max(defrag.admitted, 1)
    asked = Counter(r.profile for r in stream)
    slices = sum(CATALOG[MODEL].profile(r.profile).compute_slices for r in stream)
    by_profile = {
        f"rejected_pct_{mode}_{profile}": 100 * stats.rejected_by_profile[profile] / asked[profile]
        for mode, stats in (("plain", plain), ("relayout", defrag))
        for profile in sorted(asked)
    }
    return {
        "gpus": gpus,
        "requests": requests,
        "load": load,
        "seed": seed,
        "rejected_pct_plain": 100 * plain.rejected / requests,
        "rejected_pct_relayout": 100 * defrag.rejected / requests,
        "admitted_slices_pct_plain": 100 * plain.admitted_slices / slices,
        "admitted_slices_pct_relayout": 100 * defrag.admitted_slices / slices,
        "relayouts": defrag.relayouts,
        "moves_per_admitted": defrag.moves / admitted,
        "disturbed_per_admitted": defrag.disturbed / admitted,
        "moves_per_relayout": defrag.moves / max(defrag.relayouts, 1),
        "plan_ms_mean": 1000 * defrag.plan_seconds / max(defrag.plan_calls, 1),
        **by_profile,
    }


def mig_replay_table(figures: dict[str, float]) -> str:
    """The figures of ``run_mig_replay`` as a markdown table."""
    head = (
        f"MIG replay: {figures['gpus']:.0f} x {MODEL}, {figures['requests']:.0f} requests, "
        f"offered load {figures['load']:.0%}, seed {figures['seed']:.0f}"
    )
    rows = [
        ("rejected without re-layout", f"{figures['rejected_pct_plain']:.2f} %"),
        ("rejected with re-layout", f"{figures['rejected_pct_relayout']:.2f} %"),
        (
            "compute slices asked for and admitted, without re-layout",
            f"{figures['admitted_slices_pct_plain']:.2f} %",
        ),
        (
            "compute slices asked for and admitted, with re-layout",
            f"{figures['admitted_slices_pct_relayout']:.2f} %",
        ),
        ("re-layouts applied", f"{figures['relayouts']:.0f}"),
        ("moves per admitted request", f"{figures['moves_per_admitted']:.3f}"),
        ("sandboxes disturbed per admitted request", f"{figures['disturbed_per_admitted']:.3f}"),
        ("moves per re-layout", f"{figures['moves_per_relayout']:.2f}"),
        ("planning time per call", f"{figures['plan_ms_mean']:.1f} ms"),
    ]
    lines = [head, "", "| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    profiles = sorted(
        (k.removeprefix("rejected_pct_plain_") for k in figures if k.startswith("rejected_pct_plain_")),
        key=lambda p: (CATALOG[MODEL].profile(p).compute_slices, p),
    )
    lines += ["", "| profile | rejected without re-layout | rejected with re-layout |", "|---|---|---|"]
    for p in profiles:
        plain, relayout = figures[f"rejected_pct_plain_{p}"], figures[f"rejected_pct_relayout_{p}"]
        lines.append(f"| {p} | {plain:.2f} % | {relayout:.2f} % |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--load", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(mig_replay_table(run_mig_replay(args.gpus, args.requests, args.load, args.seed)))


if __name__ == "__main__":
    main()
