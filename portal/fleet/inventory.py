"""Applying what host agents report: heartbeats and GPU inventory.

State changes (a lost host back up, a GPU gone or back) go through ``portal.fleet.actions``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from portal.fleet import actions
from portal.fleet.models import Gpu, GpuMode, Host, MigInstance
from wire.messages import HostFacts


@dataclass(frozen=True)
class Heartbeats:
    known: set[str]  # the hosts the database knows (the rest have sent no inventory yet)
    regained: list[str]  # those that were lost and are back up


def do_heartbeats(host_names: Collection[str], at: datetime, backend: str, driver: str) -> Heartbeats:
    """Record the agents' heartbeats at ``at`` (two statements, however many hosts beat); a
    lost host that beats again comes back up."""
    states = dict(Host.objects.filter(name__in=list(host_names)).values_list("name", "state"))
    if not states:
        return Heartbeats(set(), [])
    Host.objects.filter(name__in=list(states)).update(last_heartbeat_at=at, backend=backend, driver=driver)
    regained = []
    for name in (name for name, state in states.items() if state == Host.State.LOST):
        with transaction.atomic():
            host = Host.objects.select_for_update().filter(name=name, state=Host.State.LOST).first()
            if host is not None:  # not regained by another beat meanwhile
                actions.regain_host(host)
                regained.append(name)
    return Heartbeats(set(states), regained)


@transaction.atomic
def do_sync_inventory(
    host_name: str, backend: str, driver: str, gpus: list[dict[str, Any]], facts: HostFacts | None = None
) -> Host:
    """Make the database's GPUs and MIG instances match what the agent sees.

    GPUs are matched by UUID. A new GPU follows demand, or is shared by MIG when it is in
    MIG mode. An admin's pin is kept; only a change of MIG mode (a GPU reset on the host)
    changes the mode: into MIG, or out of it to following demand.

    A GPU the agent reports ``not_ready`` (its NVLink fabric not registered by Fabric
    Manager: CUDA would fail on it) is unavailable with that reason, and available again
    once an inventory reports it ready (the agent re-sends one when that changes).
    """
    host, _ = Host.objects.select_for_update().get_or_create(
        name=host_name, defaults={"backend": backend, "driver": driver}
    )
    host.backend, host.driver = backend, driver
    if facts:
        host.cpu_cores, host.memory_mib = facts["cpu_cores"], facts["memory_mib"]
    host.save(update_fields=["backend", "driver", "cpu_cores", "memory_mib"])
    seen = set()
    # Locked, so that a drain (portal.control.faults) cannot land between reading a GPU here
    # and writing it back.
    known = {gpu.uuid: gpu for gpu in Gpu.objects.select_for_update().filter(host=host)}
    for info in gpus:
        seen.add(info["uuid"])
        gpu, created = Gpu.objects.select_for_update().get_or_create(
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
            gpu.save(update_fields=["name", "model", "memory_mib", "mig_enabled", "sharing_mode"])
        not_ready = str(info.get("not_ready") or "")  # an agent before fabric checks sends none
        if not_ready:
            actions.gpu_not_ready(gpu, not_ready)
        elif not created:
            was = f" (it was unavailable: {gpu.unavailable_reason})" if gpu.unavailable_reason else ""
            actions.gpu_available(gpu, f"available: host {host.name}'s agent offers it again{was}")
        _sync_mig(gpu, info.get("mig_devices") or [])
    gone = [gpu for uuid, gpu in known.items() if uuid not in seen]
    actions.gpus_unavailable(gone, f"unavailable: host {host.name}'s agent no longer sees it")
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
