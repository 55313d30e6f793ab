"""Preemption plans: the fewest victims that make room for one request.

Among equally small plans the victims are taken borrowers first, then lowest priority, then
the youngest (the least work lost). Callers pass only the sandboxes the request may
preempt; this module decides which of them, and on which host.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

from scheduler.cluster import CPU_ONLY, GpuState, HostState, Place, Request, Running, Snapshot, book, release
from scheduler.placement import Policy

# Subsets tried per host before falling back to greedy-then-prune: hosts hold few victims
# of one sharing mode, so the exact search almost always finishes well inside this.
MAX_SUBSETS = 64

Allowed = Callable[[Sequence[Running]], bool]


@dataclass(frozen=True)
class Plan:
    victims: tuple[Running, ...]
    place: Place


Rank = tuple[bool, int, float, int]


def victim_order(victim: Running) -> Rank:
    """Borrowed first, then lowest priority, then most recently started, then id."""
    return (not victim.borrowed, victim.priority, -victim.started_at, victim.sandbox_id)


def plan_preemption(
    snapshot: Snapshot,
    request: Request,
    policy: Policy,
    candidates: Iterable[Running],
    allowed: Allowed = lambda _victims: True,
    gpus: dict[str, GpuState] | None = None,
) -> Plan | None:
    """The best plan over all hosts, or None when no set of candidates makes room.

    ``allowed`` vetoes victim sets (a guarantee reclaim may not take a project below its
    guarantee). ``gpus`` indexes the snapshot's GPUs by UUID when the caller has one. The
    snapshot is changed while a set is tried and restored before returning.
    """
    if gpus is None:
        gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    hosts = {h.name: h for h in snapshot.hosts if h.up}
    per_host: dict[str, list[Running]] = defaultdict(list)
    for victim in candidates:
        # A victim only helps if it frees a device of the kind the request asks for.
        # A CPU-only request is helped by any victim on its host: it frees CPU and memory.
        if victim.host in hosts and (
            request.mode == CPU_ONLY or any(_useful(gpus.get(g.gpu_uuid), request) for g in victim.grants)
        ):
            per_host[victim.host].append(victim)
    for victims in per_host.values():
        victims.sort(key=victim_order)
    best: Plan | None = None
    best_key: tuple[int, list[Rank], str] | None = None
    # Hosts whose own best victim comes first are tried first: once a one-victim plan is
    # found, no host whose best victim ranks after it can do better.
    for name in sorted(per_host, key=lambda h: (victim_order(per_host[h][0]), h)):
        if best_key is not None and best_key[0] == 1 and victim_order(per_host[name][0]) > best_key[1][0]:
            break
        beat = best_key[1] if best_key is not None else None
        plan = _fewest_on_host(hosts[name], per_host[name], request, policy, allowed, gpus, beat)
        if plan is None:
            continue
        key = (len(plan.victims), [victim_order(v) for v in plan.victims], name)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    return best


def _useful(gpu: GpuState | None, request: Request) -> bool:
    return gpu is not None and gpu.available and gpu.could_serve(request.mode)


def _fewest_on_host(
    host: HostState,
    victims: list[Running],
    request: Request,
    policy: Policy,
    allowed: Allowed,
    gpus: dict[str, GpuState],
    beat: list[Rank] | None,
) -> Plan | None:
    """This host's best plan, or None; with ``beat``, only a plan that ranks before it."""

    def fits(subset: Sequence[Running]) -> Place | None:
        grants = [g for v in subset for g in v.grants if g.gpu_uuid in gpus]
        here = [v for v in subset if v.host == host.name]
        for grant in grants:
            release(gpus[grant.gpu_uuid], grant)
        for victim in here:
            host.take(victim.cpu_milli, victim.memory_mib, -1)
        try:
            decision = policy.place(Snapshot(hosts=[host]), request)
        finally:
            for grant in grants:
                book(gpus[grant.gpu_uuid], grant)
            for victim in here:
                host.take(victim.cpu_milli, victim.memory_mib)
        return decision if isinstance(decision, Place) else None

    if fits(victims) is None:
        return None
    tried = 0
    most = len(victims) if beat is None else min(len(victims), len(beat))
    # Smallest sets first, and within a size in victim order: the first fit is the answer.
    # Subsets come in rank order, so past ``beat`` at its own size none can do better.
    for size in range(1, most + 1):
        for subset in combinations(victims, size):
            if beat is not None and size == len(beat) and [victim_order(v) for v in subset] >= beat:
                return None
            tried += 1
            if tried > MAX_SUBSETS:
                return _greedy(victims, allowed, fits)
            if allowed(subset) and (place := fits(subset)) is not None:
                return Plan(subset, place)
    return None


def _greedy(
    victims: list[Running], allowed: Allowed, fits: Callable[[Sequence[Running]], Place | None]
) -> Plan | None:
    """Take victims in order until the request fits, then drop any the fit does not need."""
    chosen: list[Running] = []
    for victim in victims:
        if not allowed([*chosen, victim]):
            continue
        chosen.append(victim)
        if fits(chosen) is not None:
            break
    else:
        return None
    for victim in reversed(chosen[:-1]):
        rest = [v for v in chosen if v is not victim]
        if allowed(rest) and fits(rest) is not None:
            chosen = rest
    place = fits(chosen)
    return Plan(tuple(chosen), place) if place is not None else None
