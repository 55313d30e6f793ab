"""Applying what host agents report: heartbeats and GPU inventory."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction

from portal.fleet.models import Gpu, GpuMode, Host, MigInstance


def do_heartbeat(host_name: str, at: datetime, backend: str, driver: str) -> bool:
    """Record an agent's heartbeat; a lost host that beats again comes back up."""
    updated = Host.objects.filter(name=host_name).update(last_heartbeat_at=at, backend=backend, driver=driver)
    Host.objects.filter(name=host_name, state=Host.State.LOST).update(state=Host.State.UP)
    return bool(updated)


@transaction.atomic
def do_sync_inventory(
    host_name: str, backend: str, driver: str, gpus: list[dict[str, Any]], facts: dict[str, int] | None = None
) -> Host:
    """Make the database's GPUs and MIG instances match what the agent sees.

    GPUs are matched by UUID. A new GPU follows demand, or is shared by MIG when it is in
    MIG mode. An admin's pin is kept; only a change of MIG mode (a GPU reset on the host)
    changes the mode: into MIG, or out of it to following demand.
    """
    host, _ = Host.objects.select_for_update().get_or_create(
        name=host_name, defaults={"backend": backend, "driver": driver}
    )
    host.backend, host.driver = backend, driver
    if facts:
        host.cpu_cores, host.memory_mib = facts["cpu_cores"], facts["memory_mib"]
    host.save(update_fields=["backend", "driver", "cpu_cores", "memory_mib"])
    seen = set()
    for info in gpus:
        seen.add(info["uuid"])
        gpu, created = Gpu.objects.get_or_create(
            uuid=info["uuid"],
            defaults={
                "host": host,
                "index": info["index"],
                "name": info["name"],
                "model": info["model"],
                "memory_mib": info["memory_mib"],
                "mig_enabled": info["mig_enabled"],
                "sharing_mode": GpuMode.MIG if info["mig_enabled"] else GpuMode.AUTO,
            },
        )
        if not created:
            gpu.name, gpu.model, gpu.memory_mib = info["name"], info["model"], info["memory_mib"]
            gpu.mig_enabled = info["mig_enabled"]
            if gpu.mig_enabled:
                gpu.sharing_mode = GpuMode.MIG
            elif gpu.sharing_mode == GpuMode.MIG:
                gpu.sharing_mode = GpuMode.AUTO
            if gpu.state == Gpu.State.UNAVAILABLE:
                gpu.state = Gpu.State.AVAILABLE
            gpu.save()
        _sync_mig(gpu, info.get("mig_devices") or [])
    Gpu.objects.filter(host=host).exclude(uuid__in=seen).update(state=Gpu.State.UNAVAILABLE)
    return host


def _sync_mig(gpu: Gpu, devices: list[dict[str, Any]]) -> None:
    reported = {d["uuid"]: d for d in devices}
    # Instances that vanished are removed unless a sandbox holds them now (then drift is
    # repaired by reconciliation, which fails that sandbox first). Released allocations
    # keep the instance's uuid in ``device_uuid``.
    vanished = gpu.mig_instances.exclude(uuid__in=reported).exclude(allocations__active=True)
    MigInstance.objects.filter(pk__in=list(vanished.values_list("pk", flat=True))).delete()
    for uuid, d in reported.items():
        MigInstance.objects.update_or_create(
            uuid=uuid,
            defaults={
                "gpu": gpu,
                "profile": d["profile"],
                "start": d["start"],
                "memory_slices": d["memory_slices"],
                "memory_mib": d["memory_mib"],
                "gpu_instance_id": d["gpu_instance_id"],
                "compute_instance_id": d["compute_instance_id"],
            },
        )
