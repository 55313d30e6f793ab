"""Every task on the ``control`` queue and on the hosts' queues, declared once: its name, its
arguments and their types.

``ControlTasks`` is the contract. Senders call ``to_control.<task>(...)``, which sends the
task by name (``wire/dispatch.py``), so mypy checks each call against the declaration; the
control worker registers the handlers of ``portal/control/tasks.py`` under the same names
(``workers/control.py``), and mypy checks that module against the declaration too. A changed
argument is then an error at every sender and at the handler, not a message that fails in
a worker. ``AgentTasks`` is the hosts' side of the same contract: the portal sends with
``to_host(host).<task>(...)``, and a test holds the agent's handlers to it.

What goes on the wire is unchanged by the types: arguments are positional (a Celery
message's ``args`` list), payloads are TypedDicts (plain JSON objects), so agents and
portals of the previous version still understand each other. Names are the messages' as
they travel; ``wire.spec.renamed`` reads an older agent's ``allocation_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NotRequired, Protocol, TypedDict, cast

from wire import dispatch
from wire.liveness import Beat
from wire.spec import HandleJson
from wire.telemetry import AlertMessage


class HostFacts(TypedDict):
    """What a host offers sandboxes besides its GPUs."""

    cpu_cores: int
    memory_mib: int


class InventoryReport(TypedDict):
    """One host's GPUs as its agent sees them now, and what else it offers sandboxes: an entry
    of ``agent_inventories``. ``started``: the first since its agent started (the alerts it
    raised before can no longer clear themselves, so they are closed)."""

    host: str
    backend: str  # its GPU backend: "nvml" | "simulated"
    driver: str  # its sandbox driver
    gpus: list[dict[str, Any]]  # ``workers.gpu.base.GpuInfo.to_json()`` each
    facts: HostFacts
    started: bool


class FaultReport(TypedDict):
    """A GPU fault the control worker drains for (``workers.gpu.base.FaultEvent`` as JSON)."""

    uuid: str  # the GPU, or the MIG device the fault was tied to
    # "xid" | "ecc_dbe" | "gpu_lost" | "overheat" | "remap_failed" | "remap_pending" |
    # "retirement_pending" (application XIDs never come here)
    kind: str
    detail: str
    t_ms: int
    xid: NotRequired[int | None]  # an overheat carries none


class MoveReport(TypedDict):
    """What became of one sandbox a plan asked its host to stop (``workers.host.moves.MoveResult``)."""

    sandbox_id: int
    allocation_key: str
    stopped_ms: int | None  # None: still running where it was
    checkpoint: list[Any] | None  # [ok, what the hook said]; None: no hook
    message: str


class MigStepReport(TypedDict):
    """One change a plan made on a GPU, in order (``workers.gpu.mig.MigStep``)."""

    action: str  # "destroy" | "create" | "keep"
    gpu: str
    profile: str
    start: int
    mig_uuid: str
    sandbox: str  # the sandbox that left (destroy) or goes into (create) the instance


class PlanInventory(TypedDict):
    """A host's GPUs after a MIG re-layout, sent with the plan's report."""

    backend: str
    driver: str
    gpus: list[dict[str, Any]]  # as an ``InventoryReport``'s


class MinuteRollup(TypedDict):
    """One host's closed minute of samples (``workers/host/rollups.py``): per GPU uuid and per
    sandbox id, [min, mean, max] triples and counts, as ``portal/telemetry/rollups.py`` reads."""

    minute: int  # epoch seconds of the minute's start
    gpus: dict[str, dict[str, Any]]
    sandboxes: dict[str, dict[str, Any]]


class OverShareReport(TypedDict):
    """A sandbox on a shared GPU holding more memory than its share (``wire.spec.MemoryShare``),
    summed over all its processes, as its host's agent measured it."""

    sandbox_id: int
    allocation_key: str
    gpu: str  # the device it was measured on
    mem_mib: int  # what it held when this was sent
    share_mib: int
    since_ms: int  # when it went over
    # "warn": first seen over (its owner is told at once); "stop": over for its tier's grace
    # under MemoryShare.over_share == "stop" (the portal stops it); "clear": back within its share
    action: str


class SlurmAccounting(TypedDict):
    """What slurmdbd accounted for a gpushare job that ended (``/slurmdb/v0.0.38/job/{id}``), as
    a Slurm gateway reads it: the portal checks its ledger against it."""

    job_id: int
    start_s: int  # epoch seconds, Slurm's clock
    end_s: int
    elapsed_s: int
    gres: dict[str, int]  # allocated GRES: {"gpu": 1}, {"shard": 2}, {"mps": 30}


# A stopped sandbox's volumes: {volume id (JSON keys are strings): [bytes, whether measured whole]}.
StorageUsage = dict[str, list[Any]]


