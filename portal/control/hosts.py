"""Hosts and their agents: heartbeats and inventories applied, silent hosts lost, stuck
launches sent again.

A host silent for ``MISSED_BEATS_LOST`` heartbeats is lost (``portal.fleet.actions``: its
GPUs become unavailable, a fleet event each) and its sandboxes are lost with it: failed,
or requeued when their tier says so. When it beats again it is back up, and its agent is
asked for its inventory, which says which GPUs are really there; reconciliation
(``portal.control.reconcile``) stops the copies it still runs.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction

from portal.control.reconcile import do_reconcile_host
from portal.control.redis_client import client as redis_client
from portal.fleet import actions as fleet_actions
from portal.fleet.inventory import do_heartbeat
from portal.fleet.models import Host
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox, SandboxState
from portal.sandboxes.snapshot import HOLDING
from portal.telemetry.alerts import alert_policy
from workers import dispatch, liveness

log = logging.getLogger(__name__)
MISSED_BEATS_LOST = 3
PLACING_RESEND_S = 10


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
        beating = liveness.alive_since(redis_client(), silent, int(cutoff.timestamp() * 1000))
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
            why = f"host {host.name} lost (missed {MISSED_BEATS_LOST} heartbeats)"
            log.warning("host %s missed %d heartbeats: marked lost", host.name, MISSED_BEATS_LOST)
            fleet_actions.lose_host(host, why)
            # In the host's transaction: nobody sees a lost host whose sandboxes still run
            # (and bill), and a crash here leaves the host up, to be judged again next tick.
            on_host = Sandbox.objects.filter(host=host, state__in=HOLDING).values_list("pk", flat=True)
            for sandbox_id in list(on_host):
                actions.do_lose(sandbox_id, why, now)
    return len(lost)


def resend_stuck_placements(now: datetime) -> None:
    """A sandbox left in ``placing`` (the broker was down after commit) is sent again."""
    stuck = Sandbox.objects.filter(
        state=SandboxState.PLACING, placed_at__lt=now - timedelta(seconds=PLACING_RESEND_S)
    )
    for sandbox_id in stuck.values_list("pk", flat=True):
        actions.do_send_launch(sandbox_id)


def agent_heartbeat(
    host: str,
    at: datetime,
    backend: str,
    driver: str,
    owned: list[dict[str, Any]] | None,
    owned_at: datetime,
    alerts_version: str | None,
) -> None:
    """A beat, with the agent's report of what it runs (listed at ``owned_at``): the
    database is repaired to match. A host back from lost is asked for its inventory. An
    agent holding other alert thresholds than the current ones (or none yet) is sent them."""
    was = Host.objects.filter(name=host).values_list("state", flat=True).first()
    if not do_heartbeat(host, at, backend, driver):
        log.warning("heartbeat from unknown host %s ignored (no inventory yet)", host)
        return
    if was == Host.State.LOST:
        # Back from lost: its GPUs were made unavailable; the agent's inventory says which
        # are really there.
        log.warning("host %s is back: asking for its inventory", host)
        dispatch.to_host(host, "report_inventory")
    if owned is not None:
        do_reconcile_host(host, owned_at, owned)
    if alerts_version is not None:
        policy = alert_policy()
        if policy["version"] != alerts_version:
            dispatch.to_host(host, "set_alert_policy", policy)
