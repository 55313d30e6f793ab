"""Tasks on the ``control`` queue: the only worker that changes fleet state (uses the ORM).

Agents report here; every task takes plain JSON, returns quietly when its row is gone,
and is idempotent because the ``actions`` it calls are.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta
from typing import Any

import django
import redis
from celery import signals

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from portal.fleet.health import do_health_event  # noqa: E402
from portal.fleet.inventory import do_heartbeat, do_sync_inventory  # noqa: E402
from portal.fleet.models import Gpu, Host  # noqa: E402
from portal.fleet.plans import auto_relayout, do_plan_report, expire_stale_plans  # noqa: E402
from portal.fleet.reconcile import do_reconcile_host, from_ms  # noqa: E402
from portal.sandboxes import actions  # noqa: E402
from portal.sandboxes.culling import do_cull_idle  # noqa: E402
from portal.sandboxes.models import Sandbox, SandboxState  # noqa: E402
from portal.sandboxes.output import do_store_output  # noqa: E402
from portal.sandboxes.scheduling import HOLDING, schedule_once  # noqa: E402
from portal.telemetry.alerts import (  # noqa: E402
    alert_policy,
    do_close_host_alerts,
    do_record_alerts,
    note_delivery,
    signature,
    webhook_body,
)
from portal.telemetry.alerts import secret as alert_secret  # noqa: E402
from portal.telemetry.models import Alert  # noqa: E402
from portal.telemetry.rollups import do_purge_rollups, do_store_rollups  # noqa: E402
from workers import dispatch, liveness  # noqa: E402
from workers.celery import app  # noqa: E402
from workers.config import CONTROL_HEARTBEAT_KEY  # noqa: E402

log = logging.getLogger(__name__)
CYCLE_LOCK = "gpushare:lock:scheduling-cycle"
MISSED_BEATS_LOST = 3


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


@app.task(name="workers.control.schedule_cycle", ignore_result=True)
def schedule_cycle() -> None:
    """Run one cycle unless another worker is running one (it will see our queue too).

    On PostgreSQL ``schedule_once`` alone decides, with a transaction-scoped advisory lock:
    it costs a second worker one query, and it dies with a killed worker's connection. A
    Redis lock in front of it would outlive a worker killed mid-cycle and hold every cycle
    off until it expired (60 s), which the fault tests saw. Other databases (SQLite in the
    embedded deployment, one control process with a thread pool) have no such lock, so a
    Redis one serialises the cycles there."""
    if connection.vendor == "postgresql":
        schedule_once(time.time())
        return
    lock = _redis().lock(CYCLE_LOCK, timeout=60, blocking=False)
    if not lock.acquire():
        return
    try:
        schedule_once(time.time())
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:  # expired meanwhile: the cycle committed all the same
            log.warning("the scheduling cycle outlived its Redis lock (%s s)", lock.timeout)


@app.task(name="workers.control.tick", ignore_result=True)
def tick() -> None:
    """Periodic: mark silent hosts lost, retry stuck launches, give up silent plans, reshape
    MIG GPUs for requests no instance fits, warn and stop idle sandboxes and those at their
    time limit, run a cycle."""
    mark_lost_hosts(timezone.now())
    resend_stuck_placements(timezone.now())
    expire_stale_plans(timezone.now())
    auto_relayout()
    do_cull_idle(timezone.now())
    actions.do_expire_overdue(timezone.now())
    purge_telemetry(timezone.now())
    schedule_cycle()


def purge_telemetry(now: datetime) -> None:
    """Rollups past the retention, at most once an hour whatever the number of workers."""
    if _redis().set("gpushare:telemetry:purged", int(now.timestamp()), nx=True, ex=3600):
        do_purge_rollups(now)


def mark_lost_hosts(now: datetime) -> int:
    """A host silent for MISSED_BEATS_LOST heartbeats is lost: its GPUs become unavailable
    and its sandboxes are lost with it (failed, or requeued when their tier says so). If
    it comes back, reconciliation stops the copies it still runs."""
    cutoff = now - timedelta(seconds=settings.AGENT_HEARTBEAT_S * MISSED_BEATS_LOST)
    silent = list(
        Host.objects.filter(state=Host.State.UP, last_heartbeat_at__lt=cutoff).values_list("name", flat=True)
    )
    if not silent:
        return 0
    try:  # beats still queued behind this tick (see workers/liveness.py)
        beating = liveness.alive_since(_redis(), silent, int(cutoff.timestamp() * 1000))
    except redis.RedisError as exc:
        log.warning("agent liveness unreadable, judging hosts by the database alone: %s", exc)
        beating = set()
    for name in sorted(beating):
        log.info("host %s: no heartbeat processed lately, but its agent beats: not lost", name)
    with transaction.atomic():
        lost = list(
            Host.objects.select_for_update().filter(
                state=Host.State.UP, last_heartbeat_at__lt=cutoff, name__in=set(silent) - beating
            )
        )
        for host in lost:
            log.warning("host %s missed %d heartbeats: marked lost", host.name, MISSED_BEATS_LOST)
            host.state = Host.State.LOST
            host.save(update_fields=["state"])
            Gpu.objects.filter(host=host, state=Gpu.State.AVAILABLE).update(state=Gpu.State.UNAVAILABLE)
            # In the host's transaction: nobody sees a lost host whose sandboxes still run
            # (and bill), and a crash here leaves the host up, to be judged again next tick.
            on_host = Sandbox.objects.filter(host=host, state__in=HOLDING).values_list("pk", flat=True)
            for sandbox_id in list(on_host):
                actions.do_lose(
                    sandbox_id, f"host {host.name} lost (missed {MISSED_BEATS_LOST} heartbeats)", now
                )
    return len(lost)


def resend_stuck_placements(now: datetime) -> None:
    """A sandbox left in ``placing`` (the broker was down after commit) is sent again."""
    stuck = Sandbox.objects.filter(state=SandboxState.PLACING, placed_at__lt=now - timedelta(seconds=10))
    for sandbox_id in stuck.values_list("pk", flat=True):
        actions.do_send_launch(sandbox_id)


@app.task(name="workers.control.agent_heartbeat", ignore_result=True)
def agent_heartbeat(
    host: str,
    t_ms: int,
    backend: str,
    driver: str,
    owned: list[dict[str, Any]] | None = None,
    owned_ms: int | None = None,
    alerts_version: str | None = None,
) -> None:
    """A beat, with the agent's report of what it runs (listed from ``owned_ms``): the
    database is repaired to match. An agent holding other alert thresholds than the
    current ones (or none yet) is sent them."""
    was = Host.objects.filter(name=host).values_list("state", flat=True).first()
    if not do_heartbeat(host, from_ms(t_ms), backend, driver):
        log.warning("heartbeat from unknown host %s ignored (no inventory yet)", host)
        return
    if was == Host.State.LOST:
        # Back from lost: its GPUs were made unavailable; the agent's inventory says which
        # are really there.
        log.warning("host %s is back: asking for its inventory", host)
        dispatch.to_host(host, "report_inventory")
    if owned is not None:
        do_reconcile_host(host, from_ms(owned_ms or t_ms), owned)
    if alerts_version is not None:
        policy = alert_policy()
        if policy["version"] != alerts_version:
            dispatch.to_host(host, "set_alert_policy", policy)


@app.task(name="workers.control.agent_inventory", ignore_result=True)
def agent_inventory(
    host: str, backend: str, driver: str, gpus: list[dict[str, Any]], facts: dict[str, int] | None = None
) -> None:
    do_sync_inventory(host, backend, driver, gpus, facts)
    do_heartbeat(host, timezone.now(), backend, driver)


@app.task(name="workers.control.gpu_health", ignore_result=True)
def gpu_health(host: str, events: list[dict[str, Any]]) -> None:
    """Faults an agent saw (XID, double-bit ECC, GPU lost, overheat): the GPU is drained."""
    for event in events:
        do_health_event(host, event)


@app.task(name="workers.control.plan_executed", ignore_result=True)
def plan_executed(
    plan_id: int,
    host: str,
    results: list[dict[str, Any]],
    mig_steps: list[dict[str, Any]],
    error: str,
    inventory: dict[str, Any] | None,
) -> None:
    """A host's part of a fleet plan is done: sandboxes stopped, MIG layout changed."""
    do_plan_report(plan_id, host, results, mig_steps, error, inventory)


