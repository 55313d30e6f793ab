"""What would happen to a request if it were made now: the request form's live answer.

The answer comes from the scheduler itself, not from a guess. Nothing is written. It says
one of:

- **starts now** on a host (perhaps once some preemptible sandboxes stop);
- **waits**: its place among the requests that wait, the scheduler's reason, and an ETA —
  when running sandboxes reaching their maximum duration would make room for it, if
  nothing ahead took that room first (an earliest start, never a promise);
- **refused**: the rule it breaks (a quota, a tier limit), as the form would say on submit.

For a request that waits it also lists what could start now instead, in the same tier:
free MIG slices of other profiles, the largest MPS share free, free time-slice replicas,
or how many whole GPUs are free on one host.

It is answered from the state the last scheduling cycle left (``portal/scheduling/digest.py``):
the fleet after that cycle's placements, its waiting requests and the devices it reserved
for the queue head. The requests that waited then could not start on what is left, so the
new request needs one placement attempt there, not a whole cycle: its place in the fair
order among the waiting requests, then ``run_cycle`` over it alone, keeping off the head's
devices if the head ranks before it. Without a recent digest (the control worker is down)
it runs the whole cycle again from the database, the request included: the same answer,
slower.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from portal.durations import duration_text
from portal.quotas.models import QuotaPolicy
from portal.sandboxes.actions import (
    SandboxRequest,
    SandboxRequestError,
    check_request_sandbox,
    model_hours_refusal,
)
from portal.sandboxes.gpu_choice import model_refusal
from portal.scheduling import digest
from portal.scheduling.policy import new_policy, warm, workload_of
from portal.scheduling.snapshot import build_fairshare, build_queue, build_snapshot, scheduler_request
from scheduler.cluster import (
    DEDICATED,
    MIG,
    MPS,
    TIMESLICE,
    Decision,
    Pending,
    Place,
    Preempt,
    Request,
    Reserve,
    Snapshot,
)
from scheduler.cycle import revert, run_cycle
from scheduler.fairshare import FairOrder
from scheduler.gc_pause import collection_paused
from scheduler.placement import Policy
from scheduler.placement.firstfit import serves
from scheduler.topology import describe_set

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
    return _answer(scheduler_request(PREVIEW_ID, req, now), now)


def _answer(mine: Request, now: float) -> Preview:
    """The scheduler's answer for a request that passed the checks."""
    with collection_paused():
        state = digest.latest()
        if state is not None:
            answer = _from_last_cycle(state, mine, now)
            if answer is not None:
                return answer
        return _from_database(mine, now)


def _brief_answer(mine: Request, now: float) -> Preview | None:
    """Where it would start or its place in line, without the earliest start or what could
    start instead (each a further attempt): from the last cycle's state only, None without
    one (the whole cycle from the database, once per model, is seconds at the cluster's size)."""
    with collection_paused():
        state = digest.latest()
        return None if state is None else _from_last_cycle(state, mine, now, detail=False)


@dataclass
class ModelAnswer:
    """The live answer for one GPU model of the request's tier."""

    model: str
    preview: Preview
    picked: bool  # the model the request names ("any" picks none)


# Each model answered is one more placement attempt on the last cycle's state per form change
# (BENCHMARKS.md, "Scheduling cycle and preview in the portal"): a menu an admin shaped, and
# its first few models only.
MAX_MODEL_ANSWERS = 4


def preview_by_model(user: Any, req: SandboxRequest, now: float | None = None) -> list[ModelAnswer]:
    """The answer for each model on the request's tier's menu (``Tier.gpu_models``, its first
    ``MAX_MODEL_ANSWERS``), the request otherwise as written: "H100: starts now; A100: waits,
    3rd in line"; none for a tier whose admin listed no models (it offers every model of the
    fleet: the openb cluster's seven would be seven attempts a keystroke), for one of a
    single model, or for a request refused whatever the model. The checks that do not depend
    on the model run once; each model then costs its own checks and one placement attempt."""
    models = [str(m) for m in req.tier.gpu_models][:MAX_MODEL_ANSWERS]
    if len(models) < 2:
        return []
    now = time.time() if now is None else now
    try:
        check_request_sandbox(user, replace(req, gpu_model=""))
    except SandboxRequestError:
        return []
    quota = QuotaPolicy.objects.filter(project=req.project).first()  # once, not once a model
    answers = []
    with collection_paused():  # once for all of them: each pause's end may run a collection
        for model in models:
            answer = _model_answer(replace(req, gpu_model=model), quota, now)
            if answer is None:
                return []  # no recent cycle state: the request's own answer only
            answers.append(ModelAnswer(model, answer, model == req.gpu_model))
    return answers


