"""What the twin reports: an independent check of what the portal committed, percentiles,
``summary.json`` and the charts.

The feasibility check reads the database's rows and the trace's node list, and nothing of
the scheduler: every host's sandboxes within its CPU and memory, every GPU's grants
within one GPU, a whole-GPU grant alone on its GPU, every grant on its sandbox's host.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from django.db.models import Count

from portal.fleet.models import FleetPlan
from portal.sandboxes.models import Allocation, Sandbox
from portal.scheduling.snapshot import HOLDING
from portal.telemetry.models import GpuRollup
from scheduler.research.trace import NodeSpec

MILLI = 1000


def feasibility_problems(nodes: list[NodeSpec]) -> list[str]:
    """What breaks a node's capacity now, from the rows alone (empty: nothing)."""
    by_name = {n.name: n for n in nodes}
    problems: list[str] = []
    cpu: dict[str, float] = defaultdict(float)
    memory: dict[str, int] = defaultdict(int)
    host_of: dict[int, str] = {}
    for pk, host, cpu_limit, memory_mib in Sandbox.objects.filter(
        state__in=HOLDING, host__isnull=False
    ).values_list("pk", "host__name", "tier__cpu_limit", "tier__memory_limit_mib"):
        host_of[pk] = host
        cpu[host] += cpu_limit * MILLI
        memory[host] += memory_mib
    for host in sorted(set(cpu)):
        node = by_name.get(host)
        if node is None:
            problems.append(f"{host}: not a node of the trace")
            continue
        if round(cpu[host]) > node.cpu_milli:
            problems.append(f"{host}: {cpu[host]:.0f} milli-CPU held, {node.cpu_milli} there")
        if memory[host] > node.memory_mib:
            problems.append(f"{host}: {memory[host]} MiB held, {node.memory_mib} there")
    per_gpu: dict[tuple[str, int], list[int]] = defaultdict(list)
    for sandbox_id, gpu_host, index, milli in Allocation.objects.filter(active=True).values_list(
        "sandbox_id", "gpu__host__name", "gpu__index", "milli_gpu"
    ):
        if host_of.get(sandbox_id) != gpu_host:
            problems.append(
                f"sandbox {sandbox_id}: a grant on {gpu_host}, the sandbox on {host_of.get(sandbox_id)}"
            )
        node = by_name.get(gpu_host)
        if node is not None and not 0 <= index < node.gpus:
            problems.append(f"{gpu_host}: GPU #{index}, the node has {node.gpus}")
        per_gpu[(gpu_host, index)].append(milli)
    for (host, index), grants in sorted(per_gpu.items()):
        if sum(grants) > MILLI:
            problems.append(f"{host} GPU #{index}: {sum(grants)} milli granted ({grants})")
        if MILLI in grants and len(grants) > 1:
            problems.append(f"{host} GPU #{index}: a whole-GPU grant shared ({grants})")
    return problems


def plans_run() -> dict[str, Any]:
    """Defragmentation plans the run saw, by kind and state, and the GPUs the finished
    consolidations freed. MIG re-layouts start on their own for a MIG request no instance
    fits; consolidations are an admin's to start (the twin starts none)."""
    out: dict[str, Any] = {kind: {} for kind in FleetPlan.Kind.values}
    freed = 0
    for kind, state, plan in FleetPlan.objects.values_list("kind", "state", "plan"):
        out[kind][state] = out[kind].get(state, 0) + 1
        if kind == FleetPlan.Kind.CONSOLIDATION and state == FleetPlan.State.DONE:
            freed += len(plan.get("frees", []))
    out["gpus_freed_by_consolidation"] = freed
    return out


def rollups_kept(gpus: int) -> dict[str, int]:
    """Minutes of GPU rollups stored, and how many of them hold every GPU of the fleet (the
    first and the last are partial: the run began and ended within them)."""
    per_minute = list(
        GpuRollup.objects.values("minute").annotate(n=Count("pk")).order_by().values_list("n", flat=True)
    )
    return {"minutes": len(per_minute), "complete": sum(1 for n in per_minute if n >= gpus)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spread(values: list[float]) -> dict[str, float | None]:
    """p50, p95, p99 and the maximum, rounded for the summary."""
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0)):
        value = percentile(values, q)
        out[name] = round(value, 3) if value is not None else None
    out["count"] = len(values)
    return out


def write_summary(out: Path, summary: dict[str, Any]) -> Path:
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
    return path
