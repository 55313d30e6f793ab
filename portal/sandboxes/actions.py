"""Every sandbox state change, as ``check_*`` (validate) / ``do_*`` (write) pairs.

Views, API viewsets, Celery tasks and admin actions call these; nothing else writes a
sandbox's state. Each ``do_*`` runs in one transaction, locks the sandbox row
(``select_for_update``), writes a ``SandboxEvent`` per transition and is idempotent: a
repeated call (a broker message delivered twice) finds the work done and returns.
Messages to workers are sent only after commit.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, Q
from django.utils import timezone

from portal.accounts.models import Membership, Project
from portal.audit import trail
from portal.billing import ledger
from portal.catalog.models import SandboxImage, SharingMode, Tier
from portal.catalog.storage import storage_refusal
from portal.durations import duration_text
from portal.fleet.models import Gpu, GpuMode, Host, MigInstance
from portal.fleet.modes import KIND_MODE
from portal.quotas.models import QuotaPolicy
from portal.quotas.usage import gpu_hours_since, model_hours_used_up, month_start
from portal.sandboxes import live, notify, nudge, resume
from portal.sandboxes.gpu_choice import model_refusal, profile_refusal
from portal.sandboxes.granted import follow_granted_devices
from portal.sandboxes.member_limit import member_limit_refusal
from portal.sandboxes.models import (
    LIVE_STATES,
    MAX_NODES,
    PENDING_REASON_MAX,
    Allocation,
    Attempt,
    Notification,
    Sandbox,
    SandboxEvent,
    SandboxState,
    StopCause,
)
from portal.sandboxes.specs import launch_spec
from portal.sandboxes.transitions import (
    LAUNCH_RELATED,
    TRANSITIONS,
    end,
    end_stopping,
    locked,
    locked_by_key,
    locking,
    release,
    requeue,
    send_stop_after_commit,
    transition,
)
from scheduler.cluster import DeviceGrant
from scheduler.gpus import MODELS
from wire.messages import to_host

log = logging.getLogger(__name__)
S = SandboxState

LAUNCH_RESENT = "launch sent again: no sandbox on the host yet"


class SandboxRequestError(Exception):
    """A request that cannot be accepted; ``field`` names the input at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SandboxRequest:
    project: Project
    tier: Tier
    image: SandboxImage
    isolation: str
    gpu_count: int = 1
    nodes: int = 1  # dedicated tiers: hosts of one Slurm cluster, gpu_count GPUs on each
    mig_profile: str = ""
    gpu_model: str = ""  # one its tier offers (portal.sandboxes.gpu_choice); "": any of them
    mps_memory_mib: int = 0
    mps_thread_pct: int = 0
    duration: timedelta | None = None
    name: str = ""
    command: tuple[str, ...] = ()  # a batch run's command; () for an interactive sandbox


# --- request -------------------------------------------------------------------------------


