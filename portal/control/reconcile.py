"""Keeping the database's picture of a host true to what its agent actually runs.

Every heartbeat carries the agent's report: each sandbox its driver owns (found by labels
or names, so the report survives an agent restart) with its state. ``do_reconcile_host``
compares that with the sandboxes the database places on the host and repairs the drift:

- owned but unknown, ended, or of an old allocation: an **orphan**, stopped;
- owned and running while the database still says ``placing``/``starting``: the launch
  report was lost (the agent died after launching), so it is marked running now;
- owned and exited while the database says running: it ended by itself; recorded with the
  driver's reason (exit code, out of memory);
- running in the database but absent from a report taken after it started: it
  **vanished** (removed behind the platform's back), so it is lost: failed, or requeued
  when its tier says so;
- ``starting`` for longer than ``LAUNCH_RESEND_S`` and absent: the launch message was
  lost with a killed agent, so it is sent again (launch is idempotent);
- owned but not tracked by the agent (it restarted): the agent is told to adopt it.

A sandbox a defragmentation plan is moving is left alone: the plan stops it on purpose,
and its report (``portal.control.plans``) relaunches it.

Decisions are computed under row locks and each repair goes through ``actions``; messages
to agents leave after commit. A report is a snapshot: anything that changed state after
it was taken is left for the next one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction

from portal.fleet.models import Host
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox, SandboxState
from wire.liveness import OwnedSandbox
from wire.messages import to_host
from wire.spec import HandleJson, renamed

log = logging.getLogger(__name__)
S = SandboxState
# The states in which the database says a sandbox is on its host: what a report must list.
ON_HOST = (S.RUNNING, S.STARTING, S.STOPPING)
LAUNCH_RESEND_S = 15
STOP_RESEND_S = 30  # beyond any stop grace period
ENDED = (S.STOPPED, S.FAILED, S.PREEMPTED, S.EXPIRED)


@dataclass
class Repairs:
    """What one reconciliation did, for logs and tests."""

    orphans_stopped: list[str] = field(default_factory=list)
    marked_running: list[int] = field(default_factory=list)
    exited: list[int] = field(default_factory=list)
    vanished: list[int] = field(default_factory=list)
    launches_resent: list[int] = field(default_factory=list)
    adopted: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(vars(self).values())


def exit_message(entry: dict[str, Any]) -> str:
    reason = entry.get("reason")
    code = entry.get("exit_code")
    if reason:
        return f"exited: {reason}" + (f" (exit code {code})" if code is not None else "")
    return f"exited with code {code}" if code is not None else "exited"


def needs_reconciling(reports: dict[str, list[OwnedSandbox]]) -> set[str]:
    """The hosts whose report (host -> what it runs) may differ from the database: any that
    lists a sandbox, and those listing none that the database has sandboxes on. One query:
    a fleet's first round of beats, every host's first report and nearly all empty, was
    a reconcile of two or more statements a host, and held the next beats back."""
    listing = {host for host, owned in reports.items() if owned}
    empty = [host for host, owned in reports.items() if not owned]
    if not empty:
        return listing
    held = Sandbox.objects.filter(host__name__in=empty, state__in=ON_HOST).values_list(
        "host__name", flat=True
    )
    return listing | set(held.distinct())


def do_reconcile_host(host_name: str, taken_at: datetime, owned_report: list[OwnedSandbox]) -> Repairs:
    """Repair the drift between ``owned`` (the agent's report at ``taken_at``) and the database."""
    repairs = Repairs()
    host = Host.objects.filter(name=host_name).first()
    if host is None:
        return repairs
    owned = [renamed(entry) for entry in owned_report]  # an agent not yet upgraded says allocation_id
    by_key = {entry["allocation_key"]: entry for entry in owned}
    sandboxes = {
        s.allocation_key: s
        for s in Sandbox.objects.filter(allocation_key__in=list(by_key)).select_related("host")
    }
    utilization: list[tuple[int, Any]] = []
    for key, entry in by_key.items():
        sandbox = sandboxes.get(key)
        if sandbox is not None and sandbox.moving_plan_id is not None:
            continue  # a plan is stopping and moving it: its report says what became of it
        _reconcile_owned(host, key, entry, sandbox, taken_at, repairs, utilization)
    _store_utilization(utilization, taken_at)
    placed = Sandbox.objects.filter(
        host=host,
        state__in=ON_HOST,
        placed_at__lt=taken_at,
        moving_plan__isnull=True,
    ).exclude(allocation_key__in=list(by_key))
    for sandbox in placed:
        if sandbox.state == S.STOPPING:
            if sandbox.stop_requested_at and sandbox.stop_requested_at < taken_at:
                # Gone from the host while being stopped (the agent died before reporting).
                actions.do_mark_stopped(sandbox.allocation_key, taken_at, "stopped (gone from the host)")
                repairs.exited.append(sandbox.pk)
        elif sandbox.state == S.RUNNING and sandbox.started_at and sandbox.started_at < taken_at:
            reason = f"vanished: the sandbox is no longer on host {host.name}"
            log.warning("sandbox %s (%s) %s", sandbox.pk, sandbox.allocation_key, reason)
            actions.do_lose(sandbox.pk, reason, taken_at)
            repairs.vanished.append(sandbox.pk)
        elif sandbox.state == S.STARTING and _launch_overdue(sandbox, taken_at):
            log.warning("sandbox %s: no sandbox on %s yet, launch sent again", sandbox.pk, host.name)
            actions.do_resend_launch(sandbox.pk)
            repairs.launches_resent.append(sandbox.pk)
    if repairs:
        log.info("reconciled host %s: %s", host.name, repairs)
    return repairs


def _stop_overdue(sent_at: datetime | None, taken_at: datetime) -> bool:
    """A stop sent at ``sent_at`` should have been carried out by a report at ``taken_at``."""
    return sent_at is not None and sent_at < taken_at - timedelta(seconds=STOP_RESEND_S)


def _reconcile_owned(
    host: Host,
    key: str,
    entry: dict[str, Any],
    sandbox: Sandbox | None,
    taken_at: datetime,
    repairs: Repairs,
    utilization: list[tuple[int, Any]],
) -> None:
    running = entry.get("state") == "running"
    if (
        sandbox is not None
        and not running
        and sandbox.state in ENDED
        and sandbox.host_id == host.pk
        and not _stop_overdue(sandbox.ended_at, taken_at)
    ):
        # An exited run whose end was recorded moments ago: the clean-up stop went with it
        # (below) and the agent has not carried it out yet. Not an orphan; once the stop is
        # overdue it is one, and is stopped again.
        return
    if sandbox is not None and sandbox.state in ENDED and sandbox.ended_at and taken_at < sandbox.ended_at:
        # The listing predates the end (a report goes out with the next beat, up to a beat
        # after it was taken): it shows the sandbox as it was, not an orphan. Every stop
        # through the portal was called one, and stopped a second time, a beat later.
        return
    if sandbox is None or sandbox.state in (*ENDED, S.QUEUED) or sandbox.host_id != host.pk:
        # Nothing in the database owns it (any more): stop it and free the GPU.
        log.warning("orphan sandbox %s on %s: stopping it", key, host.name)
        _stop_after_commit(host.name, key, int(entry.get("sandbox_id") or 0), entry.get("handle"))
        repairs.orphans_stopped.append(key)
        return
    if entry.get("state") == "created":
        # A launch died between making the sandbox and starting it: launching again
        # finishes it (once the launch is overdue, as for a launch that left nothing).
        if sandbox.state == S.STARTING and _launch_overdue(sandbox, taken_at):
            actions.do_resend_launch(sandbox.pk)
            repairs.launches_resent.append(sandbox.pk)
        return
    if running and sandbox.state in (S.PLACING, S.STARTING):
        started_ms = entry.get("started_at_ms") or int(taken_at.timestamp() * 1000)
        if sandbox.state == S.PLACING:
            actions.do_send_launch(sandbox.pk)  # PLACING -> STARTING, the launch is a no-op
        actions.do_mark_running(key, entry.get("handle") or {}, from_ms(started_ms))
        repairs.marked_running.append(sandbox.pk)
    elif not running and sandbox.state in (S.RUNNING, S.STARTING):
        # When it ended, where its engine keeps that (Slurm's accounting), else when it was seen.
        ended = from_ms(entry["ended_at_ms"]) if entry.get("ended_at_ms") else taken_at
        actions.do_mark_stopped(key, min(ended, taken_at), exit_message(entry))
        # The agent keeps an exited sandbox until told to stop it: clean it up now.
        _stop_after_commit(host.name, key, sandbox.pk, entry.get("handle"))
        repairs.exited.append(sandbox.pk)
    elif sandbox.state == S.STOPPING:
        if _stop_overdue(sandbox.stop_requested_at, taken_at):
            log.warning("sandbox %s still on %s after its stop: stop sent again", sandbox.pk, host.name)
            _stop_after_commit(host.name, key, sandbox.pk, entry.get("handle"))
            repairs.orphans_stopped.append(key)
    elif running and sandbox.state == S.RUNNING and not entry.get("tracked", True):
        actions.do_resend_launch(sandbox.pk, adopt=True)
        repairs.adopted.append(sandbox.pk)
    elif running and sandbox.state == S.RUNNING and entry.get("util"):
        utilization.append((sandbox.pk, entry["util"]))


MEASURED = ["gpu_util_pct", "gpu_util_window_s", "gpu_util_at"]


def _store_utilization(readings: list[tuple[int, Any]], taken_at: datetime) -> None:
    """Not a repair: the utilization windows the agent keeps (for idle culling, the sandbox
    page and /metrics), one statement for all of a report's sandboxes: an UPDATE each was
    most of a beat's writes (BENCHMARKS.md, heartbeats at the cluster's size).

    util_pct None: the window measured nothing (a MIG device NVML cannot measure without
    GPM). Stored as None, which culling skips; an idle streak does not run through it."""
    measured, unmeasured = [], []
    for pk, (util_pct, window_s) in readings:
        row = Sandbox(pk=pk, gpu_util_pct=util_pct, gpu_util_window_s=window_s, gpu_util_at=taken_at)
        if util_pct is None:
            row.idle_since = row.idle_warned_at = None
            unmeasured.append(row)
        else:
            measured.append(row)
    if measured:
        Sandbox.objects.bulk_update(measured, MEASURED)
    if unmeasured:
        Sandbox.objects.bulk_update(unmeasured, [*MEASURED, "idle_since", "idle_warned_at"])


def _launch_overdue(sandbox: Sandbox, taken_at: datetime) -> bool:
    """No sandbox LAUNCH_RESEND_S after the launch was last sent (placed, or resent)."""
    last_resend = (
        sandbox.events.filter(message=actions.LAUNCH_RESENT)
        .order_by("-at")
        .values_list("at", flat=True)
        .first()
    )
    # A host still reporting its launch's progress (a long image pull) is not sent it again.
    sent = max(filter(None, (sandbox.placed_at, last_resend, sandbox.launch_progress_at)), default=None)
    return sent is not None and sent < taken_at - timedelta(seconds=LAUNCH_RESEND_S)


def _stop_after_commit(host_name: str, key: str, sandbox_id: int, handle: HandleJson | None) -> None:
    transaction.on_commit(lambda: to_host(host_name).stop_sandbox(key, sandbox_id, handle))


def from_ms(t_ms: int) -> datetime:
    """Epoch milliseconds, as agents report times, to an aware datetime."""
    return datetime.fromtimestamp(t_ms / 1000, tz=UTC)
