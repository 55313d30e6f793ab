"""Carrying out the scheduler's defragmentation plans (control worker side).

Two kinds, both planned by ``scheduler.defrag`` from the database's picture of the fleet:

- **MIG re-layout** of one host's GPUs (``plan_mig``): make room for a MIG profile that no
  free instance fits, by destroying idle instances in the way and moving the fewest
  running sandboxes to other starts or GPUs of that host. The requested instance is
  created at the end, so the queued request it was made for lands there next cycle.
- **Consolidation** of shared GPUs (``plan_consolidation``): move MPS shares and
  time-slice replicas off the emptiest GPUs, so whole GPUs come free.

How a plan runs, every step a ``PlanStep``:

1. ``do_start_*`` (one transaction): plan, mark each disturbed sandbox as moving
   (``actions.do_begin_move``; the plan is refused if one is not running), record the plan
   with the GPUs it touches (they take no placements meanwhile) and, after commit, send each
   host's agent its part (``execute_plan``).
2. The agent runs the optional checkpoint hook and stops each sandbox it must move, then
   (MIG) changes the layout through its ``MigManager``, and reports back: what it stopped
   and when, the MIG steps, an error if it stopped short, and its inventory.
3. ``do_plan_report``: the inventory is synced, the steps recorded, and each stopped
   sandbox relaunched on its new slot (the instance the MIG step made for it, or its
   destination GPU), on its old instance when the re-layout stopped before touching it, or
   requeued when it has nowhere to go. Billing stops at the stop and starts again when the
   relaunched sandbox runs. The plan is done when every host has reported.

A plan whose agents stay silent for ``FLEET_PLAN_TIMEOUT_S`` is given up; reconciliation
then sees what really runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.audit import trail
from portal.catalog.models import SharingMode
from portal.control.reconcile import from_ms
from portal.fleet.inventory import do_sync_inventory
from portal.fleet.models import FleetPlan, Gpu, GpuMode, Host, MigInstance, PlanStep, running_plan_gpus
from portal.fleet.modes import serving
from portal.sandboxes import actions, nudge
from portal.sandboxes.models import Allocation, Sandbox, SandboxState
from portal.scheduling.snapshot import build_snapshot
from scheduler.cluster import DeviceGrant
from scheduler.defrag import (
    CREATE,
    DESTROY,
    MIGRATE,
    HostRoom,
    MigGpu,
    MigMove,
    MigPlan,
    Share,
    SharedGpu,
    plan_consolidation,
    plan_mig,
)
from scheduler.defrag import MigInstance as PlannedMigInstance
from wire.messages import MigStepReport, MoveReport, PlanInventory, StopOrder, to_host

log = logging.getLogger(__name__)
S = SandboxState


class PlanError(Exception):
    """A plan that cannot be made or started; the message says why, for an admin."""


def _step(plan: FleetPlan, action: str, message: str, ok: bool = True, **where: Any) -> None:
    PlanStep.objects.create(plan=plan, action=action, ok=ok, message=message[:300], **where)


def _live_allocations(gpus: list[Gpu]) -> list[Allocation]:
    return list(
        Allocation.objects.filter(active=True, gpu__in=gpus).select_related("sandbox__tier", "mig_instance")
    )


def _stop_order(sandbox: Sandbox) -> StopOrder:
    return StopOrder(allocation_key=sandbox.allocation_key, sandbox_id=sandbox.pk, handle=sandbox.handle)


def _begin_moves(plan: FleetPlan, sandbox_ids: list[int]) -> list[Sandbox]:
    """Mark every sandbox the plan disturbs as moving, or refuse the whole plan. An admin's
    plan moves other people's sandboxes: each move goes in the audit log."""
    for sandbox_id in sandbox_ids:
        if not actions.do_begin_move(sandbox_id, plan.pk):
            found = Sandbox.objects.filter(pk=sandbox_id).values_list("state", "preempt_at").first()
            state, warned = found or (None, None)
            if warned is not None:
                raise PlanError(
                    f"sandbox {sandbox_id} is being preempted: it stops soon, the plan need not move it"
                )
            raise PlanError(
                f"sandbox {sandbox_id} is {state or 'gone'}, not running: the plan would have to move it; "
                "try again once it runs"
            )
    moving = list(Sandbox.objects.filter(pk__in=sandbox_ids).select_related("host"))
    if plan.created_by is not None:
        for sandbox in moving:
            trail.record(plan.created_by, "sandbox.moved", sandbox, None, {"plan": plan.pk}, plan.purpose)
    return moving


