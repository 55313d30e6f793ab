"""Storing the agents' one-minute rollups, and deleting them after the retention.

Upserts keyed by (GPU, minute) and (sandbox, minute): a redelivered message rewrites the
same rows, so storing is idempotent. Unknown GPUs and sandboxes (deleted meanwhile, or a
message from before the inventory) are skipped, never an error that would retry forever.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from portal.fleet.models import Gpu
from portal.inputs import whole_number
from portal.sandboxes.models import Sandbox
from portal.telemetry.models import GpuRollup, SandboxRollup

log = logging.getLogger(__name__)

_GPU_FIELDS = [f.name for f in GpuRollup._meta.fields if f.name not in ("id", "gpu", "minute")]
_SANDBOX_FIELDS = [f.name for f in SandboxRollup._meta.fields if f.name not in ("id", "sandbox", "minute")]


def _util(figures: dict[str, Any]) -> list[float | None]:
    """min, mean, max utilization; null for a minute that measured none (a MIG device
    without GPM), stored as such and never as 0, which would read as idle."""
    util = figures.get("util_pct")
    return [None, None, None] if util is None else list(util)


def _gpu_row(gpu_id: int, minute: datetime, figures: dict[str, Any]) -> GpuRollup:
    temp, util, mem, power = figures["temp_c"], _util(figures), figures["mem_mib"], figures["power_w"]
    return GpuRollup(
        gpu_id=gpu_id,
        minute=minute,
        samples=min(int(figures["samples"]), 32767),
        temp_min_c=temp[0],
        temp_mean_c=temp[1],
        temp_max_c=temp[2],
        util_min_pct=util[0],
        util_mean_pct=util[1],
        util_max_pct=util[2],
        mem_min_mib=mem[0],
        mem_mean_mib=mem[1],
        mem_max_mib=mem[2],
        mem_total_mib=figures["mem_total_mib"],
        power_min_w=power[0],
        power_mean_w=power[1],
        power_max_w=power[2],
        sm_clock_mean_mhz=figures["sm_clock_mean_mhz"],
        throttled_samples=min(int(figures["throttled"]), 32767),
    )


def _sandbox_row(sandbox_id: int, minute: datetime, figures: dict[str, Any]) -> SandboxRollup:
    mem, util = figures["mem_mib"], _util(figures)
    return SandboxRollup(
        sandbox_id=sandbox_id,
        minute=minute,
        samples=min(int(figures["samples"]), 32767),
        mem_min_mib=mem[0],
        mem_mean_mib=mem[1],
        mem_max_mib=mem[2],
        util_min_pct=util[0],
        util_mean_pct=util[1],
        util_max_pct=util[2],
        temp_max_c=figures["temp_max_c"],
        power_mean_w=figures["power_mean_w"],
    )


def do_store_rollups(host: str, payload: dict[str, Any]) -> tuple[int, int]:
    """Upsert one host's minute; returns (GPU rows, sandbox rows) written."""
    minute = datetime.fromtimestamp(int(payload["minute"]), tz=UTC)
    gpus = payload.get("gpus", {})
    boxes = payload.get("sandboxes", {})
    gpu_ids = dict(Gpu.objects.filter(uuid__in=list(gpus), host__name=host).values_list("uuid", "pk"))
    known = set(
        Sandbox.objects.filter(
            pk__in=[n for s in boxes if (n := whole_number(str(s))) is not None]
        ).values_list("pk", flat=True)
    )
    gpu_rows = [_gpu_row(gpu_ids[u], minute, f) for u, f in gpus.items() if u in gpu_ids]
    box_rows = [_sandbox_row(n, minute, f) for s, f in boxes.items() if (n := whole_number(str(s))) in known]
    skipped = len(gpus) - len(gpu_rows) + len(boxes) - len(box_rows)
    if skipped:
        log.info("rollups from %s for %s: %d unknown GPUs or sandboxes skipped", host, minute, skipped)
    with transaction.atomic():
        GpuRollup.objects.bulk_create(
            gpu_rows, update_conflicts=True, unique_fields=["gpu", "minute"], update_fields=_GPU_FIELDS
        )
        SandboxRollup.objects.bulk_create(
            box_rows,
            update_conflicts=True,
            unique_fields=["sandbox", "minute"],
            update_fields=_SANDBOX_FIELDS,
        )
    return len(gpu_rows), len(box_rows)


def do_purge_rollups(now: datetime) -> int:
    """Delete rollups past the retention; returns the rows deleted."""
    cutoff = now - timedelta(days=settings.TELEMETRY_RETENTION_DAYS)
    gpus, _ = GpuRollup.objects.filter(minute__lt=cutoff).delete()
    boxes, _ = SandboxRollup.objects.filter(minute__lt=cutoff).delete()
    if gpus or boxes:
        log.info("telemetry retention: %d GPU and %d sandbox rollups before %s deleted", gpus, boxes, cutoff)
    return gpus + boxes
