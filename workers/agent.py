"""The host agent: tasks on ``host.<name>``, a sampler and a heartbeat. No ORM here.

It launches and stops sandboxes from self-contained specs, streams GPU samples to the
channel layer and reports everything else to the control queue. Run it with
``GPUSHARE_ROLE=agent GPUSHARE_HOST=<name> celery -A workers worker -Q host.<name> -P threads``
(threads: the tasks and the sampler share one backend and one picture of the host).

``Agent`` only puts together the parts in ``workers.host``, each with one job, and gives
the Celery tasks below one object to call; its settings are read once, at start-up
(``AgentSettings.from_env`` in ``get_agent``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from celery import Task, signals
from kombu import Queue

from wire import config
from wire.celery import app, host_queue
from wire.env import ConfigError
from wire.messages import MigStepReport, MoveReport, PlanInventory, to_control
from wire.spec import SandboxHandle, SandboxSpec
from workers import moves, selftest
from workers.agent_pool import REPORT_BUILDERS, AgentPool, SimulatedHost, read_hosts_file
from workers.agent_settings import AgentSettings
from workers.alerts import AlertTracker
from workers.batch_output import OutputPump
from workers.drivers import DriverUnavailable, make_driver
from workers.drivers.base import SandboxDriver
from workers.drivers.gpu_nodes import GpuNodes
from workers.gpu import make_backend
from workers.gpu.base import GpuBackend
from workers.gpu.mig import MigManager
from workers.gpu.mps import MpsManager, SimulatedMps, mps_root
from workers.gpu.mps_daemons import MpsDaemons
from workers.host.faults import GpuFaults
from workers.host.inventory import HostInventory
from workers.host.lifecycle import SandboxLifecycle
from workers.host.reports import HostReports
from workers.host.sampler import Sampler
from workers.host.sandboxes import HostSandboxes
from workers.host.storage_meter import StorageMeter
from workers.host.terminals import relay_stream
from workers.host.utilization import UtilizationWindows

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
        self.settings = settings or AgentSettings(host=host)
        self.host, self.backend, self.driver = host, backend, driver
        root = mps_root(var_dir, self.settings.mps_dir)
        # Each GPU's MPS daemon up exactly while MPS shares (or an admin's MPS pin) hold it.
        self.mps_daemons = MpsDaemons(
            SimulatedMps(root)
            if backend.simulated
            else MpsManager(root, exclusive_process=self.settings.mps_exclusive_process)
        )
        self.mig = MigManager(backend)
        self.sandboxes = HostSandboxes()
        self.inventory = HostInventory(self.settings, backend, driver)
        self.alerts = AlertTracker(host)
        self.utilization = UtilizationWindows(self.settings.util_window_s)
        self.output = OutputPump(driver, self.sandboxes.handles.get)
        self.meter = StorageMeter(self.settings, driver, self.sandboxes)
        self.lifecycle = SandboxLifecycle(
            self.settings, backend, driver, self.sandboxes, self.inventory, self.mps_daemons,
            self.utilization, self.output, self.meter,
        )  # fmt: skip
        self.reports = HostReports(
            self.settings, backend, driver, self.sandboxes, self.inventory, self.mps_daemons,
            self.utilization, lambda: self.alerts.version, report_builder,
        )  # fmt: skip
        self.faults = GpuFaults(host, backend, self.inventory, self.alerts)
        # Real GPUs: the device nodes a sandbox binds (MIG caps nodes exist only once asked
        # for, /dev/nvidia-uvm once something loaded the module) are made at start and after
        # each MIG change, as libcuda would make them on the host.
        self.device_nodes = None if backend.simulated else GpuNodes()
        self.sampler = Sampler(
            host, backend, self.sandboxes, self.inventory, self.reports, self.faults, self.alerts,
            self.utilization, self.output,
        )  # fmt: skip

    # What the tasks and a fleet plan (workers.moves) call.

    def launch(self, spec: SandboxSpec) -> None:
        self.lifecycle.launch(spec)

    def stop(self, allocation_key: str, handle_json: dict[str, Any] | None) -> None:
        self.lifecycle.stop(allocation_key, handle_json)

    def stop_quietly(self, allocation_key: str, handle: SandboxHandle | None) -> None:
        self.lifecycle.stop_quietly(allocation_key, handle)

    def warn(self, allocation_key: str, handle_json: dict[str, Any] | None, stop_at: float) -> None:
        self.lifecycle.warn(allocation_key, handle_json, stop_at)

    def find(self, allocation_key: str) -> SandboxHandle | None:
        return self.lifecycle.find(allocation_key)

    def mig_instances_in_use(self) -> dict[str, str]:
        return self.sandboxes.mig_instances_in_use()

    def report_inventory(self) -> None:
        self.inventory.report()

    def open_terminal(self, session: str, allocation_key: str, handle_json: dict[str, Any] | None) -> None:
        handle = SandboxHandle.from_json(handle_json) if handle_json else self.find(allocation_key)
        relay_stream(
            self.driver.exec_terminal,
            self.host,
            session,
            allocation_key,
            handle,
            self.settings.terminal_idle_s,
            "terminal",
        )

    def open_app(self, session: str, allocation_key: str, handle_json: dict[str, Any] | None) -> None:
        handle = SandboxHandle.from_json(handle_json) if handle_json else self.find(allocation_key)
        relay_stream(
            self.driver.open_app,
            self.host,
            session,
            allocation_key,
            handle,
            self.settings.terminal_idle_s,
            "app",
        )

    def execute_plan(
        self, plan_id: int, stops: list[dict[str, Any]], mig_plan: dict[str, Any] | None, busy: dict[str, str]
    ) -> None:
        outcome = moves.execute_plan(self, plan_id, stops, mig_plan, busy)
        results, steps, error = outcome.report()
        inventory = None
        if mig_plan is not None:
            inventory = PlanInventory(
                backend=self.backend.name, driver=self.driver.name, gpus=self.inventory.refresh()
            )
        # cast: until PlanOutcome.report() returns the reports it builds
        moved, changed = cast(list[MoveReport], results), cast(list[MigStepReport], steps)
        to_control.plan_executed(plan_id, self.host, moved, changed, error, inventory)

    def gpu_mode(self, gpu_uuid: str, mode: str) -> None:
        """An admin pinned the GPU (or let it follow demand): only a pin to MPS keeps its
        daemon up between shares."""
        self.mps_daemons.set_pinned(gpu_uuid, mode == "mps")

    def set_alert_policy(self, policy: dict[str, Any]) -> None:
        with self.sandboxes.lock:
            self.alerts.set_policy(policy)
        log.info("agent %s: alert policy %s", self.host, self.alerts.version)

    def _make_device_nodes(self) -> None:
        if self.device_nodes is not None:
            gpus = self.inventory.gpus
            self.device_nodes.create_missing(
                [g.uuid for g in gpus] + [m.uuid for g in gpus for m in g.mig_devices]
            )

    def start(self) -> None:
        self.inventory.report()
        self._make_device_nodes()
        # Alerts this host raised before a restart can no longer clear themselves.
        to_control.telemetry_agent_started(self.host)
        loop = self.sampler.sample_forever(self.settings.sample_interval_s, self.settings.heartbeat_s)
        threading.Thread(target=asyncio.run, args=(loop,), name="agent-sampler", daemon=True).start()
        if self.driver.storage_dir is not None:
            threading.Thread(
                target=self.meter.run_forever,
                args=(self.sampler.stopping,),
                name="agent-storage",
                daemon=True,
            ).start()

    def shutdown(self) -> None:
        self.sampler.stopping.set()
        self.reports.shutdown()
        self.backend.close()


def refuse_state_only_on_real_gpus(backend: GpuBackend, driver: SandboxDriver) -> None:
    """The simulated driver's sandboxes run nothing: on real GPUs they would be placed and
    billed and never run, so an agent with real GPUs refuses it."""
    if driver.name == "simulated" and not backend.simulated:
        raise DriverUnavailable(
            "simulated",
            f"the state-only driver runs nothing, and this host's GPUs are real ({backend.name})",
            "set SANDBOX_DRIVER to docker, process or libvirt (the simulated driver is for "
            "GPU_BACKEND=simulated hosts)",
        )


AnyTask = Task[Any, Any]  # a bound task: its request says which queue a message came in on
_agent: Agent | None = None
_pool: AgentPool | None = None
_agent_lock = threading.Lock()


def get_agent() -> Agent:
    global _agent
    with _agent_lock:
        if _agent is None:
            settings = AgentSettings.from_env()
            host = settings.host
            var = config.var_dir() / "agents" / host
            var.mkdir(parents=True, exist_ok=True)
            backend = make_backend(settings.gpu_backend, host, settings.sim_gpus)
            driver = make_driver(settings.sandbox_driver, host, var / "sandboxes")
            refuse_state_only_on_real_gpus(backend, driver)
            log.info("agent %s: GPU backend %s, sandbox driver %s", host, backend.name, driver.name)
            _agent = Agent(host, backend, driver, var, settings)
        return _agent


def build_pool(hosts: list[SimulatedHost], settings: AgentSettings, var_dir: Path) -> AgentPool:
    """One agent per simulated host, each with the backend and driver its settings name
    (simulated GPUs, the state-only driver: ``SimulatedHost.settings``)."""
    builders = ThreadPoolExecutor(REPORT_BUILDERS, thread_name_prefix="pool-report")
    agents = {}
    for host in hosts:
        own = host.settings(settings)
        var = var_dir / "agents" / host.name
        backend = make_backend(own.gpu_backend, host.name, own.sim_gpus)
        driver = make_driver(own.sandbox_driver, host.name, var / "sandboxes")
        agents[host.name] = Agent(host.name, backend, driver, var, own, builders)
    return AgentPool(agents, settings, builders)


@functools.cache
def pool_hosts(path: Path) -> list[SimulatedHost]:
    """The hosts file, read once: its queues are consumed from import on, and the pool is
    built when the worker starts (a ConfigError is not cached: the worker exits on it)."""
    return read_hosts_file(path)


def get_pool() -> AgentPool:
    global _pool
    with _agent_lock:
        if _pool is None:
            path = config.hosts_file()
            if path is None:
                raise ConfigError("a process serving many hosts needs GPUSHARE_HOSTS_FILE")
            _pool = build_pool(pool_hosts(path), AgentSettings.from_env(host="pool"), config.var_dir())
        return _pool


def agent_for(task: AnyTask) -> Agent:
    """The agent a task's message is for: this process's, or, in one serving many hosts, that
    of the host whose queue it came in on."""
    if config.hosts_file() is None:
        return get_agent()
    return get_pool().for_queue((task.request.delivery_info or {}).get("routing_key"))


@app.task(name="workers.agent.launch_sandbox", ignore_result=True, bind=True)
def launch_sandbox(task: AnyTask, spec: dict[str, Any]) -> None:
    agent_for(task).launch(SandboxSpec.from_json(spec))


@app.task(name="workers.agent.set_alert_policy", ignore_result=True, bind=True)
def set_alert_policy(task: AnyTask, policy: dict[str, Any]) -> None:
    agent_for(task).set_alert_policy(policy)


@app.task(name="workers.agent.report_inventory", ignore_result=True, bind=True)
def report_inventory(task: AnyTask) -> None:
    agent_for(task).report_inventory()


@app.task(name="workers.agent.execute_plan", ignore_result=True, bind=True)
def execute_plan(
    task: AnyTask,
    plan_id: int,
    stops: list[dict[str, Any]],
    mig_plan: dict[str, Any] | None,
    busy: dict[str, str],
) -> None:
    agent_for(task).execute_plan(plan_id, stops, mig_plan, busy)


@app.task(name="workers.agent.open_app", ignore_result=True, bind=True)
def open_app(task: AnyTask, session: str, allocation_key: str, handle: dict[str, Any] | None) -> None:
    agent_for(task).open_app(session, allocation_key, handle)


@app.task(name="workers.agent.open_terminal", ignore_result=True, bind=True)
def open_terminal(task: AnyTask, session: str, allocation_key: str, handle: dict[str, Any] | None) -> None:
    agent_for(task).open_terminal(session, allocation_key, handle)


@app.task(name="workers.agent.gpu_mode", ignore_result=True, bind=True)
def gpu_mode(task: AnyTask, gpu_uuid: str, mode: str) -> None:
    agent_for(task).gpu_mode(gpu_uuid, mode)


@app.task(name="workers.agent.stop_sandbox", ignore_result=True, bind=True)
def stop_sandbox(task: AnyTask, allocation_key: str, sandbox_id: int, handle: dict[str, Any] | None) -> None:
    agent_for(task).stop(allocation_key, handle)


@app.task(name="workers.agent.warn_sandbox", ignore_result=True, bind=True)
def warn_sandbox(
    task: AnyTask, allocation_key: str, sandbox_id: int, handle: dict[str, Any] | None, stop_at: float
) -> None:
    agent_for(task).warn(allocation_key, handle, stop_at)


def _consume_every_hosts_queue() -> None:
    """A process serving many hosts consumes each one's queue (a one-host agent is given its
    own with ``-Q host.<name>``): the worker reads these when it sets up its consumers. A bad
    hosts file is left to the worker's start, which logs it and exits (``_self_test``)."""
    path = config.hosts_file()
    if path is None:
        return
    try:
        hosts = pool_hosts(path)
    except ConfigError:
        return
    app.conf.task_queues = [Queue(host_queue(host.name)) for host in hosts]