class ControlTasks(Protocol):
    """The tasks of the control queue (``workers.control.<name>``). Parameters are positional
    only, as they travel. Times are epoch milliseconds. The two whose handlers may ask for a
    retry return ``object``: what they return is for the control worker, never the sender."""

    # --- sent by the portal and by beat
    def schedule_cycle(self, /) -> None: ...
    def tick(self, /) -> None: ...
    def invoice_tick(self, /) -> None: ...
    def purge_idempotency_keys(self, /) -> None: ...
    def sweep_webhooks(self, /) -> None: ...
    def deliver_webhook(self, delivery_id: int, /) -> object: ...
    def email_notifications(self, notification_ids: list[int], /) -> object: ...

    # --- sent by the agents
    def agent_heartbeats(self, beats: list[Beat], /) -> None: ...
    # One host's inventory, or a batch of a process serving many (its cold start: 1,213 in a
    # few messages, as beats and rollups travel).
    def agent_inventories(self, reports: list[InventoryReport], /) -> None: ...
    def gpu_faults(self, host: str, events: list[FaultReport], /) -> None: ...
    def plan_executed(
        self,
        plan_id: int,
        host: str,
        results: list[MoveReport],
        mig_steps: list[MigStepReport],
        error: str,
        inventory: PlanInventory | None,
        /,
    ) -> None: ...
    def sandbox_launched(self, allocation_key: str, handle: HandleJson, started_ms: int, /) -> None: ...
    def launch_progress(self, allocation_key: str, line: str, /) -> None: ...
    def sandbox_launch_failed(self, sandbox_id: int, allocation_key: str, message: str, /) -> None: ...
    def sandbox_stopped(self, allocation_key: str, ended_ms: int, message: str = "stopped", /) -> None: ...
    def sandbox_warned(self, allocation_key: str, checkpoint: str, /) -> None: ...
    def storage_usage(self, sandbox_id: int, usage: StorageUsage, /) -> None: ...
    def sandbox_output(self, allocation_key: str, start: int, data_b64: str, total: int, /) -> None: ...
    def telemetry_host_rollups(self, rollups: list[tuple[str, MinuteRollup]], /) -> None: ...
    def telemetry_alerts(self, host: str, changes: list[AlertMessage], /) -> None: ...
    def sandbox_over_share(self, host: str, report: OverShareReport, /) -> None: ...
    def slurm_accounted(self, allocation_key: str, record: SlurmAccounting, /) -> object: ...


class StopOrder(TypedDict):
    """A sandbox a plan asks its host to stop (``execute_plan``'s ``stops``)."""

    allocation_key: str
    sandbox_id: int
    handle: HandleJson | None  # as the portal keeps it; None: the agent finds it by its key


class AgentTasks(Protocol):
    """The tasks of a host's queue (``workers.agent.<name>``, ``host.<host>``), as the portal
    sends them through ``to_host(host)``. The agent's handlers (``workers/agent.py``) take the
    same arguments after Celery's bound task; a test holds them to this declaration."""

    def launch_sandbox(self, spec: dict[str, Any], /) -> None: ...  # SandboxSpec.to_json()
    def stop_sandbox(self, allocation_key: str, sandbox_id: int, handle: HandleJson | None, /) -> None: ...
    def warn_sandbox(
        self, allocation_key: str, sandbox_id: int, handle: HandleJson | None, stop_at: float, /
    ) -> None: ...
    def open_terminal(self, session: str, allocation_key: str, handle: HandleJson | None, /) -> None: ...
    def open_app(self, session: str, allocation_key: str, handle: HandleJson | None, /) -> None: ...
    # authorized_keys: the connecting user's public keys (wire.ssh), each a bare "<type> <base64>".
    def open_ssh(
        self, session: str, allocation_key: str, handle: HandleJson | None, authorized_keys: list[str], /
    ) -> None: ...
    def execute_plan(
        self, plan_id: int, stops: list[StopOrder], mig_plan: dict[str, Any] | None, busy: dict[str, str], /
    ) -> None: ...
    def gpu_mode(self, gpu_uuid: str, mode: str, /) -> None: ...
    def set_alert_policy(self, policy: dict[str, Any], /) -> None: ...
    def report_inventory(self, /) -> None: ...


def _declared(tasks: type) -> list[str]:
    return [name for name, value in vars(tasks).items() if callable(value) and not name.startswith("_")]


def agent_task_names() -> list[str]:
    """Every task ``AgentTasks`` declares, in declaration order."""
    return _declared(AgentTasks)


def control_task_names() -> list[str]:
    """Every task ``ControlTasks`` declares, in declaration order."""
    return _declared(ControlTasks)


class _ByName:
    """Stands in for a queue's tasks: calling an attribute sends the task of that name."""

    def __init__(self, send: Callable[..., None]) -> None:
        self._send = send

    def __getattr__(self, task: str) -> Callable[..., None]:
        if task.startswith("_"):  # copy, pickle and the like probe for dunders
            raise AttributeError(task)
        return partial(self._send, task)


def _send_to_control(task: str, *args: Any) -> None:
    dispatch.to_control(task, *args)  # looked up at each call: tests capture dispatch's sends


# ``to_control.sandbox_stopped(key, ended_ms)``: the task sent by name, its arguments checked
# against ``ControlTasks`` by mypy.
to_control = cast(ControlTasks, _ByName(_send_to_control))


def _send_to_host(host: str, task: str, *args: Any) -> None:
    dispatch.to_host(host, task, *args)  # looked up at each call: tests capture dispatch's sends


def to_host(host: str) -> AgentTasks:
    """``to_host(name).stop_sandbox(key, pk, handle)``: the task sent by name to that host's
    queue, its arguments checked against ``AgentTasks`` by mypy."""
    return cast(AgentTasks, _ByName(partial(_send_to_host, host)))