def check_request_sandbox(user: Any, req: SandboxRequest, *, quota: bool = True) -> None:
    """Permission, tier rules and (``quota``) the quota; raises SandboxRequestError naming the
    field. A caller about to ``do_request_sandbox`` passes ``quota=False``: that checks the
    quota under the project's lock, and a check here would sum the month's usage twice."""
    if (
        not user.is_staff
        and not Membership.objects.filter(user=user, project=req.project)
        .exclude(role=Membership.Role.BILLING)
        .exists()
    ):
        raise SandboxRequestError("project", "You are not a member of this project.")
    tier = req.tier
    if not tier.active:
        raise SandboxRequestError("tier", f"The tier {tier.name} is closed to new sandboxes.")
    if not req.image.active:
        raise SandboxRequestError("image", f"The image {req.image.name} is not allowed.")
    if req.isolation not in tier.isolation_levels:
        allowed = ", ".join(tier.isolation_levels) or "none"
        raise SandboxRequestError("isolation", f"The tier {tier.name} allows isolation: {allowed}.")
    mode = tier.sharing_mode
    if mode == SharingMode.DEDICATED and not 1 <= req.gpu_count <= tier.max_gpus:
        raise SandboxRequestError("gpu_count", f"The tier {tier.name} allows 1 to {tier.max_gpus} GPUs.")
    if req.nodes != 1:
        if mode != SharingMode.DEDICATED:
            raise SandboxRequestError("nodes", "Only a whole-GPU tier runs a sandbox across several nodes.")
        if not 1 <= req.nodes <= MAX_NODES or req.nodes * req.gpu_count > tier.max_gpus:
            raise SandboxRequestError(
                "nodes",
                f"The tier {tier.name} allows {tier.max_gpus} GPUs in all, over at most {MAX_NODES} nodes.",
            )
    if mode == SharingMode.MIG:
        known = {p.name for m in MODELS.values() for p in m.mig_profiles}
        if req.mig_profile not in known:
            raise SandboxRequestError("mig_profile", f"Unknown MIG profile {req.mig_profile!r}.")
        if (refusal := profile_refusal(tier, req.mig_profile)) is not None:
            raise SandboxRequestError("mig_profile", refusal)
    if req.gpu_model and (refusal := model_refusal(tier, req.gpu_model, req.mig_profile)) is not None:
        raise SandboxRequestError("gpu_model", refusal)
    if mode == SharingMode.MPS:
        if not 1 <= req.mps_thread_pct <= 100:
            raise SandboxRequestError("mps_thread_pct", "The thread share must be 1 to 100 %.")
        if not 256 <= req.mps_memory_mib <= 81920:
            raise SandboxRequestError("mps_memory_mib", "The memory share must be 256 to 81920 MiB.")
    if len(" ".join(req.command)) > 2000:
        raise SandboxRequestError("command", "The command is too long (2,000 characters at most).")
    duration = req.duration or tier.max_duration
    if duration <= timedelta(0) or duration > tier.max_duration:
        raise SandboxRequestError(
            "duration", f"The tier {tier.name} allows up to {tier.max_duration} per sandbox."
        )
    if (refusal := storage_refusal(tier, user, req.project)) is not None:
        raise SandboxRequestError("tier", refusal)
    if quota:
        check_quota(user, req)


def check_quota(user: Any, req: SandboxRequest) -> tuple[QuotaPolicy | None, int]:
    """The project's GPU-hour budget (a CPU-only sandbox, which uses none, is not held to it),
    its live-sandbox limit and the member's own GPU limit. ``do_request_sandbox`` runs it
    again under a lock on the project row: two requests checked at the same moment would
    otherwise both see room for one more. Returns the quota and the project's live sandboxes
    (0 when there is no quota), which the request's notice reads rather than reading them."""
    if (refusal := member_limit_refusal(user, req)) is not None:
        raise SandboxRequestError("project", refusal)
    quota = QuotaPolicy.objects.filter(project=req.project).first()
    if quota is not None and quota.max_gpu_hours_month is not None and not req.tier.cpu_only:
        now = timezone.now()
        used = gpu_hours_since(req.project.pk, month_start(now), now)
        if used >= quota.max_gpu_hours_month:
            raise SandboxRequestError(
                "project",
                f"Project {req.project.name} has used {used:.1f} of its {quota.max_gpu_hours_month} "
                "GPU-hours this month.",
            )
    if quota is None:
        return None, 0
    if (refusal := model_hours_refusal(req, quota)) is not None:
        raise SandboxRequestError("gpu_model", refusal)
    live = Sandbox.objects.filter(project=req.project, state__in=LIVE_STATES).count()
    if live >= quota.max_live_sandboxes:
        raise SandboxRequestError(
            "project",
            f"Project {req.project.name} has reached its quota of {quota.max_live_sandboxes} live sandboxes.",
        )
    return quota, live


def model_hours_refusal(req: SandboxRequest, quota: QuotaPolicy | None = None) -> str | None:
    """Why the model ``req`` names has no GPU-hours left this month for its project (one of
    its limits per model), or None. A request for any model is kept off a used-up one by the
    scheduler instead (scheduler/model_quotas.py). ``quota``: the project's, if read."""
    if not req.gpu_model or req.tier.cpu_only:
        return None
    quota = quota or QuotaPolicy.objects.filter(project=req.project).first()
    if quota is None:
        return None
    for row in quota.model_quotas.filter(max_gpu_hours_month__isnull=False):
        if req.gpu_model in row.covered and (
            used_up := model_hours_used_up(row, timezone.now(), f"project {req.project.name}")
        ):
            return f"{used_up[0].upper()}{used_up[1:]}."
    return None


