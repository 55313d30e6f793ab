"""Tasks on the ``control`` queue: the only worker that changes fleet state (uses the ORM).

The Celery entry point into ``portal.control`` (``portal/control/tasks.py``): each task is
named for the agents and the portal that send it (``workers/dispatch.py``) and makes one
call there. Agents report here; every task takes plain JSON, returns quietly when its row
is gone, and is idempotent because the actions it calls are.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import django
from celery import signals

django.setup()

from django.utils import timezone  # noqa: E402

from portal.control import tasks  # noqa: E402
from portal.notifications.emails import send_notification_emails  # noqa: E402
from portal.webhooks.deliveries import attempt_delivery, webhook_tick  # noqa: E402
from workers.celery import app  # noqa: E402
from workers.liveness import Beat  # noqa: E402

log = logging.getLogger(__name__)


@app.task(name="workers.control.schedule_cycle", ignore_result=True)
def schedule_cycle() -> None:
    """Run one cycle unless another worker is running one (it will see our queue too)."""
    tasks.schedule_cycle()


@app.task(name="workers.control.tick", ignore_result=True)
def tick() -> None:
    """Periodic: lost hosts, stuck launches, silent plans, MIG re-layout, idle and overdue
    sandboxes, old telemetry, a cycle."""
    tasks.tick()


@app.task(name="workers.control.agent_heartbeats", ignore_result=True)
def agent_heartbeats(beats: list[Beat]) -> None:
    tasks.agent_heartbeats(beats)


@app.task(name="workers.control.agent_inventory", ignore_result=True)
def agent_inventory(
    host: str, backend: str, driver: str, gpus: list[dict[str, Any]], facts: dict[str, int] | None = None
) -> None:
    tasks.agent_inventory(host, backend, driver, gpus, facts)


@app.task(name="workers.control.gpu_faults", ignore_result=True)
def gpu_faults(host: str, events: list[dict[str, Any]]) -> None:
    tasks.gpu_faults(host, events)


@app.task(name="workers.control.plan_executed", ignore_result=True)
def plan_executed(
    plan_id: int,
    host: str,
    results: list[dict[str, Any]],
    mig_steps: list[dict[str, Any]],
    error: str,
    inventory: dict[str, Any] | None,
) -> None:
    tasks.plan_executed(plan_id, host, results, mig_steps, error, inventory)


@app.task(name="workers.control.sandbox_launched", ignore_result=True)
def sandbox_launched(allocation_key: str, handle: dict[str, Any], started_ms: int) -> None:
    tasks.sandbox_launched(allocation_key, handle, started_ms)


@app.task(name="workers.control.launch_progress", ignore_result=True)
def launch_progress(allocation_key: str, line: str) -> None:
    tasks.launch_progress(allocation_key, line)


@app.task(name="workers.control.sandbox_launch_failed", ignore_result=True)
def sandbox_launch_failed(sandbox_id: int, allocation_key: str, message: str) -> None:
    tasks.sandbox_launch_failed(sandbox_id, allocation_key, message)


@app.task(name="workers.control.sandbox_stopped", ignore_result=True)
def sandbox_stopped(allocation_key: str, ended_ms: int, message: str = "stopped") -> None:
    tasks.sandbox_stopped(allocation_key, ended_ms, message)


@app.task(name="workers.control.sandbox_warned", ignore_result=True)
def sandbox_warned(allocation_key: str, checkpoint: str) -> None:
    tasks.sandbox_warned(allocation_key, checkpoint)


@app.task(name="workers.control.storage_usage", ignore_result=True)
def storage_usage(sandbox_id: int, usage: dict[str, list[Any]]) -> None:
    tasks.storage_usage(sandbox_id, usage)


@app.task(name="workers.control.sandbox_output", ignore_result=True)
def sandbox_output(allocation_key: str, start: int, data_b64: str, total: int) -> None:
    tasks.sandbox_output(allocation_key, start, data_b64, total)


# --- telemetry ---------------------------------------------------------------------------


@app.task(name="workers.control.telemetry_host_rollups", ignore_result=True)
def telemetry_host_rollups(rollups: list[tuple[str, dict[str, Any]]]) -> None:
    """Closed minutes, (host, payload) each: one from a host's agent, a round from a process
    serving many hosts."""
    tasks.telemetry_rollups(rollups)


@app.task(name="workers.control.telemetry_alerts", ignore_result=True)
def telemetry_alerts(host: str, changes: list[dict[str, Any]]) -> None:
    tasks.telemetry_alerts(host, changes)


@app.task(name="workers.control.telemetry_agent_started", ignore_result=True)
def telemetry_agent_started(host: str) -> None:
    tasks.telemetry_agent_started(host)


# --- the control worker's own liveness ------------------------------------------------------

_stop = threading.Event()


@signals.worker_ready.connect
def _start_heartbeat(**_: Any) -> None:
    threading.Thread(target=tasks.beat_forever, args=(_stop,), name="control-heartbeat", daemon=True).start()


@signals.worker_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    _stop.set()


# --- Webhooks, billing and alerts alike (portal.webhooks): the attempt and its record live there.


@app.task(
    bind=True,
    name="workers.control.deliver_webhook",
    ignore_result=True,
    max_retries=None,  # the delivery row counts attempts and gives up after MAX_ATTEMPTS
    soft_time_limit=30,
    time_limit=40,
)
def deliver_webhook(self: Any, delivery_id: int) -> None:
    """One signed POST of a webhook; on failure, retried after the backoff the
    attempt recorded (next_attempt_at), about an hour in all."""
    delay = attempt_delivery(delivery_id)
    if delay is not None:
        raise self.retry(countdown=delay)


@app.task(
    bind=True,
    name="workers.control.email_notifications",
    ignore_result=True,
    max_retries=None,  # send_notification_emails counts attempts and gives up after MAX_ATTEMPTS
    soft_time_limit=100,
    time_limit=120,
)
def email_notifications(self: Any, notification_ids: list[int]) -> None:
    """Mail the notifications whose users chose their kind by email (portal.notifications.emails);
    those the mail server did not take are retried with backoff, about an hour in all."""
    retry = send_notification_emails(notification_ids, attempt=self.request.retries + 1)
    if retry is not None:
        raise self.retry(args=[retry.ids], countdown=retry.delay_s)


@app.task(name="workers.control.sweep_webhooks", ignore_result=True, soft_time_limit=60, time_limit=90)
def sweep_webhooks() -> None:
    """Re-enqueue deliveries whose retry message was lost (a worker died holding it)."""
    webhook_tick(timezone.now())


@app.task(name="workers.control.invoice_tick", ignore_result=True, soft_time_limit=240, time_limit=300)
def invoice_tick_task() -> None:
    """Refresh draft invoices and finalize past months (portal.billing.invoices)."""
    tasks.invoice_tick_task()


@app.task(name="workers.control.purge_idempotency_keys", ignore_result=True)
def purge_idempotency_keys() -> None:
    """API Idempotency-Keys past their 24 h are deleted (a replay after that is a new POST)."""
    tasks.purge_idempotency_keys()
