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
import time
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction

from portal.control.reconcile import do_reconcile_host, from_ms, needs_reconciling
from portal.control.redis_client import client as redis_client
from portal.fleet import actions as fleet_actions
from portal.fleet.inventory import do_heartbeats
from portal.fleet.models import Host, HostCredential
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox, SandboxState
from portal.scheduling.snapshot import HOLDING
from portal.telemetry import control_figures
from portal.telemetry.alerts import alert_policy
from wire import liveness
from wire.liveness import Beat
from wire.messages import to_host

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
    try:  # beats still queued behind this tick (see wire/liveness.py)
        beating = liveness.alive_since(redis_client(), silent, int(cutoff.timestamp() * 1000))
    except redis.RedisError as exc:
        log.warning("agent liveness unreadable, judging hosts by the database alone: %s", exc)
        beating = set()
    # A revoked host's beats are dropped unread (portal.control.provenance): its liveness key,
    # which its agent writes itself (through the control plane's Redis URL, where the Redis
    # has no per-host users), says nothing about beats still to come.
    beating -= set(
        HostCredential.objects.filter(host__in=beating, pool=False, revoked_at__isnull=False).values_list(
            "host", flat=True
        )
    )
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


# The alert thresholds last sent to each host's agent, and when (monotonic): an agent whose
# queue is behind beats with its old version for a while, and each beat sent the policy
# again, six copies per host queued behind one another at the openb size.
_policy_sent: dict[str, tuple[str, float]] = {}
POLICY_RESEND_S = 60.0


def _policy_due(host: str, version: str) -> bool:
    sent = _policy_sent.get(host)
    now = time.monotonic()
    if sent is not None and sent[0] == version and now - sent[1] < POLICY_RESEND_S:
        return False
    _policy_sent[host] = (version, now)
    return True


def agent_heartbeats(beats: list[Beat]) -> None:
    """Beats from one agent process: one for a real host, one a round for each host of a
    process serving many simulated ones. Each beat with a report of what its host runs
    (listed at ``owned_ms``) has the database repaired to match; the rest only say the host
    is alive, which costs one UPDATE per round however many hosts beat. A host back from
    lost is asked for its inventory; an agent holding other alert thresholds than the current
    ones (or none yet) is sent them."""
    groups: dict[tuple[int, str, str], list[str]] = defaultdict(list)
    for beat in beats:
        groups[(beat["t_ms"], beat["backend"], beat["driver"])].append(beat["host"])
    known: set[str] = set()
    for (t_ms, backend, driver), names in groups.items():
        outcome = do_heartbeats(names, from_ms(t_ms), backend, driver)
        known |= outcome.known
        for host in outcome.regained:
            # Back from lost: its GPUs were made unavailable; the agent's inventory says
            # which are really there.
            log.warning("host %s is back: asking for its inventory", host)
            to_host(host).report_inventory()
    policy: dict[str, Any] | None = None
    oldest_ms = min((beat["t_ms"] for beat in beats), default=None)
    reports = {
        beat["host"]: beat["owned"] for beat in beats if beat["owned"] is not None and beat["host"] in known
    }
    to_reconcile = needs_reconciling(reports)
    for beat in beats:
        host = beat["host"]
        if host not in known:
            log.warning("heartbeat from unknown host %s ignored (no inventory yet)", host)
            continue
        if beat["owned"] is not None and host in to_reconcile:
            do_reconcile_host(host, from_ms(beat["owned_ms"] or beat["t_ms"]), beat["owned"])
        if beat["alerts_version"] is not None:
            policy = policy or alert_policy()
            if policy["version"] != beat["alerts_version"] and _policy_due(host, policy["version"]):
                to_host(host).set_alert_policy(policy)
    if oldest_ms is not None:
        now_ms = int(time.time() * 1000)
        control_figures.record(redis_client(), control_figures.HEARTBEAT_LAG, now_ms, now_ms - oldest_ms)