def do_request_sandbox(user: Any, req: SandboxRequest) -> Sandbox:
    """Create the sandbox and queue it; the scheduling cycle is nudged after commit.

    Requests of one project are serialised on its row while the quota is checked again, so
    concurrent requests cannot together overshoot it (the preview's check_request_sandbox
    gives the early, unlocked answer)."""
    with transaction.atomic():
        Project.objects.select_for_update().filter(pk=req.project.pk).exists()
        quota, live = check_quota(user, req)
        sandbox = Sandbox.objects.create(
            project=req.project,
            owner=user,
            tier=req.tier,
            image=req.image,
            isolation=req.isolation,
            name=req.name,
            gpu_count=req.gpu_count if req.tier.sharing_mode == SharingMode.DEDICATED else 1,
            nodes=req.nodes if req.tier.sharing_mode == SharingMode.DEDICATED else 1,
            mig_profile=req.mig_profile if req.tier.sharing_mode == SharingMode.MIG else "",
            gpu_model="" if req.tier.cpu_only else req.gpu_model,
            mps_memory_mib=req.mps_memory_mib if req.tier.sharing_mode == SharingMode.MPS else 0,
            mps_thread_pct=req.mps_thread_pct if req.tier.sharing_mode == SharingMode.MPS else 0,
            max_duration=req.duration or req.tier.max_duration,
            batch=bool(req.command),
            command=list(req.command),
        )
        SandboxEvent.objects.create(
            sandbox=sandbox,
            to_state=S.REQUESTED,
            actor=user,
            message=f"requested {sandbox.request_summary} on {req.tier.name}",
        )
        transition(sandbox, S.QUEUED, actor=user, message="waiting for the scheduler")
        notify.on_request(sandbox, quota, live + 1)  # this one is live too
        nudge.ask_for_cycle()
    return sandbox


# --- placement (control worker) -----------------------------------------------------------


def do_place(
    sandbox_id: int,
    host_name: str,
    grants: tuple[DeviceGrant, ...],
    borrowed: bool = False,
    launch: bool = True,
) -> bool:
    """Book the devices for a queued sandbox and hand it to its host's agent after commit;
    with ``launch=False`` the caller sends the launch itself (the cycle: all of its
    placements in one ``do_send_launches``, not one transaction each).

    Runs inside the scheduling cycle's lock, yet checks again under row locks, so a stale
    or repeated decision cannot book twice: the sandbox must still be queued (its row is
    locked), and the devices still free and in service (``_book`` locks their GPUs). The
    database constraints are the last guard. Refused, nothing is written and it stays queued.
    """
    try:
        with transaction.atomic():
            sandbox = locked(sandbox_id)
            if sandbox is None or sandbox.state != S.QUEUED:
                return False
            sandbox.borrowed = borrowed
            _book(sandbox, host_name, grants, "placed", in_service=True, also=("borrowed",), launch=launch)
    except IntegrityError as exc:
        log.warning("placement of sandbox %s on %s refused: %s", sandbox_id, host_name, exc)
        return False
    return True


class SlotTaken(IntegrityError):
    """A device a booking wants is gone, out of service or held. An IntegrityError, so every
    caller handles it as it handles the constraints' own refusals."""


def _book(
    sandbox: Sandbox,
    host_name: str,
    grants: tuple[DeviceGrant, ...],
    verb: str,
    in_service: bool = False,
    also: tuple[str, ...] = (),
    launch: bool = True,
) -> None:
    """Give a locked sandbox a new allocation key and these devices, move it to placing and
    (``launch``) send its launch after commit. An IntegrityError (a device taken meanwhile)
    rolls back. ``also``: fields the caller set on the sandbox, saved with the move."""
    host = Host.objects.filter(name=host_name).first()
    if host is None:
        raise SlotTaken(f"host {host_name} is gone")
    if in_service and host.state != Host.State.UP:  # lost or draining since the snapshot
        raise SlotTaken(f"host {host_name} is {host.state}")
    allocations = _claim_devices(sandbox, host, grants, in_service)
    sandbox.host = host
    sandbox.allocation_key = uuid.uuid4().hex
    if allocations:
        Allocation.objects.bulk_create(allocations)
    counted = resume.begin_attempt(sandbox, host.name, verb)
    devices = ", ".join(g.device_uuid for g in grants) or "CPU only, no GPU"
    transition(
        sandbox,
        S.PLACING,
        message=f"{verb} on {host.name}: {devices}",
        data={"host": host.name, "devices": [g.device_uuid for g in grants]},
        also=("host", "allocation_key", *counted, *also),
    )
    if launch:
        sandbox_id = sandbox.pk
        transaction.on_commit(lambda: do_send_launch(sandbox_id))


