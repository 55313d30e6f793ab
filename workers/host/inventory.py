"""The GPUs this host has, and the CPU and memory it offers sandboxes; inventories sent.

A host alone sends its inventory as a batch of one; a process serving many simulated hosts
sends theirs together at its start (``send_inventories``), in messages of
``INVENTORIES_PER_MESSAGE``, which the control worker applies a message at a time in a few
bulk statements: 1,213 one-host messages, each its own transaction, held the fleet's first
heartbeats back for 30 to 130 s (BENCHMARKS.md, the openb fleet's cold start).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from wire.messages import HostFacts, InventoryReport, to_control
from workers.drivers.base import SandboxDriver
from workers.gpu.base import DevicesBoundElsewhere, GpuBackend, GpuBackendError, GpuInfo
from workers.host.agent_settings import AgentSettings

log = logging.getLogger(__name__)
# Hosts per message: a message of 100 (about 500 GPUs, 150 kB of JSON) is applied in a
# fraction of a second, so heartbeats queued behind a cold start's batches wait that long
# each, and several control workers can share a big fleet's start.
INVENTORIES_PER_MESSAGE = 100


def send_inventories(reports: list[InventoryReport]) -> None:
    """Inventories, one host's or many: in messages of ``INVENTORIES_PER_MESSAGE``."""
    for start in range(0, len(reports), INVENTORIES_PER_MESSAGE):
        to_control.agent_inventories(reports[start : start + INVENTORIES_PER_MESSAGE])


class HostInventory:
    def __init__(self, settings: AgentSettings, backend: GpuBackend, driver: SandboxDriver) -> None:
        self.settings = settings
        self.backend = backend
        self.driver = driver
        self.gpus: list[GpuInfo] = []

    def refresh(self) -> list[dict[str, Any]]:
        self.gpus = self.backend.list_gpus()
        return [g.to_json() for g in self.gpus]

    def fabric_changed(self) -> bool:
        """Whether any GPU's NVLink fabric readiness differs from what the last inventory
        said (GpuInfo.not_ready). Asked every heartbeat: Fabric Manager registers GPUs in
        the seconds to minutes after a boot, and loses them if it stops, and the GPU must
        come back (or leave) by itself, without an agent restart. A GPU that cannot be read
        is left to the sampler (a lost one is reported as such)."""
        for gpu in list(self.gpus):
            try:
                problem = self.backend.fabric_problem(gpu.uuid)
            except GpuBackendError as err:
                log.debug("fabric state of %s not read: %s", gpu.uuid, err)
                continue
            if problem != gpu.not_ready:
                log.warning("GPU %s NVLink fabric: %s", gpu.uuid, problem or "ready")
                return True
        return False

    def recheck_fabric(self) -> bool:
        """Send the inventory again when a GPU's fabric readiness changed: the portal takes
        a GPU that is not ready out of placement, with the reason, and returns it once ready.
        True when it was sent."""
        if not self.fabric_changed():
            return False
        self.report()
        return True

    def drop(self, uuid: str) -> None:
        """A GPU that stopped answering (lost): no longer sampled; the next inventory
        (after a repair and an agent restart) lists it again if it came back."""
        self.gpus = [g for g in self.gpus if g.uuid != uuid]

    def parent_of(self) -> dict[str, str]:
        """MIG device uuid -> its GPU's uuid."""
        return {m.uuid: g.uuid for g in self.gpus for m in g.mig_devices}

    def device_memory_mib(self, uuid: str, default: int = 8192) -> int:
        sizes = {g.uuid: g.memory_mib for g in self.gpus}
        sizes.update({m.uuid: m.memory_mib for g in self.gpus for m in g.mig_devices})
        return sizes.get(uuid, default)

    def facts(self) -> HostFacts:
        """CPU and memory this host offers sandboxes. A simulated host reports the size
        GPUSHARE_SIM_HOST gives it (default 64 cores, 512 GiB), not the machine's own."""
        if isinstance(self.backend, DevicesBoundElsewhere):
            cpus, memory_mib = self.backend.host_facts()
            return {"cpu_cores": cpus, "memory_mib": memory_mib}
        if self.backend.simulated:
            return {"cpu_cores": self.settings.sim_host_cpus, "memory_mib": self.settings.sim_host_memory_mib}
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return {"cpu_cores": os.cpu_count() or 1, "memory_mib": pages // 2**20}

    def current(self, started: bool = False) -> InventoryReport:
        """What this host has now (the GPUs read again); ``started``: its first report since
        the agent started."""
        return {
            "host": self.settings.host, "backend": self.backend.name, "driver": self.driver.name,
            "gpus": self.refresh(), "facts": self.facts(), "started": started,
        }  # fmt: skip

    def report(self) -> None:
        """Send this host's inventory (asked for by the portal, or a GPU's fabric changed)."""
        send_inventories([self.current()])
