"""The host agent: tasks on ``host.<name>``, a sampler and a heartbeat. No ORM here.

It launches and stops sandboxes from self-contained specs, streams GPU samples to the
channel layer and reports everything else to the control queue. Run it with
``GPUSHARE_ROLE=agent GPUSHARE_HOST=<name> celery -A workers worker -Q host.<name> -P threads``
(threads: the tasks and the sampler share one backend and one picture of the host).

This module is the agent's Celery entry, as ``workers.control`` is the control worker's:
the tasks (named ``workers.agent.<task>``, as ``wire.dispatch`` sends them), the signals
that self-test, start and stop it, and which agent a message is for. ``Agent``
(``workers.host.agent``) puts together the parts in ``workers.host``, each with one job;
its settings are read once, at start-up (``AgentSettings.from_env`` in ``get_agent``).
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from celery import Task, signals
from kombu import Queue

from wire import config, signing
from wire.celery import app, host_queue, process_signer
from wire.env import ConfigError
from wire.messages import StopOrder
from wire.spec import HandleJson, SandboxSpec
from workers.drivers import DriverUnavailable, make_driver
from workers.drivers.base import ChecksGpuPath, SandboxDriver
from workers.gpu import make_backend
from workers.gpu.base import GpuBackend
from workers.host import selftest
from workers.host.agent import Agent
from workers.host.agent_pool import REPORT_BUILDERS, AgentPool, SimulatedHost, read_hosts_file
from workers.host.agent_settings import AgentSettings
from workers.slurm.gateway import SlurmGateway
from workers.slurm.settings import SlurmSettings

log = logging.getLogger(__name__)


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


def refuse_gpus_the_driver_cannot_hand_out(backend: GpuBackend, driver: SandboxDriver) -> None:
    """The start-up self-test launches a CPU-only sandbox: on a host whose real GPUs the
    driver has no way to hand out (Docker without the NVIDIA Container Toolkit's hook or a
    CDI spec, or in a toolkit mode that refuses Docker's request) it would pass, and every
    GPU launch placed here would then fail. Such an agent refuses to start, saying what is
    missing and how to add it. Simulated GPUs need no path."""
    if backend.simulated or not isinstance(driver, ChecksGpuPath):
        return
    problem = driver.gpu_path_problem()
    if problem is not None and backend.list_gpus():
        reason, remedy = problem
        raise DriverUnavailable(
            driver.name, f"this host's GPUs cannot be given to sandboxes: {reason}", remedy
        )


AnyTask = Task[Any, Any]  # a bound task: its request says which queue a message came in on
_agent: Agent | None = None
_pool: AgentPool | None = None
_gateway: SlurmGateway | None = None
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
            refuse_gpus_the_driver_cannot_hand_out(backend, driver)
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
    built when the worker starts (a ConfigError is not cached: the worker exits on it). A pool
    enrolled under a prefix (GPUSHARE_POOL_PREFIX, ``manage.py host_credential issue --pool``)
    may serve only hosts whose names start with it: its Redis user reaches no other."""
    hosts = read_hosts_file(path)
    prefix = config.pool_prefix()
    strangers = [h.name for h in hosts if not h.name.startswith(prefix)]
    if strangers:
        raise ConfigError(
            f"{path} names hosts outside the pool's prefix {prefix!r} (GPUSHARE_POOL_PREFIX): "
            f"{', '.join(strangers[:5])}{' …' if len(strangers) > 5 else ''}"
        )
    return hosts


def get_pool() -> AgentPool:
    global _pool
    with _agent_lock:
        if _pool is None:
            path = config.hosts_file()
            if path is None:
                raise ConfigError("a process serving many hosts needs GPUSHARE_HOSTS_FILE")
            _pool = build_pool(pool_hosts(path), AgentSettings.from_env(host="pool"), config.var_dir())
        return _pool


def get_gateway() -> SlurmGateway:
    """A Slurm cluster's gateway (GPUSHARE_SLURM_URL): its nodes are this process's hosts,
    named with the prefix it was enrolled under (GPUSHARE_POOL_PREFIX)."""
    global _gateway
    with _agent_lock:
        if _gateway is None:
            settings = SlurmSettings.from_env()
            base = AgentSettings.from_env(host="slurm-gateway")
            _gateway = SlurmGateway(settings, base, config.var_dir(), config.pool_prefix())
        return _gateway


def agent_for(task: AnyTask) -> Agent:
    """The agent a task's message is for: this process's, or, in one serving many hosts (a
    pool, a Slurm gateway), that of the host whose queue it came in on."""
    queue = (task.request.delivery_info or {}).get("routing_key")
    if config.slurm_gateway():
        return get_gateway().for_queue(queue)
    if config.hosts_file() is None:
        return get_agent()
    return get_pool().for_queue(queue)


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
    stops: list[StopOrder],
    mig_plan: dict[str, Any] | None,
    busy: dict[str, str],
) -> None:
    agent_for(task).execute_plan(plan_id, stops, mig_plan, busy)