def _claim_devices(
    sandbox: Sandbox, host: Host, grants: tuple[DeviceGrant, ...], in_service: bool
) -> list[Allocation]:
    """The allocations for ``grants``, checked against what is live on their GPUs now.

    The GPU rows are locked first (in id order, so two bookers cannot deadlock): a booking
    outside the cycle (a plan's relaunch) or a drain waits for ours, and we for theirs, so
    the live allocations read below stay true until commit. This catches what the unique
    constraints cannot: a whole GPU booked beside shares of it, MPS shares past the GPU's
    memory or threads, a MIG instance destroyed meanwhile, and (``in_service``, for the
    cycle's placements) a GPU drained or lost since the snapshot.
    """
    gpu_rows = Gpu.objects.select_for_update(no_key=True).filter(uuid__in=[g.gpu_uuid for g in grants])
    gpus = {g.uuid: g for g in gpu_rows.order_by("pk")}
    migs = {
        m.uuid: m for m in MigInstance.objects.filter(uuid__in=[g.mig_uuid for g in grants if g.mig_uuid])
    }
    held: dict[int, list[Allocation]] = defaultdict(list)
    for alloc in Allocation.objects.filter(gpu__in=list(gpus.values()), active=True):
        held[alloc.gpu_id].append(alloc)
    # A gang (a multi-node sandbox) holds GPUs of other hosts too: of the same engine's.
    hosts = {host.pk} | (
        set(Host.objects.filter(driver=host.driver, state=Host.State.UP).values_list("pk", flat=True))
        if sandbox.nodes > 1
        else set()
    )
    allocations = []
    for g in grants:
        gpu = gpus.get(g.gpu_uuid)
        if gpu is None or gpu.host_id not in hosts:
            raise SlotTaken(f"GPU {g.gpu_uuid} is not on {host.name}")
        if in_service and gpu.state != Gpu.State.AVAILABLE:
            raise SlotTaken(f"GPU {gpu.uuid} is {gpu.state}")
        mig = migs.get(g.mig_uuid) if g.mig_uuid else None
        if g.mig_uuid and (mig is None or mig.gpu_id != gpu.pk):
            raise SlotTaken(f"MIG instance {g.mig_uuid} is gone")
        alloc = Allocation(
            sandbox=sandbox, gpu=gpu, mig_instance=mig, kind=g.kind, device_uuid=g.device_uuid,
            milli_gpu=g.milli_gpu, mps_memory_mib=g.mps_memory_mib, mps_thread_pct=g.mps_thread_pct,
            replica=g.replica,
        )  # fmt: skip
        _check_fits(gpu, held[gpu.pk], alloc)
        held[gpu.pk].append(alloc)  # a later grant of this booking must fit beside it
        allocations.append(alloc)
    return allocations


