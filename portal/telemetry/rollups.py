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
from portal.sandboxes.models import Allocation
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


def do_store_rollups(rollups: list[tuple[str, dict[str, Any]]]) -> tuple[int, int]:
    """Upsert the minutes of ``rollups`` ((host, payload) each: one host's agent sends one, a
    process serving many hosts a round of them) in one transaction; returns (GPU rows,
    sandbox rows) written. A GPU counts only on the host that reports it, a sandbox only from
    a host it was allocated on: a host is believed about itself alone (issue 38), and one's
    figures must not land in another tenant's history."""
    gpu_keys: dict[tuple[str, str], tuple[datetime, dict[str, Any]]] = {}
    box_keys: dict[int, list[tuple[datetime, dict[str, Any]]]] = {}
    box_hosts: dict[int, set[str]] = {}
    for host, payload in rollups:
        minute = datetime.fromtimestamp(int(payload["minute"]), tz=UTC)
        for uuid, figures in payload.get("gpus", {}).items():
            gpu_keys[(host, uuid)] = (minute, figures)
        for sandbox, figures in payload.get("sandboxes", {}).items():
            if (n := whole_number(str(sandbox))) is not None:
                box_keys.setdefault(n, []).append((minute, figures))
                box_hosts.setdefault(n, set()).add(host)
    gpu_ids = {
        (host, uuid): pk
        for uuid, host, pk in Gpu.objects.filter(uuid__in=[u for _, u in gpu_keys]).values_list(
            "uuid", "host__name", "pk"
        )
    }
    held_on = Allocation.objects.filter(
        sandbox_id__in=list(box_keys), gpu__host__name__in={h for hosts in box_hosts.values() for h in hosts}
    ).values_list("sandbox_id", "gpu__host__name")
    known = {pk for pk, host in held_on if host in box_hosts[pk]}
    # One row per key: an upsert may not touch a row twice (a minute sent twice in a batch).
    gpu_rows = {
        (gpu_ids[key], minute): _gpu_row(gpu_ids[key], minute, figures)
        for key, (minute, figures) in gpu_keys.items()
        if key in gpu_ids
    }
    box_rows = {
        (n, minute): _sandbox_row(n, minute, figures)
        for n, minutes in box_keys.items()
        if n in known
        for minute, figures in minutes
    }
    skipped = len(gpu_keys) - len(gpu_ids) + sum(len(m) for n, m in box_keys.items() if n not in known)
    if skipped:
        hosts = sorted({host for host, _ in rollups})
        log.info("rollups from %s: %d unknown GPUs or sandboxes skipped", ", ".join(hosts[:5]), skipped)
    with transaction.atomic():
        GpuRollup.objects.bulk_create(
            list(gpu_rows.values()), update_conflicts=True, unique_fields=["gpu", "minute"],
            update_fields=_GPU_FIELDS, batch_size=2000,
        )  # fmt: skip
        SandboxRollup.objects.bulk_create(
            list(box_rows.values()), update_conflicts=True, unique_fields=["sandbox", "minute"],
            update_fields=_SANDBOX_FIELDS, batch_size=2000,
        )  # fmt: skip
    return len(gpu_rows), len(box_rows)


def do_purge_rollups(now: datetime) -> int:
    """Delete rollups past the retention; returns the rows deleted."""
    cutoff = now - timedelta(days=settings.TELEMETRY_RETENTION_DAYS)
    gpus, _ = GpuRollup.objects.filter(minute__lt=cutoff).delete()
    boxes, _ = SandboxRollup.objects.filter(minute__lt=cutoff).delete()
    if gpus or boxes:
        log.info("telemetry retention: %d GPU and %d sandbox rollups before %s deleted", gpus, boxes, cutoff)
    return gpus + boxes
