"""GPU faults, and draining GPUs: by hand (an admin), or automatically on a fault.

A drained GPU takes no new sandboxes; what already runs on it keeps running (an admin
stops or migrates it). A device XID, a double-bit ECC error, a GPU that fell off the bus,
a temperature over the alert policy's rule, or a memory repair the board reports (a row
remap that failed: replace the GPU; one pending, or pages pending retirement: reset it when
idle) drains the GPU automatically, writes a fleet
event and logs an error; only an admin undrains it. The fault's one alert is the agent's
(``portal.telemetry.alerts``: stored, webhooks, owners told); undraining closes it. Every
call is one transaction and idempotent: a second report of the same fault changes nothing.

An application XID (wire.xids: 13, 31, 43, 45, 68, 109, a tenant's own kernel
fault) never drains: the GPU is healthy, and on MIG it would take every tenant's
instance out of scheduling for one tenant's bug. It is recorded as an ``info`` fleet
event; the agent raises its alert for the sandboxes on the device, whose owners hear of
it. An older agent sends every XID as ``xid``, so the XID number is classified here too.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal.fleet import actions
from portal.fleet.models import FleetEvent, Gpu
from portal.sandboxes.models import Allocation, Notification
from portal.sandboxes.notify import notify_owner
from portal.telemetry.models import Alert
from wire.messages import FaultReport
from wire.xids import classify, describe

log = logging.getLogger(__name__)
# Fault kinds from the agents (workers.gpu.base.FaultEvent.kind) that drain a GPU.
DRAINING_FAULTS = {
    "xid": "XID error",  # a device XID; an application one is app_xid
    "ecc_dbe": "double-bit ECC error",
    "gpu_lost": "GPU lost (fell off the bus or stopped answering)",
    "overheat": "temperature over the limit",
    # The board's memory repairs, read by the agent at start and periodically
    # (workers.gpu.base.MemoryRepairs): state from before the agent started, too.
    "remap_failed": "row remapping failed",
    "remap_pending": "a row remap is pending",
    "retirement_pending": "a page retirement is pending",
}
# The alert kinds of faults that drain a GPU (the temperature's clears itself as it cools).
FAULT_ALERTS = ("xid", "ecc", "gpu_lost")


def do_drain_gpu(uuid: str, reason: str, actor: Any = None) -> bool:
    """Drain an available GPU by hand. False when there was nothing to drain."""
    with transaction.atomic():
        gpu = Gpu.objects.select_for_update().select_related("host").filter(uuid=uuid).first()
        if gpu is None or gpu.state != Gpu.State.AVAILABLE:
            return False
        _drain(gpu, reason, "drained", f"drained: {reason}", actor)
    log.info("GPU %s drained: %s", uuid, reason)
    return True


def do_undrain_gpu(uuid: str, actor: Any) -> bool:
    """Return a drained GPU to service; its open alerts count as acknowledged."""
    with transaction.atomic():
        gpu = Gpu.objects.select_for_update().select_related("host").filter(uuid=uuid).first()
        if gpu is None or gpu.state != Gpu.State.DRAINED:
            return False
        actions.undrain_gpu(gpu, actor)
        now = timezone.now()
        FleetEvent.objects.filter(gpu=gpu, severity=FleetEvent.Severity.ALERT, acknowledged_at=None).update(
            acknowledged_at=now
        )  # rows from before faults had one alert each
        # The GPU's fault alerts cannot clear themselves (the agent never sees an ECC error or
        # a lost GPU go away): the admin who put it back in service is the one who clears them.
        Alert.objects.filter(gpu=gpu, sandbox=None, kind__in=FAULT_ALERTS, cleared_at=None).update(
            cleared_at=now, clear_reason=f"GPU undrained by {actor}"[:120]
        )
    log.info("GPU %s undrained by %s", uuid, actor)
    return True


def do_fault_event(host_name: str, event: FaultReport) -> bool:
    """Apply one fault event from an agent: drain the GPU (or the MIG device's parent)
    with an alert. Returns True when it drained a GPU."""
    kind = event.get("kind", "")
    xid = _xid(event.get("xid"))
    if kind == "app_xid" or (kind == "xid" and xid is not None and classify(xid).cls == "application"):
        return _note_app_xid(host_name, event, xid)
    if kind not in DRAINING_FAULTS:
        log.warning("unknown fault event from %s ignored: %s", host_name, event)
        return False
    uuid = event.get("uuid", "")
    detail = str(event.get("detail") or "")
    what = DRAINING_FAULTS[kind] + (f" {event['xid']}" if event.get("xid") is not None else "")
    reason = f"{what}: {detail}" if detail else what
    with transaction.atomic():
        # The device is the GPU itself, or one of its MIG instances (the GPU is drained).
        gpu = (
            Gpu.objects.select_for_update(of=("self",))  # not the outer-joined MIG rows
            .select_related("host")
            .filter(Q(uuid=uuid) | Q(mig_instances__uuid=uuid), host__name=host_name)
            .first()
        )
        if gpu is None:
            log.warning("fault event for unknown device %s on %s: %s", uuid, host_name, reason)
            return False
        if gpu.state == Gpu.State.DRAINED:
            return False  # the same fault again, or a second one: the GPU is out already
        _drain(gpu, reason, kind, f"drained automatically: {reason}")
    log.error("ALERT: %s GPU %s (%s) drained automatically: %s", host_name, gpu.index, gpu.uuid, reason)
    return True


def _xid(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _note_app_xid(host_name: str, event: FaultReport, xid: int | None) -> bool:
    """An application XID: recorded for the GPU, never drained. Returns False."""
    uuid = str(event.get("uuid", ""))
    what = describe(xid) if xid is not None else "application XID"
    gpu = (
        Gpu.objects.select_related("host")
        .filter(Q(uuid=uuid) | Q(mig_instances__uuid=uuid), host__name=host_name)
        .first()
    )
    if gpu is None:
        log.warning("application XID for unknown device %s on %s: %s", uuid, host_name, what)
        return False
    where = "" if uuid == gpu.uuid else f" on MIG device {uuid}"
    FleetEvent.objects.create(
        host=gpu.host,
        gpu=gpu,
        kind="app_xid",
        severity=FleetEvent.Severity.INFO,
        message=f"{what}{where}: the sandbox's own fault; the GPU stays in service"[:300],
    )
    log.info("%s GPU %s (%s): %s%s; not drained", host_name, gpu.index, gpu.uuid, what, where)
    return False


def _drain(gpu: Gpu, reason: str, kind: str, message: str, actor: Any = None) -> None:
    """Take a locked GPU out of service and record why (caller holds the row lock)."""
    actions.drain_gpu(gpu, reason, message, kind=kind, actor=actor)
    # The people whose sandboxes are on it hear what it means for them.
    for alloc in Allocation.objects.filter(gpu=gpu, active=True).select_related("sandbox"):
        sandbox = alloc.sandbox
        notify_owner(
            sandbox,
            Notification.Kind.DRAINED,
            f"Sandbox {sandbox.pk}: its GPU ({gpu.host.name} #{gpu.index}) was taken out of service "
            f"({reason}). It keeps running; save your work, as the GPU may be repaired or replaced.",
        )