def _check_fits(gpu: Gpu, live: list[Allocation], alloc: Allocation) -> None:
    """Raise SlotTaken unless ``alloc`` fits beside the allocations live on ``gpu``.

    A GPU serves one mode at a time: the one it is pinned to (or MIG), or, following
    demand, that of what it holds already. The scheduler keeps to this; a decision made
    before a pin, or beside a booking made since its snapshot, is caught here.
    """
    wants = KIND_MODE[alloc.kind]
    if gpu.sharing_mode == GpuMode.AUTO and wants == GpuMode.MIG:
        raise SlotTaken(f"GPU {gpu.uuid} is not in MIG mode")
    if gpu.sharing_mode not in (GpuMode.AUTO, wants):
        raise SlotTaken(f"GPU {gpu.uuid} is {gpu.get_sharing_mode_display().lower()}, not {wants}")
    if any(a.kind != alloc.kind for a in live):
        raise SlotTaken(f"GPU {gpu.uuid} serves {KIND_MODE[live[0].kind]} sandboxes now, not {wants}")
    if live and alloc.kind == Allocation.Kind.EXCLUSIVE:
        raise SlotTaken(f"GPU {gpu.uuid} is already held")
    # MPS capacity is a sum over rows, which no constraint can hold: checked here, under
    # the GPU's row lock, on every GPU that serves MPS (pinned, or following demand).
    if alloc.kind == Allocation.Kind.MPS:
        shares = [a for a in live if a.kind == Allocation.Kind.MPS] + [alloc]
        if (
            sum(a.mps_memory_mib for a in shares) > gpu.memory_mib
            or sum(a.mps_thread_pct for a in shares) > 100
        ):
            raise SlotTaken(f"GPU {gpu.uuid} has no room for another MPS share")
        # One size per MPS GPU, where the operator chose it (GpuState.mps_one_size says why).
        if settings.MPS_ONE_SIZE_PER_GPU and (
            shares[0].mps_memory_mib != alloc.mps_memory_mib
            or shares[0].mps_thread_pct != alloc.mps_thread_pct
        ):
            raise SlotTaken(f"GPU {gpu.uuid} serves MPS shares of another size")


def do_send_launch(sandbox_id: int) -> None:
    """Hand a placed sandbox to its agent (see ``do_send_launches``)."""
    do_send_launches([sandbox_id])


def do_send_launches(sandbox_ids: list[int]) -> None:
    """Hand placed sandboxes to their agents, in one transaction. Each message is sent inside
    it: if the broker refuses one, nothing is written and they stay ``placing`` for the
    control tick to resend (a duplicate launch is harmless: launch is idempotent)."""
    with transaction.atomic():
        for sandbox in locking().filter(pk__in=sandbox_ids).order_by("pk"):
            if sandbox.state != S.PLACING or sandbox.host is None:
                continue  # launched already, stopped meanwhile, or its booking rolled back
            spec = launch_spec(sandbox)
            transition(sandbox, S.STARTING, message=f"launch sent to {sandbox.host.name}")
            to_host(sandbox.host.name).launch_sandbox(spec.to_json())


def do_resend_launch(sandbox_id: int, adopt: bool = False) -> None:
    """Send a starting sandbox's launch again (the first was lost with its agent), or with
    ``adopt`` a running one's, so a restarted agent tracks it again. Launch is idempotent:
    the agent finds the sandbox its driver already made."""
    with transaction.atomic():
        sandbox = locked(sandbox_id, LAUNCH_RELATED)
        wanted = S.RUNNING if adopt else S.STARTING
        if sandbox is None or sandbox.state != wanted or sandbox.host is None:
            return
        if not adopt:
            # Recorded (same state on both sides), so the next resend waits its turn: a
            # slow launch (a VM's domain definition) must not be flooded with copies.
            SandboxEvent.objects.create(
                sandbox=sandbox, at=timezone.now(), from_state=S.STARTING, to_state=S.STARTING,
                message=LAUNCH_RESENT,
            )  # fmt: skip
            live.sandbox_changed(sandbox.pk, sandbox.state)
        host_name, spec = sandbox.host.name, launch_spec(sandbox).to_json()
        transaction.on_commit(lambda: to_host(host_name).launch_sandbox(spec))


def do_set_pending_reasons(reasons: dict[int, str]) -> None:
    """Record why queued sandboxes wait (sandbox id -> reason), as the scheduling cycle
    decided; owners hear the first reason (later ones only refine it: a new reservation
    time, a changed position). Sandboxes no longer queued are left alone.

    The cycle passes only reasons that differ from the stored ones, so a cycle that changes
    nothing writes nothing; and a thousand requests arriving at once cost one UPDATE per
    distinct reason and one INSERT of notifications, not three statements each.
    """
    if not reasons:
        return
    reasons = {pk: reason[:PENDING_REASON_MAX] for pk, reason in reasons.items()}
    with transaction.atomic():
        # Locked, so none leaves the queue between being found waiting first and being told.
        first = dict(
            Sandbox.objects.select_for_update()
            .filter(pk__in=list(reasons), state=S.QUEUED, pending_reason="")
            .values_list("pk", "owner_id")
        )
        by_reason: dict[str, list[int]] = defaultdict(list)
        for pk, reason in reasons.items():
            by_reason[reason].append(pk)
        for reason, pks in by_reason.items():
            Sandbox.objects.filter(pk__in=pks, state=S.QUEUED).exclude(pending_reason=reason).update(
                pending_reason=reason
            )
        notify.on_first_waits([(pk, owner, reasons[pk]) for pk, owner in first.items()])