def _model_answer(asked: SandboxRequest, quota: QuotaPolicy | None, now: float) -> Preview | None:
    """One model's answer: refused by its own checks (``quota``: its project's, if any), or a
    brief placement attempt."""
    refusal = model_refusal(asked.tier, asked.gpu_model, asked.mig_profile) or (
        model_hours_refusal(asked, quota) if quota is not None else None
    )
    if refusal:
        return Preview("refused", refusal)
    return _brief_answer(scheduler_request(PREVIEW_ID, asked, now), now)


def offer_other_models(answer: Preview, by_model: list[ModelAnswer]) -> Preview:
    """A request for one model that would wait or be refused (its project at that model's
    limit, the model all taken) is offered the models that would start now."""
    if answer.verdict not in ("waits", "refused"):
        return answer
    others = [
        f"on {a.model}: it {a.preview.message}"
        for a in by_model
        if a.preview.verdict == "now" and not a.picked
    ]
    return replace(answer, alternatives=[*others, *answer.alternatives][:4]) if others else answer


def _from_database(mine: Request, now: float) -> Preview:
    """The whole cycle over the queue read afresh, the request included, with a policy that
    learned from the recent requests as the control worker's did (warmed once per process:
    reading 20,000 requests on every form change while the control worker is down doubled
    this path's time)."""
    snapshot = build_snapshot()
    name = settings.SCHEDULER_POLICY
    with _mirrors_lock:
        policy = _fallbacks.get(name)
        if policy is None:
            policy = _fallbacks[name] = new_policy(name)
            model = workload_of(policy)
            if model is not None:
                warm(model)
        decisions = run_cycle(
            snapshot, [*build_queue(), mine], policy, now, fairshare=build_fairshare(now),
            backfill_window_s=settings.BACKFILL_WINDOW_S,
        )  # fmt: skip
        return _verdict(decisions, snapshot, mine, now, policy, waiting_ahead=0)


# The web server's copies of the control worker's policy, fed the typical requests it
# learned, and of the fleet of the state it last answered from (kept in step with each new
# state, host by host): kept between previews, so the policy's remembered scores serve the
# next one. Each preview gives back what it booked. One preview at a time uses them.
_mirrors: dict[str, Policy] = {}
_fallbacks: dict[str, Policy] = {}  # the database path's policies, warmed once
_fleet = digest.Mirror()
_mirrors_lock = threading.Lock()


def _from_last_cycle(state: digest.Digest, mine: Request, now: float, detail: bool = True) -> Preview | None:
    """One placement attempt on the state the last cycle left; None if its policy is unknown
    here or its rows unreadable."""
    with _mirrors_lock:
        policy = _mirrors.get(state.policy)
        if policy is None:
            try:
                policy = _mirrors[state.policy] = new_policy(state.policy)
            except ValueError:
                return None
        model = workload_of(policy)
        if model is not None:
            model.adopt(state.typical, state.multi_gpu_share, state.multi_gpu)
        snapshot = _fleet.follow(state)
        if snapshot is None:
            return None
        ahead, head = _place_in_queue(state, snapshot, mine, now)
        held = (head, state.reservation) if head is not None and state.reservation is not None else None
        try:
            decisions = run_cycle(
                snapshot, [mine], policy, now, fairshare=state.fairshare, in_place=True, held=held,
                backfill_window_s=settings.BACKFILL_WINDOW_S, explain=detail,
            )  # fmt: skip
            try:
                return _verdict(decisions, snapshot, mine, now, policy, waiting_ahead=ahead, detail=detail)
            finally:
                revert(snapshot, decisions, [mine])
        except Exception:
            _fleet.reset()  # an attempt that failed half-way may have left it changed
            raise


def _place_in_queue(
    state: digest.Digest, snapshot: Snapshot, mine: Request, now: float
) -> tuple[int, Request | None]:
    """How many of the waiting requests the fair order takes before ``mine``, and the queue
    head if it is one of them. None of them starts (they could not last cycle), so the
    projects' standings do not move as they are taken."""
    order = FairOrder([*state.pending, mine], state.fairshare, snapshot.running, now)
    head_id = state.reservation.request_id if state.reservation is not None else None
    ahead, head = 0, None
    while (request := order.next()) is not None and request.id != PREVIEW_ID:
        ahead += 1
        if request.id == head_id:
            head = request
        order.settle(request)
    return ahead, head