# --- MIG re-layout ----------------------------------------------------------------------------


def mig_fleet(host: Host) -> tuple[list[MigGpu], list[Allocation]]:
    """The host's MIG GPUs as the planner sees them: each instance with the sandbox in it."""
    gpus = list(host.gpus.filter(mig_enabled=True).prefetch_related("mig_instances"))
    live = _live_allocations(gpus)
    holder = {a.mig_instance.uuid: str(a.sandbox_id) for a in live if a.mig_instance is not None}
    fleet = [
        MigGpu(
            uuid=gpu.uuid,
            model=gpu.model,
            instances=tuple(
                _mig_instance(m, holder.get(m.uuid, "")) for m in gpu.mig_instances.order_by("start")
            ),
            available=gpu.state == Gpu.State.AVAILABLE,
        )
        for gpu in gpus
    ]
    return fleet, live


def _mig_instance(m: MigInstance, sandbox: str) -> PlannedMigInstance:
    return PlannedMigInstance(m.uuid, m.profile, m.start, sandbox)


def best_mig_plan(host: Host, profile: str, max_disturbed: int) -> MigPlan | None:
    fleet, _ = mig_fleet(host)
    return plan_mig(fleet, profile, max_disturbed) if fleet else None


@dataclass(frozen=True)
class MigPreview:
    """A MIG re-layout as it would run now, for an admin to read before approving it."""

    host: str
    plan: MigPlan
    steps: list[str]  # each move in words
    disturbed: list[str]  # "sandbox 12 (olivia, project vision)"
    fingerprint: str  # approval must match it: the fleet may change after the preview


def _mig_plan_now(host: Host, profile: str, max_disturbed: int) -> tuple[MigPlan, list[Allocation]]:
    """Plan on the host as it is now, with the requested instance created at the end."""
    if host.state != Host.State.UP:
        raise PlanError(f"host {host.name} is {host.get_state_display().lower()}: its agent cannot act")
    fleet, live = mig_fleet(host)
    if not fleet:
        raise PlanError(f"host {host.name} has no GPU in MIG mode")
    if running_plan_gpus() & {g.uuid for g in fleet}:
        raise PlanError(f"a plan is already changing {host.name}'s GPUs; wait for it to finish")
    plan = plan_mig(fleet, profile, max_disturbed)
    if plan is None:
        raise PlanError(
            f"no re-layout of {host.name} that disturbs at most {max_disturbed} running sandbox(es) "
            f"makes room for {profile}"
        )
    # The room made is for a new instance of the requested profile: make it too.
    return dataclasses.replace(
        plan, moves=(*plan.moves, MigMove(CREATE, plan.gpu, profile, plan.start))
    ), live


def fingerprint(plan: MigPlan) -> str:
    return hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def preview_mig_plan(host_name: str, profile: str, max_disturbed: int) -> MigPreview:
    """What ``do_start_mig_plan`` would do now; changes nothing."""
    host = Host.objects.filter(name=host_name).first()
    if host is None:
        raise PlanError(f"no host {host_name}")
    plan, _ = _mig_plan_now(host, profile, max_disturbed)
    gpu_names = {g.uuid: f"GPU {g.index}" for g in host.gpus.all()}
    words = {DESTROY: "destroy", CREATE: "create"}
    steps = []
    for move in plan.moves:
        where = gpu_names.get(move.gpu, move.gpu)
        if move.kind == MIGRATE:
            steps.append(
                f"move sandbox {move.sandbox} from {move.profile}@{move.start} on {where} to "
                f"{move.profile}@{move.to_start} on {gpu_names.get(move.to_gpu, move.to_gpu)}"
            )
        else:
            who = f" (sandbox {move.sandbox} stops, then starts again in it)" if move.sandbox else ""
            steps.append(f"{words[move.kind]} {move.profile}@{move.start} on {where}{who}")
    sandboxes = Sandbox.objects.filter(pk__in=[int(s) for s in plan.disturbed]).select_related(
        "owner", "project"
    )
    disturbed = [f"sandbox {s.pk} ({s.owner.get_username()}, project {s.project.slug})" for s in sandboxes]
    return MigPreview(host_name, plan, steps, disturbed, fingerprint(plan))