# --- reports from agents --------------------------------------------------------------------


def do_mark_running(allocation_key: str, handle: dict[str, Any], started_at: datetime) -> None:
    with transaction.atomic():
        sandbox = locked_by_key(allocation_key)
        if sandbox is None or sandbox.state != S.STARTING:
            return  # a duplicate report, or the sandbox was stopped meanwhile
        sandbox.handle = handle
        sandbox.started_at = started_at
        # Where the engine chose the GPUs itself (Slurm), the allocations follow its choice.
        moved = follow_granted_devices(sandbox, handle.get("devices") or ())
        # The driver only: the handle's ref is the host's pid for the process driver (a
        # container or VM id for the others), host detail the tenant reading the timeline
        # has no use for. Staff find the whole handle on the sandbox in the admin.
        said = f"running ({handle.get('driver')})" + (f"; {moved}" if moved else "")
        # A new placement (a move, a requeue) starts within its GPU memory share until its
        # agent says otherwise.
        sandbox.over_share_since = None
        transition(sandbox, S.RUNNING, message=said, also=("handle", "started_at", "over_share_since"))
        ledger.open_interval(sandbox, started_at)


def do_mark_stopped(allocation_key: str, ended_at: datetime, message: str = "stopped") -> None:
    with transaction.atomic():
        sandbox = locked_by_key(allocation_key)
        if sandbox is None or sandbox.state not in (S.STOPPING, S.RUNNING, S.STARTING):
            return
        if sandbox.state != S.STOPPING:
            # A warned victim that ends at its warning (SIGTERM) still ends preempted.
            warned = sandbox.preempt_at is not None and sandbox.stop_cause == StopCause.PREEMPTED
            if not warned:
                sandbox.stop_cause = StopCause.EXITED
            said = "it exited at its preemption warning" if warned else "the sandbox exited by itself"
            transition(sandbox, S.STOPPING, message=said, also=("stop_cause",))
        end_stopping(sandbox, ended_at, message)


def do_fail(sandbox_id: int, reason: str, ended_at: datetime | None = None) -> None:
    with transaction.atomic():
        sandbox = locked(sandbox_id)
        if sandbox is None or sandbox.state not in TRANSITIONS or S.FAILED not in TRANSITIONS[sandbox.state]:
            return
        sandbox.failure = reason
        end(sandbox, S.FAILED, ended_at or timezone.now(), reason, also=("failure",))


def do_lose(sandbox_id: int, reason: str, ended_at: datetime | None = None) -> str | None:
    """A placed sandbox was lost to a fault (its host, its engine): end it, or queue it again
    when its tier says so. A sandbox that was being stopped simply ends. Returns the new
    state, or None when there was nothing to do (already ended: idempotent)."""
    ended_at = ended_at or timezone.now()
    with transaction.atomic():
        sandbox = locked(sandbox_id)
        if sandbox is None or sandbox.state not in (S.PLACING, S.STARTING, S.RUNNING, S.STOPPING):
            return None
        warned = sandbox.preempt_at is not None and sandbox.stop_cause == StopCause.PREEMPTED
        if sandbox.state == S.STOPPING or warned:  # a warned victim ends as its preemption would
            return end_stopping(sandbox, ended_at, f"stopped: {reason}", why=reason)
        if not sandbox.tier.requeue_on_failure:
            sandbox.failure = reason
            end(sandbox, S.FAILED, ended_at, reason, also=("failure",))
            return S.FAILED
        release(sandbox, ended_at)
        return requeue(sandbox, f"requeued: {reason}", Attempt.End.LOST, at=ended_at)


# --- stop -------------------------------------------------------------------------------------


