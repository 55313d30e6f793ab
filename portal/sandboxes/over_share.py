"""A sandbox on a shared GPU that holds more memory than its share: warned, stopped after its
tier's grace, or back within.

A shared GPU's memory is first come, first served: MPS limits bind each client process, not
the sandbox, and time-slicing limits nothing. So the host's agent sums the GPU memory of all
of a sandbox's processes (pid -> cgroup -> sandbox), compares it with the share its launch
spec carries (``wire.spec.MemoryShare``, from ``specs.memory_share``) and reports
``sandbox_over_share`` (``wire.messages.OverShareReport``): ``warn`` when it first sees it
over, ``stop`` once it stayed over for the tier's grace under the stop rule, ``clear`` when it
is back within. Here, the writer of those facts on the sandbox (beside ``actions`` and
``preemption``):

- ``warn``: its page shows the warning, its history records it, its owner is told at once
  (in the portal and, unless they chose otherwise, by email) with the figures and the rule;
- ``stop``: stopped through ``actions.do_request_stop`` with ``StopCause.OVER_SHARE`` and the
  reason in its history and on its page; billed up to the moment its host stops it, as every
  stop is (``transitions.end`` closes the usage interval at the host's stop time);
- ``clear``: the warning is gone from its page, the history says it came back within.

The tier is read as it is now: a ``stop`` for a sandbox whose tier has since been set to warn
only warns. A report about a sandbox that no longer runs there (stopped, moved, another
placement) is ignored quietly; a malformed one is logged and ignored. Never an exception: the
agent's message must not be retried into a loop by a bad field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from portal.catalog.models import OverShare
from portal.durations import duration_text
from portal.sandboxes import actions
from portal.sandboxes.live import sandbox_changed
from portal.sandboxes.models import Notification, Sandbox, SandboxEvent, SandboxState, StopCause
from portal.sandboxes.notify import notify_owner
from portal.sandboxes.transitions import locked
from wire.sizes import human_size

log = logging.getLogger(__name__)
ACTIONS = ("warn", "stop", "clear")


@dataclass(frozen=True)
class Report:
    """An agent's ``OverShareReport``, checked."""

    sandbox_id: int
    allocation_key: str
    gpu: str
    mem_mib: int
    share_mib: int
    since: datetime
    action: str


def parse(report: Any) -> Report | None:
    """The report with every field of the right type, or None."""
    if not isinstance(report, Mapping):
        return None
    try:
        values = {k: report[k] for k in ("sandbox_id", "allocation_key", "gpu", "mem_mib", "share_mib")}
        since_ms, action = report["since_ms"], report["action"]
        numbers = [values["sandbox_id"], values["mem_mib"], values["share_mib"], since_ms]
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers):
            return None
        if not all(isinstance(values[k], str) and values[k] for k in ("allocation_key", "gpu")):
            return None
        if action not in ACTIONS:
            return None
        since = datetime.fromtimestamp(since_ms / 1000, tz=UTC)
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        return None
    return Report(
        values["sandbox_id"], values["allocation_key"], values["gpu"], values["mem_mib"],
        values["share_mib"], min(since, timezone.now()), action,
    )  # fmt: skip


def mib_text(mib: int) -> str:
    return human_size(mib * 1024**2)


def do_over_share(host: str, report: Any) -> str:
    """Act on an agent's report; returns what was done: warned, stopped, cleared or ignored."""
    parsed = parse(report)
    if parsed is None:
        log.warning("over-share report from %s ignored: malformed: %.300r", host, report)
        return "ignored"
    with transaction.atomic():
        sandbox = locked(parsed.sandbox_id)
        if (
            sandbox is None
            or sandbox.state != SandboxState.RUNNING
            or sandbox.allocation_key != parsed.allocation_key
            or sandbox.host is None
            or sandbox.host.name != host
        ):
            # Stopped, moved or placed again since: nothing to warn or stop any more.
            log.debug(
                "over-share report for sandbox %s from %s: not running there, ignored",
                parsed.sandbox_id,
                host,
            )
            return "ignored"
        devices = set(sandbox.allocations.filter(active=True).values_list("device_uuid", flat=True))
        if parsed.gpu not in devices:
            log.warning(
                "over-share report for sandbox %s from %s names %s, not a device it holds: ignored",
                sandbox.pk, host, parsed.gpu,
            )  # fmt: skip
            return "ignored"
        if parsed.action == "clear":
            return _clear(sandbox, parsed)
        if parsed.action == "stop" and sandbox.tier.over_share == OverShare.STOP:
            return _stop(sandbox, parsed)
        return _warn(sandbox, parsed)