def do_start_mig_plan(
    host_name: str,
    profile: str,
    max_disturbed: int,
    actor: Any = None,
    purpose: str = "",
    expect: str = "",
) -> FleetPlan:
    """Plan and start a MIG re-layout of ``host_name`` that makes room for ``profile``.

    With ``expect`` (a preview's fingerprint), it starts only if the plan is still the one
    the admin approved."""
    with transaction.atomic():
        host = Host.objects.select_for_update().filter(name=host_name).first()
        if host is None:
            raise PlanError(f"no host {host_name}")
        plan, live = _mig_plan_now(host, profile, max_disturbed)
        if expect and fingerprint(plan) != expect:
            raise PlanError(
                "this is not the plan previewed (the fleet or the form changed since): preview it again"
            )
        touched = sorted(
            {plan.gpu} | {m.gpu for m in plan.moves} | {m.to_gpu for m in plan.moves if m.to_gpu}
        )
        record = FleetPlan.objects.create(
            kind=FleetPlan.Kind.MIG_RELAYOUT,
            purpose=(purpose or f"make room for {profile} on {host_name}")[:200],
            plan={"host": host_name, **plan.to_json()},
            touched_gpus=touched,
            hosts_pending=[host_name],
            created_by=actor if getattr(actor, "is_authenticated", False) else None,
        )
        disturbed = _begin_moves(record, [int(s) for s in plan.disturbed])
        moved = {int(s) for s in plan.disturbed}
        busy = {
            a.mig_instance.uuid: str(a.sandbox_id)
            for a in live
            if a.mig_instance is not None and a.sandbox_id not in moved
        }
        _step(
            record,
            "planned",
            f"{len(plan.moves)} MIG step(s) for {profile}@{plan.start} on {plan.gpu}; "
            + (
                f"moves sandbox(es) {', '.join(plan.disturbed)}" if plan.disturbed else "no sandbox disturbed"
            ),
            host=host_name,
            gpu_uuid=plan.gpu,
        )
        stops = [_stop_order(s) for s in disturbed]
        plan_json, plan_id = plan.to_json(), record.pk
        transaction.on_commit(lambda: to_host(host_name).execute_plan(plan_id, stops, plan_json, busy))
    log.info("fleet plan %s started: %s", record.pk, record.purpose)
    return record


def waiting_mig_profiles() -> list[str]:
    """Profiles of queued MIG requests, oldest request first, that no free instance fits."""
    touched = running_plan_gpus()
    profiles: list[str] = []
    queued = Sandbox.objects.filter(state=S.QUEUED, tier__sharing_mode=SharingMode.MIG).order_by(
        "requested_at"
    )
    for profile in queued.values_list("mig_profile", flat=True)[:50]:
        if profile in profiles:
            continue
        free = (
            MigInstance.objects.filter(
                profile=profile, gpu__state=Gpu.State.AVAILABLE, gpu__host__state=Host.State.UP
            )
            .exclude(gpu__uuid__in=touched)
            .exclude(allocations__active=True)
        )
        if not free.exists():
            profiles.append(profile)
    return profiles


def auto_relayout() -> FleetPlan | None:
    """Reshape MIG GPUs on their own for the oldest queued MIG request no instance fits,
    disturbing at most MIG_AUTO_RELAYOUT_MAX_DISTURBED running sandboxes. One plan a call:
    the cheapest host (fewest disturbed, then fewest steps)."""
    limit = settings.MIG_AUTO_RELAYOUT_MAX_DISTURBED
    if limit < 0:
        return None
    touched = running_plan_gpus()
    for profile in waiting_mig_profiles():
        candidates = []
        for host in Host.objects.filter(state=Host.State.UP, gpus__mig_enabled=True).distinct():
            if touched & set(host.gpus.values_list("uuid", flat=True)):
                continue
            plan = best_mig_plan(host, profile, limit)
            if plan is not None:
                candidates.append((len(plan.disturbed), len(plan.moves), host.name))
        if candidates:
            _, _, host_name = min(candidates)
            try:
                return do_start_mig_plan(
                    host_name,
                    profile,
                    limit,
                    purpose=f"make room for a queued {profile} request on {host_name}",
                )
            except PlanError as exc:  # the fleet changed since: try again next tick
                log.info("automatic MIG re-layout for %s not started: %s", profile, exc)
    return None