def do_request_stop(
    sandbox_id: int, actor: Any, reason: str = "stop requested", cause: str = StopCause.ASKED
) -> None:
    """Stop a sandbox: a queued one ends at once, a placed one is stopped by its agent.
    ``cause``: a person asked (``actor``), or idle culling did."""
    with transaction.atomic():
        sandbox = locked(sandbox_id)
        if sandbox is None or sandbox.state not in LIVE_STATES or sandbox.state == S.STOPPING:
            return
        if sandbox.state in (S.REQUESTED, S.QUEUED):
            sandbox.ended_at = timezone.now()
            transition(
                sandbox, S.STOPPED, actor=actor, message=f"{reason} before placement", also=("ended_at",)
            )
            return
        sandbox.stop_cause = cause
        transition(sandbox, S.STOPPING, actor=actor, message=reason, also=("stop_cause",))
        send_stop_after_commit(sandbox)


# --- moves (defragmentation plans, control worker) --------------------------------------------


def do_begin_move(sandbox_id: int, plan_id: int) -> bool:
    """Mark a running sandbox as moved by ``plan_id``; False if it is not running, is
    already being moved, or is warned of its preemption (a plan must not count on it)."""
    with transaction.atomic():
        sandbox = locked(sandbox_id)
        if sandbox is None or sandbox.state != S.RUNNING or sandbox.moving_plan_id is not None:
            return False
        if sandbox.preempt_at is not None:
            return False
        sandbox.moving_plan_id = plan_id
        sandbox.save(update_fields=["moving_plan"])
        SandboxEvent.objects.create(
            sandbox=sandbox, from_state=S.RUNNING, to_state=S.RUNNING,
            message=f"to be moved by fleet plan {plan_id}", data={"plan": plan_id},
        )  # fmt: skip
        live.sandbox_changed(sandbox.pk, sandbox.state)
    return True


@dataclass(frozen=True)
class MoveTarget:
    """Where a stopped sandbox starts again: a host and the devices it gets there."""

    host: str
    grants: tuple[DeviceGrant, ...]


def do_stop_moved(sandbox_id: int, plan_id: int, stopped_at: datetime | None, note: str = "") -> str | None:
    """Record that an agent stopped a sandbox for ``plan_id`` at ``stopped_at``.

    Its run so far is billed up to the stop and its devices are released; it stays
    ``stopping`` and moving until ``do_relaunch_moved`` says where it goes. ``stopped_at``
    None: it was never stopped (its checkpoint hook failed, or the plan was abandoned
    first), so it keeps running where it is. One its owner stopped during the move just
    ends. Returns the new state, None when there was nothing to do (a repeated report).
    """
    with transaction.atomic():
        sandbox = locked(sandbox_id)
        if sandbox is None or sandbox.moving_plan_id != plan_id:
            return None
        if stopped_at is None or sandbox.state != S.RUNNING:
            sandbox.moving_plan_id = None
            sandbox.save(update_fields=["moving_plan"])
            if sandbox.state == S.STOPPING and stopped_at is not None:  # its owner stopped it meanwhile
                return end_stopping(sandbox, stopped_at, "stopped")
            SandboxEvent.objects.create(
                sandbox=sandbox, from_state=sandbox.state, to_state=sandbox.state,
                message=f"not moved by fleet plan {plan_id}: {note}"[:300], data={"plan": plan_id},
            )  # fmt: skip
            live.sandbox_changed(sandbox.pk, sandbox.state)
            return str(sandbox.state)
        transition(
            sandbox,
            S.STOPPING,
            message=f"stopped to move (fleet plan {plan_id})" + (f": {note}" if note else ""),
            data={"plan": plan_id},
        )
        release(sandbox, stopped_at)
        sandbox.handle, sandbox.started_at = None, None
        sandbox.save(update_fields=["handle", "started_at"])
        return S.STOPPING


def do_relaunch_moved(sandbox_id: int, plan_id: int, target: MoveTarget | None, note: str = "") -> str | None:
    """Start a sandbox ``plan_id`` stopped on ``target`` (a new allocation key, so the
    ledger opens a new interval when it runs), or queue it again when there is no target or
    the target was taken meanwhile. Returns the new state, None when there was nothing to do."""
    with transaction.atomic():
        sandbox = locked(sandbox_id)
        if sandbox is None or sandbox.moving_plan_id != plan_id or sandbox.state != S.STOPPING:
            return None
        sandbox.moving_plan_id = None
        sandbox.save(update_fields=["moving_plan"])
        if target is not None:
            try:
                with transaction.atomic():
                    _book(sandbox, target.host, target.grants, f"moved by fleet plan {plan_id}")
                return S.PLACING
            except IntegrityError as exc:
                log.warning("sandbox %s: its new slot was taken (%s); requeued", sandbox_id, exc)
                sandbox.refresh_from_db()
        reason = f"requeued: fleet plan {plan_id} left it no slot" + (f" ({note})" if note else "")
        return requeue(sandbox, reason, Attempt.End.MOVED, {"plan": plan_id})