def _label(sandbox: Sandbox) -> str:
    return f"Sandbox {sandbox.pk}" + (f" ({sandbox.name})" if sandbox.name else "")


def _record(sandbox: Sandbox, message: str, report: Report) -> None:
    SandboxEvent.objects.create(
        sandbox=sandbox, from_state=sandbox.state, to_state=sandbox.state, message=message[:300],
        data={"gpu": report.gpu, "mem_mib": report.mem_mib, "share_mib": report.share_mib,
              "over_share": report.action},
    )  # fmt: skip


def _warn(sandbox: Sandbox, report: Report) -> str:
    """The owner hears once per time over; a repeated report only updates the figures."""
    first = sandbox.over_share_since is None
    sandbox.over_share_since = sandbox.over_share_since or report.since
    sandbox.over_share_mib, sandbox.memory_share_mib = report.mem_mib, report.share_mib
    sandbox.save(update_fields=["over_share_since", "over_share_mib", "memory_share_mib"])
    if not first:
        return "warned"
    sandbox_changed(sandbox.pk, sandbox.state)  # its page shows the warning without a poll
    held, share = mib_text(report.mem_mib), mib_text(report.share_mib)
    _record(sandbox, f"over its GPU memory share: holds {held} of its {share} on {report.gpu}", report)
    tier = sandbox.tier
    if tier.over_share == OverShare.STOP:
        deadline = sandbox.over_share_since + tier.over_share_grace
        rule = (
            f"under the tier's rule it is stopped after {duration_text(tier.over_share_grace)} "
            f"(at {deadline:%H:%M:%S} UTC) if it stays over: free GPU memory to keep it"
        )
    else:
        rule = "its tier only warns: it keeps running, but its neighbours on the GPU may run out of memory"
    notify_owner(
        sandbox,
        Notification.Kind.OVER_SHARE,
        f"{_label(sandbox)} holds {held} of its {share} share of GPU memory on {report.gpu}; {rule}.",
    )
    return "warned"


def _clear(sandbox: Sandbox, report: Report) -> str:
    if sandbox.over_share_since is None:
        return "cleared"  # never warned here, or cleared already
    sandbox.over_share_since = None
    sandbox.over_share_mib = report.mem_mib
    sandbox.save(update_fields=["over_share_since", "over_share_mib"])
    sandbox_changed(sandbox.pk, sandbox.state)
    _record(
        sandbox,
        f"back within its GPU memory share: {mib_text(report.mem_mib)} of {mib_text(report.share_mib)}",
        report,
    )
    return "cleared"


def _stop(sandbox: Sandbox, report: Report) -> str:
    since = sandbox.over_share_since or report.since  # its warning may have been lost
    over_for = max(timezone.now() - since, timedelta(0))
    sandbox.over_share_since = since
    sandbox.over_share_mib, sandbox.memory_share_mib = report.mem_mib, report.share_mib
    sandbox.save(update_fields=["over_share_since", "over_share_mib", "memory_share_mib"])
    reason = (
        f"stopped: held {mib_text(report.mem_mib)}, over its {mib_text(report.share_mib)} GPU memory share "
        f"on {report.gpu} for {duration_text(int(over_for.total_seconds()))} (tier {sandbox.tier.name})"
    )
    log.info("sandbox %s %s", sandbox.pk, reason)
    notify_owner(sandbox, Notification.Kind.OVER_SHARE, f"{_label(sandbox)} was {reason}.")
    actions.do_request_stop(sandbox.pk, None, reason, cause=StopCause.OVER_SHARE)
    return "stopped"
