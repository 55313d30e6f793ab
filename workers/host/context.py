"""What the parts of one host's agent share, made once and handed to each part.

Before this, each part took its collaborators one by one (nine constructor arguments for
the lifecycle, the reports and the sampler alike) and the fleet plan reached into the
whole ``Agent``. ``HostContext`` holds the shared collaborators and nothing else: no
behaviour of its own beyond making them, so it cannot grow into the agent. What only one
part uses stays with that part: the lifecycle's storage meter, the sampler's rollups,
the reports' builder thread, the fleet plans' MIG manager.

This is also the seam another engine plugs in at (docs/architecture.md, "Adding a sandbox
driver or an engine"): the parts see a driver and a GPU backend through the context, never
a concrete engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workers.drivers.base import SandboxDriver
from workers.gpu.base import DevicesBoundElsewhere, GpuBackend
from workers.gpu.mps import MpsManager, mps_root
from workers.gpu.mps_daemons import MpsDaemons
from workers.gpu.mps_recovery import MpsRecovery
from workers.gpu.mps_simulated import SimulatedMps
from workers.host.agent_settings import AgentSettings
from workers.host.alerts import AlertTracker
from workers.host.batch_output import OutputPump
from workers.host.inventory import HostInventory
from workers.host.sandboxes import HostSandboxes
from workers.host.utilization import UtilizationWindows


def mps_control(root: Path, backend: GpuBackend) -> MpsManager:
    """Who runs this host's MPS daemons: NVIDIA's control daemon on real GPUs, a model of it on
    simulated ones, and nobody here for GPUs another engine binds (a Slurm node's MPS is
    Slurm's): a state-only record of the shares, which sets no compute mode."""
    if isinstance(backend, DevicesBoundElsewhere):
        return SimulatedMps(root, enforced_elsewhere=True)
    if backend.simulated:
        return SimulatedMps(root, compute_modes=backend)
    return MpsManager(root, compute_modes=backend)


@dataclass
class HostContext:
    """One host's shared collaborators. Not frozen so that a test can swap one (a fake MPS
    control, a driver that blocks) for every part at once; the agent never reassigns them."""

    settings: AgentSettings  # read once, at start-up
    backend: GpuBackend  # NVML or simulated GPUs
    driver: SandboxDriver  # the engine that runs sandboxes
    sandboxes: HostSandboxes  # what this host runs, under one lock
    inventory: HostInventory  # the GPUs, CPU and memory it offers
    alerts: AlertTracker  # the alert rules and what they raised
    mps_daemons: MpsDaemons  # each GPU's MPS daemon, up while shares hold it
    utilization: UtilizationWindows  # each sandbox's GPU use, for idle culling
    output: OutputPump  # batch sandboxes' output, shipped as it grows
    # MPS servers after a fault: recovered, and new shares held meanwhile (over ``mps_daemons``;
    # a test that swaps those makes a new one too).
    mps_recovery: MpsRecovery = field(init=False)

    def __post_init__(self) -> None:
        self.mps_recovery = MpsRecovery(self.mps_daemons)

    @property
    def host(self) -> str:
        return self.settings.host

    @classmethod
    def assemble(
        cls, settings: AgentSettings, backend: GpuBackend, driver: SandboxDriver, var_dir: Path
    ) -> HostContext:
        """The collaborators of a host with ``backend`` and ``driver``, its state under
        ``var_dir``. The inventory is one of them, so it takes the three it reads rather
        than the context it belongs to."""
        root = mps_root(var_dir, settings.mps_dir)
        sandboxes = HostSandboxes()
        return cls(
            settings=settings,
            backend=backend,
            driver=driver,
            sandboxes=sandboxes,
            inventory=HostInventory(settings, backend, driver),
            alerts=AlertTracker(settings.host),
            # The backend sets and reads each MPS device's compute mode (EXCLUSIVE_PROCESS while
            # its daemon runs): MPS is always enforced, there is no setting to turn it off.
            mps_daemons=MpsDaemons(mps_control(root, backend)),
            utilization=UtilizationWindows(settings.util_window_s),
            output=OutputPump(driver, sandboxes.handles.get),
        )
