"""A multi-node request, placed all or nothing (issue 39): ``nodes`` hosts of one engine
cluster (a Slurm cluster runs the gang as one job across them), each with ``gpu_count`` idle
whole GPUs of one model (a job across nodes wants the same GPU on each) and room for the
tier's CPU and memory.

The hosts whose free whole GPUs are fewest but enough come first: a gang takes the remains
of partly used hosts before it breaks into an empty one, as the single-host policy keeps
whole GPUs and hosts free for the requests that need them. A gang is never placed by
preempting others, nor are devices reserved for it while it waits (docs/slurm.md).
"""

from __future__ import annotations

from collections import defaultdict

from scheduler.cluster import (
    DEDICATED,
    MILLI,
    DeviceGrant,
    GpuState,
    HostState,
    Pending,
    Place,
    Request,
    Snapshot,
)
from scheduler.topology import best_connected

Candidate = tuple[HostState, list[GpuState]]  # a host and its idle whole GPUs of the gang's model


def gang_candidates(snapshot: Snapshot, request: Request) -> dict[tuple[str, str], list[Candidate]]:
    """Hosts that could take one node of the gang, by (cluster, GPU model)."""
    found: dict[tuple[str, str], list[Candidate]] = defaultdict(list)
    for host in snapshot.hosts:
        if not host.up or not host.cluster or not host.has_room(request.cpu_milli, request.memory_mib):
            continue
        if request.isolation and host.isolation_levels and request.isolation not in host.isolation_levels:
            continue
        by_model: dict[str, list[GpuState]] = defaultdict(list)
        wanted = request.gpu_models
        for g in host.gpus:
            if g.available and g.idle and g.serves(DEDICATED) and (not wanted or g.model in wanted):
                by_model[g.model].append(g)
        for model, free in by_model.items():
            if len(free) >= request.gpu_count:
                found[(host.cluster, model)].append((host, free))
    return found


def place_gang(snapshot: Snapshot, request: Request) -> Place | Pending:
    """``request.nodes`` hosts of one cluster, ``request.gpu_count`` whole GPUs of one model
    on each; the first host is where the job's batch script runs (the sandbox's host)."""
    if request.mode != DEDICATED:
        return Pending(request.id, "a request across several nodes takes whole GPUs only")
    best: list[Candidate] = []
    for candidates in gang_candidates(snapshot, request).values():
        fitting = sorted(candidates, key=lambda c: (len(c[1]), c[0].name))[: request.nodes]
        if len(fitting) == request.nodes and (not best or _spare(fitting, request) < _spare(best, request)):
            best = fitting
    if not best:
        return Pending(
            request.id,
            f"needs {request.nodes} nodes of one cluster with {request.gpu_count} idle whole "
            f"GPU{'s' if request.gpu_count > 1 else ''} of one model each",
        )
    # On each node the best-connected of its idle GPUs, as for a request on one host.
    grants = tuple(
        DeviceGrant(g.uuid, g.uuid, "exclusive", MILLI)
        for host, free in best
        for g in best_connected(free, request.gpu_count, host.topology)
    )
    return Place(request.id, best[0][0].name, grants)


def _spare(candidates: list[Candidate], request: Request) -> int:
    """Whole GPUs the gang leaves idle on the hosts it takes: fewer is a tighter fit."""
    return sum(len(free) - request.gpu_count for _, free in candidates)
