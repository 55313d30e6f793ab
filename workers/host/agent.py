"""One host's agent: its parts (``workers.host``) put together once, and the one object the
Celery tasks (``workers.agent``) call. An agent pool (``workers.host.agent_pool``) holds
one per simulated host.

The parts share one ``HostContext`` (settings, GPU backend, driver, what runs here, ...);
each keeps what it alone owns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from wire.messages import PlanInventory, StopOrder, to_control
from wire.relay import Terminal
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers.base import SandboxDriver
from workers.drivers.gpu_nodes import GpuNodes
from workers.gpu.base import GpuBackend
from workers.host.agent_settings import AgentSettings
from workers.host.context import HostContext
from workers.host.faults import GpuFaults
from workers.host.inventory import send_inventories
from workers.host.lifecycle import SandboxLifecycle
from workers.host.moves import FleetPlans
from workers.host.reports import HostReports
from workers.host.sampler import Sampler
from workers.host.storage_meter import StorageMeter
from workers.host.terminals import relay_stream

log = logging.getLogger(__name__)


class Agent:
    """One host's agent: its parts, wired once."""

    def __init__(
        self,
        host: str,
        backend: GpuBackend,
        driver: SandboxDriver,
        var_dir: Path,
        settings: AgentSettings | None = None,
        report_builder: Executor | None = None,
    ) -> None:
        self.host = host
        # Each GPU's MPS daemon (in the context) is up exactly while MPS shares (or an
        # admin's MPS pin) hold it.
        self.context = HostContext.assemble(settings or AgentSettings(host=host), backend, driver, var_dir)
        self.meter = StorageMeter(self.context)
        self.lifecycle = SandboxLifecycle(self.context, self.meter)
        # Real GPUs: the device nodes a sandbox binds (MIG caps nodes exist only once asked
        # for, /dev/nvidia-uvm once something loaded the module) are made at start and after
        # each MIG change (FleetPlans), as libcuda would make them on the host.
        self.device_nodes = None if backend.simulated else GpuNodes()
        self.plans = FleetPlans(self.context, self.lifecycle, self.device_nodes)
        self.reports = HostReports(self.context, report_builder)
        self.faults = GpuFaults(self.context)
        self.sampler = Sampler(self.context, self.reports, self.faults)

    # What the Celery tasks call.

    def launch(self, spec: SandboxSpec) -> None:
        self.lifecycle.launch(spec)

    def stop(self, allocation_key: str, handle_json: Mapping[str, Any] | None) -> None:
        self.lifecycle.stop(allocation_key, handle_json)

    def warn(self, allocation_key: str, handle_json: Mapping[str, Any] | None, stop_at: float) -> None:
        self.lifecycle.warn(allocation_key, handle_json, stop_at)

    def report_inventory(self) -> None:
        self.context.inventory.report()

    def open_terminal(self, session: str, allocation_key: str, handle_json: Mapping[str, Any] | None) -> None:
        self._relay(self.context.driver.exec_terminal, session, allocation_key, handle_json, "terminal")

    def open_app(self, session: str, allocation_key: str, handle_json: Mapping[str, Any] | None) -> None:
        self._relay(self.context.driver.open_app, session, allocation_key, handle_json, "app")

    def open_ssh(
        self,
        session: str,
        allocation_key: str,
        handle_json: Mapping[str, Any] | None,
        authorized_keys: list[str],
    ) -> None:
        keys = list(authorized_keys) if isinstance(authorized_keys, list) else []  # the driver checks each

        def opener(handle: SandboxHandle) -> Terminal:
            return self.context.driver.open_ssh(handle, keys)

        self._relay(opener, session, allocation_key, handle_json, "ssh")

    def _relay(
        self,
        opener: Callable[[SandboxHandle], Terminal],
        session: str,
        allocation_key: str,
        handle_json: Mapping[str, Any] | None,
        kind: str,
    ) -> None:
        handle = SandboxHandle.from_json(handle_json) if handle_json else self.lifecycle.find(allocation_key)
        idle_s = self.context.settings.terminal_idle_s
        relay_stream(opener, self.host, session, allocation_key, handle, idle_s, kind)

    def execute_plan(
        self, plan_id: int, stops: list[StopOrder], mig_plan: dict[str, Any] | None, busy: dict[str, str]
    ) -> None:
        outcome = self.plans.execute(plan_id, stops, mig_plan, busy)
        results, steps, error = outcome.report()
        inventory: PlanInventory | None = None
        if mig_plan is not None:
            inventory = {
                "backend": self.context.backend.name,
                "driver": self.context.driver.name,
                "gpus": self.context.inventory.refresh(),
            }
        to_control.plan_executed(plan_id, self.host, results, steps, error, inventory)

    def gpu_mode(self, gpu_uuid: str, mode: str) -> None:
        """An admin pinned the GPU (or let it follow demand): only a pin to MPS keeps its
        daemon up between shares."""
        self.context.mps_daemons.set_pinned(gpu_uuid, mode == "mps")

    def set_alert_policy(self, policy: dict[str, Any]) -> None:
        alerts = self.context.alerts
        with self.context.sandboxes.lock:
            alerts.set_policy(policy)
        log.info("agent %s: alert policy %s", self.host, alerts.version)

    # Starting and stopping.

    def make_device_nodes(self) -> None:
        if self.device_nodes is not None:
            gpus = self.context.inventory.gpus
            self.device_nodes.create_missing(
                [g.uuid for g in gpus] + [m.uuid for g in gpus for m in g.mig_devices]
            )

    def announce(self) -> None:
        """What a host alone says as it starts (``announce``)."""
        announce([self])

    def start(self) -> None:
        """A host alone: announce it, then its sampler (which beats too) and, for a driver
        that mounts volumes, its storage meter, each on a thread of its own."""
        self.announce()
        settings = self.context.settings
        ticks = self.sampler.sample_forever(settings.sample_interval_s, settings.heartbeat_s)
        run_loop(ticks, "agent-sampler")
        if self.context.driver.storage_dir is not None:
            threading.Thread(
                target=self.meter.run_forever,
                args=(self.sampler.stopping,),
                name="agent-storage",
                daemon=True,
            ).start()

    def shutdown(self) -> None:
        self.sampler.stopping.set()
        self.reports.shutdown()
        self.context.backend.close()


def announce(agents: Sequence[Agent]) -> None:
    """What hosts say as their agents start, one alone or a pool's together: their inventories,
    each marked as the first since its agent started (the portal closes the alerts it raised
    before, which can no longer clear themselves), in a few messages however many hosts; then,
    on real GPUs, the device nodes each lists."""
    send_inventories([agent.context.inventory.current(started=True) for agent in agents])
    for agent in agents:
        agent.make_device_nodes()


def run_loop(loop: Coroutine[Any, Any, None], name: str) -> None:
    """An asyncio loop (a sampler's) on a daemon thread of its own."""
    threading.Thread(target=asyncio.run, args=(loop,), name=name, daemon=True).start()