def _verdict(
    decisions: list[Decision],
    snapshot: Snapshot,
    mine: Request,
    now: float,
    policy: Policy,
    waiting_ahead: int,
    detail: bool = True,
) -> Preview:
    """Read the cycle's decisions for the preview's request; ``snapshot`` is the fleet before
    them (or after, if it waits: then nothing of it changed). Without ``detail`` a request
    that waits gets no earliest start and no alternatives."""
    victims, warning_s = 0, 0.0
    warnings = {r.sandbox_id: r.warning_s for r in snapshot.running}
    for decision in decisions:
        if isinstance(decision, Preempt):
            victims += 1
            warning_s = max(warning_s, warnings.get(decision.sandbox_id, 0.0))
            continue
        if getattr(decision, "request_id", None) != PREVIEW_ID:
            if isinstance(decision, Pending):
                waiting_ahead += 1
            if isinstance(decision, Place):
                victims, warning_s = 0, 0.0
            continue
        if isinstance(decision, Place):
            devices = [g.device_uuid for g in decision.grants]
            taken = gpus_taken(snapshot, decision)
            where = decision.host + (f" ({taken})" if taken else "")
            if victims:
                return Preview(
                    "now",
                    f"starts on {where} once {victims} preemptible sandbox(es) have stopped"
                    + (
                        f", within {duration_text(warning_s)} (their warning before the stop)"
                        if warning_s
                        else ""
                    ),
                    host=decision.host,
                    devices=devices,
                )
            return Preview("now", f"starts now on {where}", host=decision.host, devices=devices)
        if isinstance(decision, Pending):
            if not detail:  # unexplained unless a quota held it (that costs no search)
                return Preview("waits", decision.reason or "no room for it now", position=waiting_ahead + 1)
            instead = alternatives(snapshot, mine)  # before the ETA's own attempt, which may book it
            return Preview(
                "waits",
                decision.reason,
                position=waiting_ahead + 1,
                eta=_eta(snapshot, decisions, mine, now, policy),
                alternatives=instead,
            )
    return Preview("waits", "the scheduler gave no answer for it", position=waiting_ahead + 1)


def gpus_taken(snapshot: Snapshot, place: Place) -> str:
    """Which GPUs a multi-GPU placement takes and how they are linked ("GPUs 0-3, all linked
    by NVLink, on NUMA node 0", scheduler.topology); "" for one GPU, a host that reports no
    topology, or a job across several hosts."""
    host = next((h for h in snapshot.hosts if h.name == place.host), None)
    if host is None or len(place.grants) < 2:
        return ""
    index = {g.uuid: g.index for g in host.gpus}
    if any(g.gpu_uuid not in index for g in place.grants):
        return ""
    return describe_set(host.topology, [index[g.gpu_uuid] for g in place.grants])


def _eta(
    snapshot: Snapshot, decisions: list[Decision], mine: Request, now: float, policy: Policy
) -> datetime | None:
    """When it could start at the earliest: the head's reservation if it is the head, else a
    reservation for it alone (the room running sandboxes leave when they reach their end)."""
    for decision in decisions:
        if isinstance(decision, Reserve) and decision.request_id == PREVIEW_ID:
            return datetime.fromtimestamp(decision.at, tz=UTC)
    # An estimate, not a reservation: however far off (the backfill window bounds only those).
    alone = run_cycle(snapshot, [mine], policy, now, in_place=True, backfill_window_s=math.inf)
    revert(snapshot, alone, [mine])
    for decision in alone:
        if isinstance(decision, Reserve):
            return datetime.fromtimestamp(max(decision.at, now), tz=UTC)
    return None


def alternatives(snapshot: Snapshot, mine: Request) -> list[str]:
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
        # A GPU held to one size (MPS_ONE_SIZE_PER_GPU) that holds shares takes only more of
        # their size; any other takes what its memory and threads have left.
        best = max(
            (
                (gpu.memory_mib - gpu.mps_used_mib, 100 - gpu.mps_used_threads, host)
                for host, gpu in gpus
                if not (gpu.mps_one_size and gpu.mps_share)
            ),
            default=None,
        )
        if best is not None and best[0] > 0 and best[1] > 0:
            memory_gib, threads, host = best[0] // 1024, best[1], best[2]
            found = [
                f"an MPS share of up to {memory_gib} GiB and {threads}% of the threads is free now on {host}"
            ]
        sizes: dict[tuple[int, int], str] = {}
        for host, gpu in gpus:
            size = gpu.mps_share
            if (
                gpu.mps_one_size
                and size
                and gpu.mps_used_mib + size[0] <= gpu.memory_mib
                and gpu.mps_used_threads + size[1] <= 100
            ):
                sizes.setdefault(size, host)
        found += [
            f"an MPS share of {mib / 1024:g} GiB and {pct}% of the threads (the size its GPU serves) "
            f"is free now on {host}"
            for (mib, pct), host in sorted(sizes.items(), reverse=True)[:3]
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