# --- time limits ----------------------------------------------------------------------------


def do_extend(sandbox_id: int, actor: Any, extra: timedelta) -> timedelta:
    """Give a live sandbox more time, within its tier's maximum duration; returns its new
    limit. Raises SandboxRequestError("duration", ...) naming the limit when it would pass it."""
    with transaction.atomic():
        sandbox = locked(sandbox_id)
        if sandbox is None or sandbox.state not in LIVE_STATES or sandbox.state == S.STOPPING:
            raise SandboxRequestError("duration", "Only a live sandbox can be extended.")
        tier = sandbox.tier
        wanted = sandbox.max_duration + extra
        if extra <= timedelta(0) or wanted > tier.max_duration:
            left = tier.max_duration - sandbox.max_duration
            raise SandboxRequestError(
                "duration",
                f"The tier {tier.name} allows at most {tier.max_duration_display} per sandbox; this "
                f"one has {duration_text(sandbox.max_duration)}, so it can get at most "
                f"{duration_text(left)} more.",
            )
        if getattr(actor, "is_authenticated", False) and actor.pk != sandbox.owner_id:
            trail.record(
                actor, "sandbox.extended", sandbox,
                {"max_duration": str(sandbox.max_duration)}, {"max_duration": str(wanted)},
            )  # fmt: skip
        sandbox.max_duration = wanted
        sandbox.expiry_warned_at = None
        sandbox.save(update_fields=["max_duration", "expiry_warned_at"])
        SandboxEvent.objects.create(
            sandbox=sandbox, from_state=sandbox.state, to_state=sandbox.state,
            actor=actor if getattr(actor, "is_authenticated", False) else None,
            message=f"time limit extended by {duration_text(extra)} to {duration_text(wanted)}",
        )  # fmt: skip
        live.sandbox_changed(sandbox.pk, sandbox.state)  # its open pages' time left
        return wanted


def do_expire_overdue(now: datetime, warn_before: timedelta = timedelta(minutes=15)) -> list[int]:
    """Stop running sandboxes at their time limit (they end ``expired``), and tell owners
    ``warn_before`` ahead so they can extend. Returns the ids sent a stop."""
    expired: list[int] = []
    # Only those at or near their limit, chosen by the database: this runs every tick.
    ends = ExpressionWrapper(F("started_at") + F("max_duration"), output_field=DateTimeField())
    due = (
        Sandbox.objects.filter(state=S.RUNNING, started_at__isnull=False)
        .annotate(ends_at=ends)
        .filter(Q(ends_at__lte=now) | Q(ends_at__lte=now + warn_before, expiry_warned_at__isnull=True))
        .values_list("pk", "ends_at")
    )
    for sandbox_id, ends_at in list(due):
        if ends_at <= now:
            with transaction.atomic():
                sandbox = locked(sandbox_id)
                if sandbox is None or sandbox.state != S.RUNNING:
                    continue
                sandbox.stop_cause = StopCause.EXPIRED
                transition(sandbox, S.STOPPING, message="time limit reached", also=("stop_cause",))
                send_stop_after_commit(sandbox)
            expired.append(sandbox_id)
        else:
            with transaction.atomic():
                sandbox = locked(sandbox_id)
                if sandbox is None or sandbox.state != S.RUNNING or sandbox.expiry_warned_at is not None:
                    continue
                sandbox.expiry_warned_at = now
                sandbox.save(update_fields=["expiry_warned_at"])
                notify.notify_owner(
                    sandbox,
                    Notification.Kind.EXPIRING,
                    f"Sandbox {sandbox.pk} reaches its time limit at {ends_at:%H:%M} UTC; "
                    "extend it to keep it.",
                )
    return expired