@app.task(name="workers.control.sandbox_launched", ignore_result=True)
def sandbox_launched(allocation_key: str, handle: dict[str, Any], started_ms: int) -> None:
    actions.do_mark_running(allocation_key, handle, from_ms(started_ms))


@app.task(name="workers.control.sandbox_launch_failed", ignore_result=True)
def sandbox_launch_failed(sandbox_id: int, allocation_key: str, message: str) -> None:
    log.warning("launch of sandbox %s (%s) failed: %s", sandbox_id, allocation_key, message)
    actions.do_fail(sandbox_id, f"launch failed: {message}")


@app.task(name="workers.control.sandbox_stopped", ignore_result=True)
def sandbox_stopped(allocation_key: str, ended_ms: int, message: str = "stopped") -> None:
    actions.do_mark_stopped(allocation_key, from_ms(ended_ms), message)


@app.task(name="workers.control.sandbox_output", ignore_result=True)
def sandbox_output(allocation_key: str, start: int, data_b64: str, total: int) -> None:
    """A piece of a batch's output (workers/batch_output.py), kept for its owner."""
    do_store_output(allocation_key, int(start), base64.b64decode(data_b64), int(total))


# --- telemetry ---------------------------------------------------------------------------


@app.task(name="workers.control.telemetry_rollups", ignore_result=True)
def telemetry_rollups(host: str, payload: dict[str, Any]) -> None:
    do_store_rollups(host, payload)


