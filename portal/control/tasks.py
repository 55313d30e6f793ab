"""The handlers of the ``control`` queue's tasks: one function per task, named as the task.

``wire/messages.py`` declares the tasks (``ControlTasks``: names, arguments, types) and is
what senders call; ``workers/control.py`` registers every function here under its task's
name, with the Celery options of ``CELERY_OPTIONS``, and has mypy check this module against
the declaration. A handler that must run again later returns a ``Retry``.

Every task takes plain JSON (times in epoch milliseconds), returns quietly when its row is
gone, and is idempotent because the actions it calls are.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from datetime import datetime
from typing import TypedDict

import redis
from django.db import transaction
from django.utils import timezone

from portal.api.idempotency import delete_expired_keys
from portal.billing import invoices
from portal.control import hosts
from portal.control.culling import do_cull_idle
from portal.control.faults import do_fault_event
from portal.control.plans import auto_relayout, do_plan_report, expire_stale_plans
from portal.control.reconcile import from_ms
from portal.control.redis_client import client as redis_client
from portal.control.retry import Retry
from portal.control.scheduling import schedule_cycle as run_schedule_cycle
from portal.control.slurm_accounting import do_check_accounting
from portal.fleet.inventory import do_heartbeats, do_sync_inventories
from portal.notifications.emails import send_notification_emails
from portal.sandboxes import actions, live, preemption
from portal.sandboxes.models import Sandbox, SandboxState
from portal.sandboxes.output import do_store_output
from portal.sandboxes.over_share import do_over_share
from portal.sandboxes.storage_usage import do_record_storage_usage
from portal.telemetry.alerts import do_close_host_alerts, do_record_alerts
from portal.telemetry.rollups import do_purge_rollups, do_store_rollups
from portal.webhooks.deliveries import attempt_delivery, webhook_tick
from wire.config import CONTROL_HEARTBEAT_KEY
from wire.liveness import Beat
from wire.messages import (
    FaultReport,
    InventoryReport,
    MigStepReport,
    MinuteRollup,
    MoveReport,
    OverShareReport,
    PlanInventory,
    SlurmAccounting,
    StorageUsage,
)
from wire.spec import HandleJson
from wire.telemetry import AlertMessage

log = logging.getLogger(__name__)
TELEMETRY_PURGED_KEY = "gpushare:telemetry:purged"


class CeleryOptions(TypedDict, total=False):
    """Celery's own task options, those a task here sets."""

    max_retries: int | None
    soft_time_limit: int
    time_limit: int


# Celery options beyond the app's defaults (wire/celery.py: 100 s soft, 120 s hard time
# limit, no result kept), by task.
CELERY_OPTIONS: dict[str, CeleryOptions] = {
    # The delivery row and the mail task count their attempts and give up after MAX_ATTEMPTS
    # (about an hour), so Celery's own limit of retries is lifted.
    "deliver_webhook": {"max_retries": None, "soft_time_limit": 30, "time_limit": 40},
    "email_notifications": {"max_retries": None, "soft_time_limit": 100, "time_limit": 120},
    "sweep_webhooks": {"soft_time_limit": 60, "time_limit": 90},
    "invoice_tick": {"soft_time_limit": 240, "time_limit": 300},
    # Waits up to a minute for the ledger to have the job's end (LEDGER_WAIT_S apart).
    "slurm_accounted": {"max_retries": 12},
}
# Handlers told which run of their message this is (``attempt=``, 1 for the first), from
# Celery's count of retries: they pace their own backoff.
TOLD_ATTEMPT = frozenset({"email_notifications"})


def schedule_cycle() -> None:
    """One scheduling cycle, unless another worker is running one."""
    run_schedule_cycle(time.time())


def tick() -> None:
    """Periodic: mark silent hosts lost, retry stuck launches, give up silent plans, reshape
    MIG GPUs for requests no instance fits, warn and stop idle sandboxes and those at their
    time limit, stop preempted ones at the end of their warning, purge old telemetry, run a
    cycle."""
    hosts.mark_lost_hosts(timezone.now())
    hosts.resend_stuck_placements(timezone.now())
    expire_stale_plans(timezone.now())
    auto_relayout()
    do_cull_idle(timezone.now())
    preemption.do_stop_warned(timezone.now())
    actions.do_expire_overdue(timezone.now())
    purge_telemetry(timezone.now())
    schedule_cycle()


def purge_telemetry(now: datetime) -> None:
    """Rollups past the retention, at most once an hour whatever the number of workers."""
    if redis_client().set(TELEMETRY_PURGED_KEY, int(now.timestamp()), nx=True, ex=3600):
        do_purge_rollups(now)


def agent_heartbeats(beats: list[Beat]) -> None:
    hosts.agent_heartbeats(beats)


def agent_inventories(reports: list[InventoryReport]) -> None:
    """Hosts' inventories: one host's, or a hundred of a process serving many (its start),
    applied together in a few statements (``do_sync_inventories``); an entry that cannot be
    applied is logged with its host's name, and the rest are. Each host applied is alive now;
    one whose agent just started has the alerts it raised before closed (it raises again
    whatever is still true)."""
    outcome = do_sync_inventories(reports)
    now = timezone.now()
    for (backend, driver), names in outcome.by_software().items():
        do_heartbeats(names, now, backend, driver)
    restarted = [host.name for host in outcome.applied if host.started]
    closed = do_close_host_alerts(restarted, "agent restarted")
    if closed:
        log.info("%d agents restarted: %d open alerts closed", len(restarted), closed)


