"""The GPUs this host has, and the CPU and memory it offers sandboxes."""

from __future__ import annotations

import os
from typing import Any, cast

from wire.messages import HostFacts, to_control
from workers.agent_settings import AgentSettings
from workers.drivers.base import SandboxDriver
from workers.gpu.base import GpuBackend, GpuInfo


class HostInventory:
    def __init__(self, settings: AgentSettings, backend: GpuBackend, driver: SandboxDriver) -> None:
        self.settings = settings
        self.backend = backend
        self.driver = driver
        self.gpus: list[GpuInfo] = []

    def refresh(self) -> list[dict[str, Any]]:
        self.gpus = self.backend.list_gpus()
        return [g.to_json() for g in self.gpus]

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

    def facts(self) -> dict[str, int]:
        """CPU and memory this host offers sandboxes. A simulated host reports the size
        GPUSHARE_SIM_HOST gives it (default 64 cores, 512 GiB), not the machine's own."""
        if self.backend.simulated:
            return {"cpu_cores": self.settings.sim_host_cpus, "memory_mib": self.settings.sim_host_memory_mib}
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return {"cpu_cores": os.cpu_count() or 1, "memory_mib": pages // 2**20}

    def report(self) -> None:
        facts = cast(HostFacts, self.facts())  # cast: until facts() returns the HostFacts it builds
        to_control.agent_inventory(
            self.settings.host, self.backend.name, self.driver.name, self.refresh(), facts
        )