# --- shared-GPU consolidation -----------------------------------------------------------------


def _host_rooms() -> dict[str, HostRoom]:
    rooms = {}
    for host in build_snapshot().hosts:
        if host.cpu_milli:  # 0: capacity not tracked, the host never refuses
            rooms[host.name] = HostRoom(
                host.cpu_milli - host.cpu_used_milli, host.memory_mib - host.memory_used_mib
            )
        else:
            rooms[host.name] = HostRoom(10**9, 10**9)
    return rooms


def _share_milli(alloc: Allocation) -> int:
    return alloc.mps_thread_pct * 10 if alloc.kind == Allocation.Kind.MPS else alloc.milli_gpu


def shared_fleet(mode: str) -> list[SharedGpu]:
    """GPUs serving one sharing mode on up hosts, with their shares: those pinned to it, and
    those following demand that serve it now (an idle one is left out: moving shares onto
    it would free no GPU). A GPU holding a sandbox that is not simply running (starting,
    stopping, already moving) is left out entirely."""
    gpus = list(
        Gpu.objects.filter(sharing_mode__in=(mode, GpuMode.AUTO), host__state=Host.State.UP)
        .exclude(state=Gpu.State.UNAVAILABLE)
        .exclude(uuid__in=running_plan_gpus())
        .select_related("host")
    )
    by_gpu: dict[int, list[Allocation]] = defaultdict(list)
    for alloc in _live_allocations(gpus):
        by_gpu[alloc.gpu_id].append(alloc)
    fleet = []
    for gpu in gpus:
        allocs = by_gpu.get(gpu.pk, [])
        if serving(gpu.sharing_mode, (a.kind for a in allocs)) != mode:
            continue
        if any(a.sandbox.state != S.RUNNING or a.sandbox.moving_plan_id for a in allocs):
            continue
        replicas = max(gpu.timeslice_replicas, 1)
        fleet.append(
            SharedGpu(
                uuid=gpu.uuid,
                model=gpu.model,
                memory_mib=gpu.memory_mib if mode == SharingMode.MPS else 10**9,
                shares=tuple(
                    Share(
                        sandbox=str(a.sandbox_id),
                        milli=_share_milli(a),
                        memory_mib=a.mps_memory_mib,
                        cpu_milli=round(a.sandbox.tier.cpu_limit * 1000),
                        host_memory_mib=a.sandbox.tier.memory_limit_mib,
                    )
                    for a in allocs
                ),
                capacity_milli=1000 if mode == SharingMode.MPS else (1000 // replicas) * replicas,
                available=gpu.state == Gpu.State.AVAILABLE,
                host=gpu.host.name,
                one_size=mode == SharingMode.MPS and settings.MPS_ONE_SIZE_PER_GPU,
            )
        )
    return fleet


def do_start_consolidation(max_migrations: int | None = None, actor: Any = None) -> FleetPlan:
    """Plan and start moving shares off the emptiest shared GPUs (MPS, then time-slice)."""
    with transaction.atomic():
        list(Host.objects.select_for_update().filter(state=Host.State.UP))  # one plan at a time
        rooms = _host_rooms()
        migrations: list[dict[str, Any]] = []
        frees: list[str] = []
        host_of: dict[str, str] = {}
        for mode in (SharingMode.MPS, SharingMode.TIMESLICE):
            fleet = shared_fleet(mode)
            host_of.update({g.uuid: g.host for g in fleet})
            left = None if max_migrations is None else max_migrations - len(migrations)
            if left is not None and left <= 0:
                break
            plan = plan_consolidation(fleet, left, rooms)
            frees += plan.frees
            migrations += [
                {
                    **dataclasses.asdict(m),
                    "mode": str(mode),
                    "from_host": host_of[m.from_gpu],
                    "to_host": host_of[m.to_gpu],
                }
                for m in plan.migrations
            ]
        if not migrations:
            raise PlanError("nothing to consolidate: no shared GPU's shares all fit on the other shared GPUs")
        record = FleetPlan.objects.create(
            kind=FleetPlan.Kind.CONSOLIDATION,
            purpose=f"free {len(frees)} shared GPU(s) with {len(migrations)} migration(s)",
            plan={"migrations": migrations, "frees": frees},
            touched_gpus=sorted({m["from_gpu"] for m in migrations} | {m["to_gpu"] for m in migrations}),
            hosts_pending=sorted({m["from_host"] for m in migrations}),
            created_by=actor if getattr(actor, "is_authenticated", False) else None,
        )
        moving = _begin_moves(record, [int(m["sandbox"]) for m in migrations])
        by_id = {s.pk: s for s in moving}
        orders: dict[str, list[StopOrder]] = defaultdict(list)
        for m in migrations:
            _step(
                record,
                "planned",
                f"move sandbox {m['sandbox']} ({m['mode']}, {m['milli']} milli) "
                f"to {m['to_host']}/{m['to_gpu']}",
                host=m["from_host"],
                gpu_uuid=m["from_gpu"],
                sandbox=by_id[int(m["sandbox"])],
            )
            orders[m["from_host"]].append(_stop_order(by_id[int(m["sandbox"])]))
        plan_id = record.pk
        for host_name, stops in orders.items():
            transaction.on_commit(
                lambda h=host_name, st=stops: to_host(h).execute_plan(plan_id, st, None, {})  # type: ignore[misc]
            )
    log.info("fleet plan %s started: %s", record.pk, record.purpose)
    return record


# --- the agents' reports ----------------------------------------------------------------------


def _mig_target(
    sandbox: Sandbox, host: str, old: Allocation | None, mig_steps: list[MigStepReport]
) -> actions.MoveTarget | None:
    """The instance made (or kept) for the sandbox; else its old one, if it still stands
    (the re-layout stopped before destroying it)."""
    named = next(
        (
            s["mig_uuid"]
            for s in mig_steps
            if s["action"] in ("create", "keep") and s["sandbox"] == str(sandbox.pk)
        ),
        old.device_uuid if old is not None else None,
    )
    instance = MigInstance.objects.filter(uuid=named).select_related("gpu").first() if named else None
    if instance is None:
        return None
    grant = DeviceGrant(
        gpu_uuid=instance.gpu.uuid,
        device_uuid=instance.uuid,
        kind=Allocation.Kind.MIG,
        milli_gpu=old.milli_gpu if old is not None else 1000 * instance.memory_slices // 8,
        mig_uuid=instance.uuid,
    )
    return actions.MoveTarget(host, (grant,))


def _share_target(old: Allocation | None, migration: dict[str, Any] | None) -> actions.MoveTarget | None:
    dest = Gpu.objects.filter(uuid=migration["to_gpu"]).first() if migration else None
    if old is None or dest is None or migration is None:
        return None
    replica = None
    if old.kind == Allocation.Kind.TIMESLICE:
        taken = set(
            Allocation.objects.filter(gpu=dest, active=True, kind=old.kind).values_list("replica", flat=True)
        )
        replica = next((r for r in range(dest.timeslice_replicas) if r not in taken), None)
        if replica is None:
            return None
    grant = DeviceGrant(
        gpu_uuid=dest.uuid,
        device_uuid=dest.uuid,
        kind=old.kind,
        milli_gpu=old.milli_gpu,
        mps_memory_mib=old.mps_memory_mib,
        mps_thread_pct=old.mps_thread_pct,
        replica=replica,
    )
    return actions.MoveTarget(migration["to_host"], (grant,))


def do_plan_report(
    plan_id: int,
    host_name: str,
    results: list[MoveReport],
    mig_steps: list[MigStepReport],
    error: str,
    inventory: PlanInventory | None,
) -> FleetPlan | None:
    """Apply one host's report of its part of a plan, in one transaction; idempotent (a
    repeated or late report changes nothing but the inventory)."""
    with transaction.atomic():
        plan = FleetPlan.objects.select_for_update().filter(pk=plan_id).first()
        if plan is None:
            return None
        if host_name not in plan.hosts_pending:
            log.info("fleet plan %s: report from %s already applied, or late; ignored", plan_id, host_name)
            if inventory is not None:
                _sync(host_name, inventory)
            return plan
        # 1. The stops: each stopped sandbox releases its devices, so that 2. the inventory
        # sync can drop the instances the re-layout destroyed, and 3. the new ones hold them.
        stopped: list[tuple[Sandbox, Allocation | None, str]] = []
        for result in results:
            # Only a sandbox on the reporting host: a host speaks for itself alone (issue 38).
            sandbox = Sandbox.objects.filter(pk=result["sandbox_id"], host__name=host_name).first()
            if sandbox is None:
                continue
            note = result.get("message", "")
            if checkpoint := result.get("checkpoint"):
                ok, message = checkpoint
                _step(plan, "checkpoint", message, ok=ok, host=host_name, sandbox=sandbox)
            old = sandbox.allocations.filter(active=True).first()
            state = actions.do_stop_moved(
                sandbox.pk,
                plan.pk,
                None if (stopped_ms := result.get("stopped_ms")) is None else from_ms(stopped_ms),
                note,
            )
            if state == S.STOPPING:
                _step(plan, "stop", f"stopped sandbox {sandbox.pk}", host=host_name, sandbox=sandbox)
                stopped.append((sandbox, old, note))
            elif state is not None and result.get("stopped_ms") is None:
                _step(
                    plan,
                    "left",
                    f"sandbox {sandbox.pk} left where it runs: {note}",
                    ok=False,
                    host=host_name,
                    sandbox=sandbox,
                )
        if inventory is not None:
            _sync(host_name, inventory)
        for step in mig_steps:
            who = f" for sandbox {step['sandbox']}" if step.get("sandbox") else ""
            _step(
                plan,
                step["action"],
                f"{step['action']} {step['profile']}@{step['start']}{who}",
                host=host_name,
                gpu_uuid=step["gpu"],
                device_uuid=step["mig_uuid"],
            )
        migrations = {m["sandbox"]: m for m in plan.plan.get("migrations", [])}
        for sandbox, old, note in stopped:
            if plan.kind == FleetPlan.Kind.MIG_RELAYOUT:
                target = _mig_target(sandbox, host_name, old, mig_steps)
            else:
                target = _share_target(old, migrations.get(str(sandbox.pk)))
            state = actions.do_relaunch_moved(sandbox.pk, plan.pk, target, note)
            if state == S.PLACING and target is not None:
                grant = target.grants[0]
                _step(
                    plan, "relaunch",
                    f"relaunching sandbox {sandbox.pk} on {target.host}/{grant.device_uuid}",
                    host=target.host, gpu_uuid=grant.gpu_uuid, device_uuid=grant.device_uuid, sandbox=sandbox,
                )  # fmt: skip
            elif state == S.QUEUED:
                _step(
                    plan,
                    "requeue",
                    f"sandbox {sandbox.pk} requeued: no slot left for it",
                    ok=False,
                    sandbox=sandbox,
                )
        if error:
            plan.error = (plan.error + "\n" if plan.error else "") + f"{host_name}: {error}"
            _step(plan, "failed", error, ok=False, host=host_name)
        plan.hosts_pending = [h for h in plan.hosts_pending if h != host_name]
        if not plan.hosts_pending:
            plan.state = FleetPlan.State.FAILED if plan.error else FleetPlan.State.DONE
            plan.finished_at = timezone.now()
            _step(plan, str(plan.state), f"plan {plan.get_state_display().lower()}", ok=not plan.error)
        plan.save(update_fields=["error", "hosts_pending", "state", "finished_at"])
        nudge.ask_for_cycle()
    return plan


def _sync(host_name: str, inventory: PlanInventory) -> None:
    do_sync_inventory(host_name, inventory["backend"], inventory["driver"], inventory["gpus"])


def expire_stale_plans(now: datetime) -> int:
    """Give up plans whose agents stayed silent; their sandboxes are left to reconciliation."""
    cutoff = now - timedelta(seconds=settings.FLEET_PLAN_TIMEOUT_S)
    expired = 0
    with transaction.atomic():
        for plan in FleetPlan.objects.select_for_update().filter(
            state=FleetPlan.State.RUNNING, created_at__lt=cutoff
        ):
            message = (
                f"no report from {', '.join(plan.hosts_pending)} within {settings.FLEET_PLAN_TIMEOUT_S} s"
            )
            log.warning("fleet plan %s given up: %s", plan.pk, message)
            Sandbox.objects.filter(moving_plan=plan).update(moving_plan=None)
            plan.state, plan.error, plan.finished_at = FleetPlan.State.FAILED, message, now
            plan.save(update_fields=["state", "error", "finished_at"])
            _step(plan, "failed", message, ok=False)
            expired += 1
    return expired
