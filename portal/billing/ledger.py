"""Opening and closing usage intervals (called only from ``portal.sandboxes.actions``,
inside its transaction, with the sandbox row locked; closing one emits ``usage.closed``
through ``portal.webhooks`` in that transaction), and what usage had cost by a given
moment: the one place a running cost is computed (GPU hosts compute none).

An interval prices what it holds: ``price x billed_milli / 1000 x hours``. A GPU sandbox's
``billed_milli`` is its GPUs held (``milli_gpu``); a CPU-only sandbox holds no GPU
(``milli_gpu`` 0, so it adds nothing to GPU-hour quotas or fair share) and is charged its
tier's price per hour of the sandbox (``billed_milli`` 1000): it still occupies a host's
CPU and memory, and an operator bills that as a cloud bills a CPU instance, by the hour.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from portal.billing.models import UsageRecord, cost_micros
from portal.webhooks.deliveries import emit
from portal.webhooks.models import WebhookEvent

if TYPE_CHECKING:
    from portal.sandboxes.models import Sandbox

_MICROSECOND = timedelta(microseconds=1)
_ZERO = timedelta(0)
ONE_SANDBOX = 1000  # what a CPU-only interval is charged on: one sandbox, in thousandths
# What running_cost_micros reads of a record: what a query for costing loads (``only``).
COSTED_FIELDS = (
    "price_per_gpu_hour_micros", "milli_gpu", "billed_milli", "started_at", "ended_at", "cost_micros",
)  # fmt: skip


def open_interval(sandbox: Sandbox, started_at: datetime) -> UsageRecord:
    existing = UsageRecord.objects.filter(
        allocation_key=sandbox.allocation_key, ended_at__isnull=True
    ).first()
    if existing is not None:
        return existing  # idempotent: one open interval per allocation
    allocations = list(sandbox.allocations.filter(active=True).select_related("gpu"))
    tier = sandbox.tier
    milli_gpu = sum(a.milli_gpu for a in allocations)
    return UsageRecord.objects.create(
        sandbox=sandbox,
        allocation_key=sandbox.allocation_key,
        project_id=sandbox.project_id,
        user_id=sandbox.owner_id,
        tier=tier,
        gpu_model=allocations[0].gpu.model if allocations else "",
        milli_gpu=milli_gpu,
        billed_milli=ONE_SANDBOX if tier.cpu_only else milli_gpu,
        price_per_gpu_hour_micros=tier.price_per_gpu_hour_micros,
        currency=tier.currency,
        started_at=started_at,
    )


def close_interval(sandbox: Sandbox, ended_at: datetime) -> UsageRecord | None:
    record = UsageRecord.objects.filter(allocation_key=sandbox.allocation_key, ended_at__isnull=True).first()
    if record is None:
        return None
    ended_at = max(ended_at, record.started_at)
    duration = ended_at - record.started_at
    duration_us = duration // _MICROSECOND
    record.ended_at = ended_at
    record.duration = duration
    record.cost_micros = cost_micros(record.price_per_gpu_hour_micros, record.priced_milli, duration_us)
    record.save(update_fields=["ended_at", "duration", "cost_micros"])
    # Keyed by the record: a record closes once, so does its event.
    emit(WebhookEvent.USAGE_CLOSED, usage_payload(record), record.project_id, key=f"usage.closed:{record.pk}")
    return record


def usage_payload(record: UsageRecord) -> dict[str, Any]:
    """The ``usage.closed`` webhook's data."""
    return {
        "usage_record_id": record.pk,
        "sandbox_id": record.sandbox_id,
        "project_id": record.project_id,
        "user_id": record.user_id,
        "tier_id": record.tier_id,
        "gpu_model": record.gpu_model,
        "milli_gpu": record.milli_gpu,
        "billed_milli": record.priced_milli,
        "started_at": record.started_at.isoformat(),
        "ended_at": record.ended_at.isoformat() if record.ended_at else None,
        "duration_seconds": record.duration.total_seconds() if record.duration is not None else None,
        "price_per_gpu_hour_micros": record.price_per_gpu_hour_micros,
        "cost_micros": record.cost_micros,
        "currency": record.currency,
    }


def running_cost_micros(record: UsageRecord, at: datetime) -> int:
    """What ``record`` had cost by ``at``: its priced cost once it has ended, else its price
    for the time from its start to ``at`` (0 before it starts). The one place a cost so far
    is computed: the sandbox page, its live stream and chart history, and /metrics."""
    if record.ended_at is not None and record.cost_micros is not None and at >= record.ended_at:
        return record.cost_micros
    until = at if record.ended_at is None else min(at, record.ended_at)
    duration_us = max(until - record.started_at, _ZERO) // _MICROSECOND
    return cost_micros(record.price_per_gpu_hour_micros, record.priced_milli, duration_us)


def sandbox_usage(sandbox_id: int | str) -> list[UsageRecord]:
    """A sandbox's usage intervals, oldest first, with what ``cost_by`` reads and no more."""
    records = UsageRecord.objects.filter(sandbox_id=sandbox_id).order_by("started_at", "pk")
    return list(records.only(*COSTED_FIELDS))


def cost_by(records: Iterable[UsageRecord], at: datetime) -> int:
    """What a sandbox's usage ``records`` had cost by ``at``, all its placements together."""
    return sum(running_cost_micros(r, at) for r in records)


def sandboxes_usage(sandbox_ids: Collection[int]) -> dict[int, list[UsageRecord]]:
    """``sandbox_usage`` for many sandboxes in one query (every open sandbox stream's, at each
    re-check), each list oldest first; a sandbox without intervals maps to []."""
    usage: dict[int, list[UsageRecord]] = {pk: [] for pk in sandbox_ids}
    records = UsageRecord.objects.filter(sandbox_id__in=usage).order_by("sandbox_id", "started_at", "pk")
    for record in records.only("sandbox_id", *COSTED_FIELDS):
        usage[record.sandbox_id].append(record)
    return usage
