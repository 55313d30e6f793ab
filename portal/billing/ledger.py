"""Opening and closing usage intervals. Called only from ``portal.sandboxes.actions``,
inside its transaction, with the sandbox row locked.

An interval prices what it holds: ``price x billed_milli / 1000 x hours``. A GPU sandbox's
``billed_milli`` is its GPUs held (``milli_gpu``); a CPU-only sandbox holds no GPU
(``milli_gpu`` 0, so it adds nothing to GPU-hour quotas or fair share) and is charged its
tier's price per hour of the sandbox (``billed_milli`` 1000): it still occupies a host's
CPU and memory, and an operator bills that as a cloud bills a CPU instance, by the hour.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from portal.billing.models import UsageRecord, cost_micros

if TYPE_CHECKING:
    from portal.sandboxes.models import Sandbox

_MICROSECOND = timedelta(microseconds=1)
_ZERO = timedelta(0)
ONE_SANDBOX = 1000  # what a CPU-only interval is charged on: one sandbox, in thousandths


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
    return record


def running_cost_micros(record: UsageRecord, now: datetime) -> int:
    if record.cost_micros is not None:
        return record.cost_micros
    duration_us = max(now - record.started_at, _ZERO) // _MICROSECOND
    return cost_micros(record.price_per_gpu_hour_micros, record.priced_milli, duration_us)
