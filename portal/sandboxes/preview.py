"""What would happen to a request if it were made now: the request form's live answer.

The answer comes from the scheduler itself, not from a guess: the current snapshot, the
real queue and fair-share state, plus the request being written, through one
``run_cycle``. Nothing is written. It says one of:

- **starts now** on a host (perhaps once some preemptible sandboxes stop);
- **waits**: its place among the requests that wait, the scheduler's reason, and an ETA —
  when running sandboxes reaching their maximum duration would make room for it, if
  nothing ahead took that room first (an earliest start, never a promise);
- **refused**: the rule it breaks (a quota, a tier limit), as the form would say on submit.

For a request that waits it also lists what could start now instead, in the same tier:
free MIG slices of other profiles, the largest MPS share free, free time-slice replicas,
or how many whole GPUs are free on one host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from portal.sandboxes.actions import SandboxRequest, SandboxRequestError, check_request_sandbox
from portal.sandboxes.scheduling import build_fairshare, build_queue, build_snapshot, scheduler_request
from scheduler.cluster import DEDICATED, MIG, MPS, TIMESLICE, Pending, Place, Preempt, Reserve, Snapshot
from scheduler.cycle import run_cycle
from scheduler.placement import get_policy
from scheduler.placement.firstfit import serves

PREVIEW_ID = -1  # no sandbox has it: the request being written


@dataclass
class Preview:
    verdict: str  # "now" | "waits" | "refused" | "incomplete" (the form is not filled in yet)
    message: str
    host: str = ""
    position: int = 0  # 1 = first of the requests that wait
    eta: datetime | None = None
    alternatives: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)


def preview_request(user: Any, req: SandboxRequest, now: float | None = None) -> Preview:
    now = time.time() if now is None else now
    try:
        check_request_sandbox(user, req)
    except SandboxRequestError as exc:
        return Preview("refused", exc.message)
    snapshot = build_snapshot()
    queue = build_queue()
    mine = scheduler_request(PREVIEW_ID, req, now)
    decisions = run_cycle(
        snapshot,
        [*queue, mine],
        get_policy(settings.SCHEDULER_POLICY),
        now,
        fairshare=build_fairshare(now),
    )
    waiting_ahead = 0
    victims = 0
    for decision in decisions:
        if isinstance(decision, Preempt):
            victims += 1
            continue
        if getattr(decision, "request_id", None) != PREVIEW_ID:
            if isinstance(decision, Pending):
                waiting_ahead += 1
            if isinstance(decision, Place):
                victims = 0
            continue
        if isinstance(decision, Place):
            devices = [g.device_uuid for g in decision.grants]
            if victims:
                return Preview(
                    "now",
                    f"starts on {decision.host} once {victims} preemptible sandbox(es) have stopped",
                    host=decision.host,
                    devices=devices,
                )
            return Preview("now", f"starts now on {decision.host}", host=decision.host, devices=devices)
        if isinstance(decision, Pending):
            eta = _eta(snapshot, decisions, mine, now)
            return Preview(
                "waits",
                decision.reason,
                position=waiting_ahead + 1,
                eta=eta,
                alternatives=alternatives(snapshot, mine),
            )
    return Preview("waits", "the scheduler gave no answer for it", position=waiting_ahead + 1)


def _eta(snapshot: Snapshot, decisions: list[Any], mine: Any, now: float) -> datetime | None:
    """When it could start at the earliest: the head's reservation if it is the head, else a
    reservation for it alone (the room running sandboxes leave when they reach their end)."""
    for decision in decisions:
        if isinstance(decision, Reserve) and decision.request_id == PREVIEW_ID:
            return datetime.fromtimestamp(decision.at, tz=UTC)
    alone = run_cycle(snapshot, [mine], get_policy(settings.SCHEDULER_POLICY), now)
    for decision in alone:
        if isinstance(decision, Reserve):
            return datetime.fromtimestamp(max(decision.at, now), tz=UTC)
    return None


def alternatives(snapshot: Snapshot, mine: Any) -> list[str]:
    """What could start now in the same sharing mode, on hosts of the right isolation level:
    on GPUs pinned to it, and on GPUs following demand that are idle or already serve it."""
    gpus = [
        (host.name, gpu)
        for host in snapshot.hosts
        if serves(host, mine)
        for gpu in host.gpus
        if gpu.available and gpu.serves(mine.mode)
    ]
    found: list[str] = []
    if mine.mode == MIG:
        free: dict[str, str] = {}
        for host, gpu in gpus:
            for slot in gpu.mig:
                if not slot.busy and slot.profile != mine.mig_profile:
                    free.setdefault(slot.profile, host)
        found = [
            f"a {profile} slice is free now on {host}"
            for profile, host in sorted(free.items(), key=lambda item: -int(item[0].split("g")[0]))
        ]
    elif mine.mode == MPS:
        best = max(
            ((gpu.memory_mib - gpu.mps_used_mib, 100 - gpu.mps_used_threads, host) for host, gpu in gpus),
            default=None,
        )
        if best is not None and best[0] > 0 and best[1] > 0:
            memory_gib, threads, host = best[0] // 1024, best[1], best[2]
            found = [
                f"an MPS share of up to {memory_gib} GiB and {threads}% of the threads is free now on {host}"
            ]
    elif mine.mode == TIMESLICE:
        replicas = sum(gpu.replicas - len(gpu.replicas_used) for _, gpu in gpus)
        if replicas:
            found = [f"{replicas} time-slice replica(s) are free now"]
    elif mine.mode == DEDICATED:
        idle: dict[str, int] = {}
        for host, gpu in gpus:
            if gpu.idle:
                idle[host] = idle.get(host, 0) + 1
        if idle:
            host, count = max(idle.items(), key=lambda item: (item[1], item[0]))
            if count < mine.gpu_count:
                found = [f"{count} whole GPU(s) are free now on {host}"]
    return found[:4]