def gpu_faults(host: str, events: list[FaultReport]) -> None:
    """Faults an agent saw (XID, double-bit ECC, GPU lost, overheat): the GPU is drained."""
    for event in events:
        do_fault_event(host, event)


def plan_executed(
    plan_id: int,
    host: str,
    results: list[MoveReport],
    mig_steps: list[MigStepReport],
    error: str,
    inventory: PlanInventory | None,
) -> None:
    """A host's part of a fleet plan is done: sandboxes stopped, MIG layout changed."""
    do_plan_report(plan_id, host, results, mig_steps, error, inventory)


def sandbox_launched(allocation_key: str, handle: HandleJson, started_ms: int) -> None:
    actions.do_mark_running(allocation_key, dict(handle), from_ms(started_ms))


def launch_progress(allocation_key: str, line: str) -> None:
    """A line of what a starting sandbox's host is doing (pulling its image): on its page,
    pushed to it as a state change is (no page polls for it)."""
    starting = Sandbox.objects.filter(allocation_key=allocation_key, state=SandboxState.STARTING)
    with transaction.atomic():
        for pk in starting.values_list("pk", flat=True):
            live.sandbox_changed(pk, SandboxState.STARTING)
        starting.update(launch_progress=line[:300], launch_progress_at=timezone.now())


def sandbox_launch_failed(sandbox_id: int, allocation_key: str, message: str) -> None:
    log.warning("launch of sandbox %s (%s) failed: %s", sandbox_id, allocation_key, message)
    actions.do_fail(sandbox_id, f"launch failed: {message}")


def sandbox_stopped(allocation_key: str, ended_ms: int, message: str = "stopped") -> None:
    actions.do_mark_stopped(allocation_key, from_ms(ended_ms), message)


def sandbox_warned(allocation_key: str, checkpoint: str) -> None:
    preemption.do_record_warning(allocation_key, checkpoint)


def slurm_accounted(allocation_key: str, record: SlurmAccounting) -> Retry | None:
    """slurmdbd's account of a gpushare job that ended, checked against the ledger once the
    ledger has its end: a difference is an alert for admins (portal.control.slurm_accounting)."""
    return do_check_accounting(allocation_key, record)


def sandbox_over_share(host: str, report: OverShareReport) -> None:
    """A sandbox on a shared GPU over its memory share (or back within): its owner warned,
    or it is stopped under its tier's rule (portal.sandboxes.over_share). A stale or
    malformed report is ignored, never retried."""
    do_over_share(host, report)


def storage_usage(sandbox_id: int, usage: StorageUsage) -> None:
    """What a stopped sandbox's volumes hold: {volume id: [bytes, whether measured whole]}."""
    do_record_storage_usage(int(sandbox_id), {int(k): (int(v[0]), bool(v[1])) for k, v in usage.items()})


def sandbox_output(allocation_key: str, start: int, data_b64: str, total: int) -> None:
    """A piece of a batch's output (workers/host/batch_output.py), kept for its owner."""
    do_store_output(allocation_key, int(start), base64.b64decode(data_b64), int(total))


def telemetry_host_rollups(rollups: list[tuple[str, MinuteRollup]]) -> None:
    """Closed minutes, (host, payload) each: one from a host's agent, a round from a process
    serving many hosts."""
    do_store_rollups([(host, dict(payload)) for host, payload in rollups])


def telemetry_alerts(host: str, changes: list[AlertMessage]) -> None:
    do_record_alerts(host, changes)


def invoice_tick() -> None:
    """Refresh draft invoices and finalize past months (portal.billing.invoices)."""
    invoices.invoice_tick(timezone.now())


def purge_idempotency_keys() -> None:
    """API Idempotency-Keys past their 24 h are deleted (a replay after that is a new POST)."""
    delete_expired_keys()


# --- Webhooks, billing and alerts alike (portal.webhooks), and mail (portal.notifications.emails):
# the attempt and its record live there.


def deliver_webhook(delivery_id: int) -> Retry | None:
    """One signed POST of a webhook; on failure, retried after the backoff the attempt
    recorded (next_attempt_at), about an hour in all."""
    delay = attempt_delivery(delivery_id)
    return None if delay is None else Retry(delay)


def email_notifications(notification_ids: list[int], attempt: int = 1) -> Retry | None:
    """Mail the notifications whose users chose their kind by email; those the mail server
    did not take are retried with backoff, about an hour in all."""
    later = send_notification_emails(notification_ids, attempt=attempt)
    return None if later is None else Retry(later.delay_s, (later.ids,))


def sweep_webhooks() -> None:
    """Re-enqueue deliveries whose retry message was lost (a worker died holding it)."""
    webhook_tick(timezone.now())


def beat_forever(stop: threading.Event) -> None:
    """The control worker's own liveness, read by /healthz, every 2 s until ``stop``."""
    client = redis_client()
    while not stop.is_set():
        try:
            client.set(CONTROL_HEARTBEAT_KEY, int(time.time() * 1000), ex=15)
        except redis.RedisError as exc:
            log.warning("control heartbeat not written: %s", exc)
        stop.wait(2)
