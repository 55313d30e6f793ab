"""The placement policy the control worker keeps between cycles, and what it learns from.

A policy built afresh each cycle would forget, every 2 seconds, both its memoised scores
and what its ``WorkloadModel`` learned: the portal's gpushare policy always assumed one
whole GPU was the typical request. Kept here instead, one per process (rebuilt when
``SCHEDULER_POLICY`` changes), its model learns the typical requests online from the
portal's own recent requests: on first use from the latest ``DEFAULT_WINDOW`` sandboxes in
the database, then from each cycle's queue (``observe`` ignores an id it has seen, so a
request waiting through many cycles counts once).

It also keeps the fleet it places on (``kept_fleet``, through ``kept_snapshot``): each cycle
reads the fleet afresh from the database, but hands the policy the same ``Snapshot`` as
before with only the hosts that differ reported changed, so the scores it remembered for every other host
carry over from one cycle to the next, and a cycle's cost follows what changed rather
than pending requests x GPUs.

Two control workers each keep their own: correctness never depends on it (the cycle's
lock and ``do_place``'s checks do, and the fleet is read from the database each cycle),
only how well requests are packed. Every use of what is kept here holds ``lock``: the
embedded deployment runs cycles from a thread pool.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from portal.sandboxes.models import Sandbox
from portal.scheduling import kept_snapshot
from scheduler.cluster import DEDICATED, MPS, Request, Snapshot
from scheduler.placement import Policy, get_policy
from scheduler.placement.gpushare import GpusharePolicy
from scheduler.placement.workload import DEFAULT_WINDOW, WorkloadModel, observed_shape

lock = threading.Lock()
_kept: tuple[str, Policy] | None = None
_fleet: Snapshot | None = None


def workload_of(policy: Policy) -> WorkloadModel | None:
    """The policy's model of the typical requests, if it keeps one."""
    return policy.workload if isinstance(policy, GpusharePolicy) else None


def new_policy(name: str) -> Policy:
    """A policy by name whose workload model, if any, forgets all but the latest
    ``DEFAULT_WINDOW`` requests: the mix of a lab changes."""
    policy = get_policy(name)
    model = workload_of(policy)
    if model is not None:
        model.window = DEFAULT_WINDOW
    return policy


def kept_policy(name: str) -> Policy:
    """The policy this process keeps for ``name``, built and warmed on first use. Hold ``lock``."""
    global _kept
    if _kept is None or _kept[0] != name:
        policy = new_policy(name)
        model = workload_of(policy)
        if model is not None:
            warm(model)
        _kept = (name, policy)
    return _kept[1]


def forget() -> None:
    """Drop the kept policy and fleet (a cold start, as a control worker that just began)."""
    global _kept, _fleet
    with lock:
        _kept = _fleet = None


def kept_fleet(fresh: Snapshot) -> Snapshot:
    """The snapshot to decide on, given the one just read. Hold ``lock``.

    The kept one, brought up to date host by host (``kept_snapshot.follow``) while the
    fleet's layout stays the same; else ``fresh`` itself, kept from now on. Either way the
    state is exactly what was read.
    """
    global _fleet
    kept = kept_snapshot.follow(
        _fleet,
        _fleet.hosts if _fleet is not None else [],
        fresh.hosts,
        layout=kept_snapshot.host_layout,
        host=lambda state: state,
        rebuild=lambda: fresh,
    )
    kept.running = fresh.running
    _fleet = kept
    return kept


def learn(policy: Policy, requests: Iterable[Request]) -> None:
    """Show requests to the policy's workload model (a no-op for a policy without one)."""
    model = workload_of(policy)
    if model is None:
        return
    for request in requests:
        shape = observed_shape(request)
        if shape is not None:
            model.observe(request.id, shape)


def warm(model: WorkloadModel) -> None:
    """Teach a new model the latest requests in the database, oldest first, as they came."""
    limit = model.window or DEFAULT_WINDOW
    rows = Sandbox.objects.order_by("-requested_at", "-pk").values_list(
        "pk", "tier__sharing_mode", "gpu_count", "mps_thread_pct", "tier__cpu_limit"
    )[:limit]
    for pk, mode, gpu_count, threads, cpu_cores in reversed(list(rows)):
        # What ``observed_shape`` reads, as ``scheduler_request`` fills it; the rest is a placeholder.
        request = Request(
            id=pk,
            project="",
            priority=0,
            submitted_at=0.0,
            mode=mode,
            gpu_count=gpu_count if mode == DEDICATED else 1,
            mps_thread_pct=threads if mode == MPS else 0,
            cpu_milli=round(cpu_cores * 1000),
        )
        shape = observed_shape(request)
        if shape is not None:
            model.observe(pk, shape)