@app.task(name="workers.control.telemetry_alerts", ignore_result=True)
def telemetry_alerts(host: str, changes: list[dict[str, Any]]) -> None:
    do_record_alerts(host, changes)


@app.task(name="workers.control.telemetry_agent_started", ignore_result=True)
def telemetry_agent_started(host: str) -> None:
    closed = do_close_host_alerts(host, "agent restarted")
    if closed:
        log.info(
            "agent %s restarted: %d open alerts closed (it raises again what is still true)", host, closed
        )


class WebhookFailed(Exception):
    pass


@app.task(
    name="workers.control.deliver_alert_webhook",
    ignore_result=True,
    autoretry_for=(WebhookFailed,),
    retry_backoff=5,
    retry_backoff_max=900,
    retry_jitter=True,
    max_retries=8,
)
def deliver_alert_webhook(alert_id: int, state: str, url: str) -> None:
    """POST the alert, signed; a failure (network, non-2xx) retries with backoff, about an
    hour in all, and the alert shows the last outcome."""
    alert = Alert.objects.select_related("host", "gpu").filter(pk=alert_id).first()
    if alert is None or not url.startswith(("http://", "https://")):
        return
    body = webhook_body(alert, state)
    headers = {"Content-Type": "application/json", "User-Agent": "gpushare-alerts"}
    if alert_secret():
        headers["X-Gpushare-Signature"] = signature(body, alert_secret())
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310 - scheme checked
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - scheme checked
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError) as exc:
        note_delivery(alert_id, f"{state}: {url} unreachable ({exc})")
        log.warning("alert webhook %s for alert %s failed: %s", url, alert_id, exc)
        raise WebhookFailed(str(exc)) from exc
    note_delivery(alert_id, f"{state}: {url} answered {status}")
    if not 200 <= status < 300:
        log.warning("alert webhook %s for alert %s answered %s", url, alert_id, status)
        raise WebhookFailed(f"HTTP {status}")


def _beat_forever(stop: threading.Event) -> None:
    """The control worker's own liveness, read by /healthz."""
    client = _redis()
    while not stop.is_set():
        try:
            client.set(CONTROL_HEARTBEAT_KEY, int(time.time() * 1000), ex=15)
        except redis.RedisError as exc:
            log.warning("control heartbeat not written: %s", exc)
        stop.wait(2)


_stop = threading.Event()


@signals.worker_ready.connect
def _start_heartbeat(**_: Any) -> None:
    threading.Thread(target=_beat_forever, args=(_stop,), name="control-heartbeat", daemon=True).start()


@signals.worker_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    _stop.set()


# --- Billing webhooks (portal.billing.webhooks): the attempt and its record live there.


@app.task(
    bind=True,
    name="workers.control.deliver_webhook",
    ignore_result=True,
    max_retries=None,  # the delivery row counts attempts and gives up after MAX_ATTEMPTS
    soft_time_limit=30,
    time_limit=40,
)
def deliver_webhook(self: Any, delivery_id: int) -> None:
    """One signed POST of a billing webhook; on failure, retried after the backoff the
    attempt recorded (next_attempt_at), about an hour in all."""
    from portal.billing.webhooks import attempt_delivery

    delay = attempt_delivery(delivery_id)
    if delay is not None:
        raise self.retry(countdown=delay)


@app.task(name="workers.control.sweep_webhooks", ignore_result=True, soft_time_limit=60, time_limit=90)
def sweep_webhooks() -> None:
    """Re-enqueue deliveries whose retry message was lost (a worker died holding it)."""
    from portal.billing.webhooks import webhook_tick

    webhook_tick(timezone.now())


@app.task(name="workers.control.invoice_tick", ignore_result=True, soft_time_limit=240, time_limit=300)
def invoice_tick_task() -> None:
    """Refresh draft invoices and finalize past months (portal.billing.invoices)."""
    from portal.billing.invoices import invoice_tick

    invoice_tick(timezone.now())


@app.task(name="workers.control.purge_idempotency_keys", ignore_result=True)
def purge_idempotency_keys() -> None:
    """API Idempotency-Keys past their 24 h are deleted (a replay after that is a new POST)."""
    from portal.accounts.idempotency import delete_expired_keys

    delete_expired_keys()