_consume_every_hosts_queue()


# A worker that exits with this code refused to start for its configuration (sysexits
# EX_CONFIG): systemd's unit does not restart it in a loop (RestartPreventExitStatus).
EXIT_CANNOT_LAUNCH = 78


@signals.worker_init.connect
def _self_test(**_: Any) -> None:
    """Before the first task: launch and stop one sandbox; a driver that cannot launch
    must not take sandboxes (each would fail with the same message), so the agent exits.
    A process serving many simulated hosts builds them instead (a bad hosts file exits the
    same way); their state-only driver needs no trial."""
    if config.hosts_file() is not None:
        try:
            get_pool()
        except ConfigError as exc:
            log.error("agent pool cannot start: %s", exc)
            raise SystemExit(EXIT_CANNOT_LAUNCH) from exc
        return
    try:
        agent = get_agent()
    except DriverUnavailable as exc:
        log.error("agent cannot start: %s\n    to fix: %s", exc, exc.remedy)
        raise SystemExit(EXIT_CANNOT_LAUNCH) from exc
    if not agent.settings.self_test:
        return
    result = selftest.try_driver(agent.driver, agent.host)
    if not result.ok:
        log.error("agent %s cannot start: %s", agent.host, result.describe())
        raise SystemExit(EXIT_CANNOT_LAUNCH)
    log.info("agent %s: %s", agent.host, result.describe())


@signals.worker_ready.connect
def _on_ready(**_: Any) -> None:
    if config.hosts_file() is not None:
        get_pool().start()
    else:
        get_agent().start()


@signals.worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    if _pool is not None:
        _pool.shutdown()
    if _agent is not None:
        _agent.shutdown()