@app.task(name="workers.agent.open_app", ignore_result=True, bind=True)
def open_app(task: AnyTask, session: str, allocation_key: str, handle: HandleJson | None) -> None:
    agent_for(task).open_app(session, allocation_key, handle)


@app.task(name="workers.agent.open_ssh", ignore_result=True, bind=True)
def open_ssh(
    task: AnyTask, session: str, allocation_key: str, handle: HandleJson | None, authorized_keys: list[str]
) -> None:
    agent_for(task).open_ssh(session, allocation_key, handle, authorized_keys)


@app.task(name="workers.agent.open_terminal", ignore_result=True, bind=True)
def open_terminal(task: AnyTask, session: str, allocation_key: str, handle: HandleJson | None) -> None:
    agent_for(task).open_terminal(session, allocation_key, handle)


@app.task(name="workers.agent.gpu_mode", ignore_result=True, bind=True)
def gpu_mode(task: AnyTask, gpu_uuid: str, mode: str) -> None:
    agent_for(task).gpu_mode(gpu_uuid, mode)


@app.task(name="workers.agent.stop_sandbox", ignore_result=True, bind=True)
def stop_sandbox(task: AnyTask, allocation_key: str, sandbox_id: int, handle: HandleJson | None) -> None:
    agent_for(task).stop(allocation_key, handle)


@app.task(name="workers.agent.warn_sandbox", ignore_result=True, bind=True)
def warn_sandbox(
    task: AnyTask, allocation_key: str, sandbox_id: int, handle: HandleJson | None, stop_at: float
) -> None:
    agent_for(task).warn(allocation_key, handle, stop_at)


def _consume_every_hosts_queue() -> None:
    """A process serving many hosts consumes each one's queue (a one-host agent is given its
    own with ``-Q host.<name>``): the worker reads these when it sets up its consumers. A bad
    hosts file is left to the worker's start, which logs it and exits (``_self_test``). A
    Slurm gateway learns its nodes from the cluster once it starts, and consumes their queues
    from then on; until then it listens on one under its prefix that no host is named."""
    if config.slurm_gateway():
        app.conf.task_queues = [Queue(host_queue(config.pool_prefix() or "slurm-gateway"))]
        return
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


def load_keys() -> None:
    """The keys an agent cannot work without, checked before it takes a message: its own,
    which signs what it reports (the control worker drops what is unsigned), and the control
    plane's public key, which what it runs must be signed with. ConfigError if either is
    missing or malformed."""
    process_signer()
    text = config.control_public_key()
    if text is None:
        raise ConfigError(
            "GPUSHARE_CONTROL_PUBLIC_KEY_FILE (or GPUSHARE_CONTROL_PUBLIC_KEY) is unset: the agent "
            "runs only what the control plane signed (manage.py host_credential issue writes it)"
        )
    try:
        signing.install_verifier(signing.control_only(signing.public_key(text)))
    except signing.KeyFormatError as exc:
        raise ConfigError(f"GPUSHARE_CONTROL_PUBLIC_KEY: {exc}") from exc


@signals.worker_init.connect
def _self_test(**_: Any) -> None:
    """Before the first task: the agent's keys are loaded, then it launches and stops one
    sandbox; a driver that cannot launch must not take sandboxes (each would fail with the
    same message), so the agent exits. A process serving many simulated hosts builds them
    instead (a bad hosts file exits the same way); their state-only driver needs no trial."""
    try:
        load_keys()
    except ConfigError as exc:
        log.error("agent cannot start: %s", exc)
        raise SystemExit(EXIT_CANNOT_LAUNCH) from exc
    if config.serves_many_hosts():
        gateway = config.slurm_gateway()
        try:
            get_gateway() if gateway else get_pool()
        except ConfigError as exc:
            log.error("%s cannot start: %s", "Slurm gateway" if gateway else "agent pool", exc)
            raise SystemExit(EXIT_CANNOT_LAUNCH) from exc
        return
    try:
        agent = get_agent()
    except DriverUnavailable as exc:
        log.error("agent cannot start: %s\n    to fix: %s", exc, exc.remedy)
        raise SystemExit(EXIT_CANNOT_LAUNCH) from exc
    if not agent.context.settings.self_test:
        return
    result = selftest.try_driver(agent.context.driver, agent.host)
    if not result.ok:
        log.error("agent %s cannot start: %s", agent.host, result.describe())
        raise SystemExit(EXIT_CANNOT_LAUNCH)
    log.info("agent %s: %s", agent.host, result.describe())


@signals.worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    if config.slurm_gateway():
        # The consumer (the signal's sender) takes each node's queue as the gateway finds it.
        threading.Thread(target=get_gateway().start, args=(sender.add_task_queue,), daemon=True).start()
    elif config.hosts_file() is not None:
        get_pool().start()
    else:
        get_agent().start()


@signals.worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    if _pool is not None:
        _pool.shutdown()
    if _gateway is not None:
        _gateway.shutdown()
    if _agent is not None:
        _agent.shutdown()
