"""A host's part of a fleet plan: checkpoint and stop sandboxes, then change the MIG layout.

``portal.control.plans`` sends each host ``execute_plan`` with the sandboxes it must stop and,
for a MIG re-layout, the plan itself. The agent answers with one ``plan_executed`` report;
the control worker relaunches the sandboxes on their new slots. Nothing here touches the
database.

Before a sandbox is stopped the operator's checkpoint hook runs (workers/host/checkpoint.py,
with ``GPUSHARE_PLAN_ID``). A hook that fails or outlasts ``SANDBOX_CHECKPOINT_TIMEOUT_S``
leaves that sandbox running; in a MIG re-layout it also calls the whole re-layout off,
since the plan's layout needs the sandbox out of its instance.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from scheduler.defrag import DESTROY, MIGRATE, MigPlan
from wire.messages import MigStepReport, MoveReport, StopOrder
from wire.spec import SandboxHandle, renamed
from workers.drivers.base import DriverError
from workers.drivers.gpu_nodes import GpuNodes
from workers.gpu.mig import MigError, MigManager, MigStep
from workers.gpu.mps import MpsError
from workers.host.checkpoint import run_checkpoint_hook
from workers.host.context import HostContext
from workers.host.lifecycle import SandboxLifecycle

log = logging.getLogger(__name__)


@dataclass
class MoveResult:
    """What became of one sandbox the plan asked this host to stop."""

    sandbox_id: int
    allocation_key: str
    stopped_ms: int | None = None  # None: still running where it was
    checkpoint: tuple[bool, str] | None = None  # (ok, what the hook said); None: no hook
    message: str = ""


@dataclass
class PlanOutcome:
    results: list[MoveResult] = field(default_factory=list)
    mig_steps: list[MigStep] = field(default_factory=list)
    error: str = ""

    def report(self) -> tuple[list[MoveReport], list[MigStepReport], str]:
        moves = [
            MoveReport(
                sandbox_id=r.sandbox_id,
                allocation_key=r.allocation_key,
                stopped_ms=r.stopped_ms,
                checkpoint=None if r.checkpoint is None else list(r.checkpoint),
                message=r.message,
            )
            for r in self.results
        ]
        steps = [
            MigStepReport(
                action=s.action,
                gpu=s.gpu,
                profile=s.profile,
                start=s.start,
                mig_uuid=s.mig_uuid,
                sandbox=s.sandbox,
            )
            for s in self.mig_steps
        ]
        return moves, steps, self.error


class FleetPlans:
    """This host's part of fleet plans. It owns the MIG manager: nothing else on the host
    changes the MIG layout.

    ``device_nodes`` (real GPUs only) makes the /dev nodes of the instances a re-layout
    created: a MIG instance's capability nodes (/dev/nvidia-caps/nvidia-cap<N>) do not exist
    until something asks for them, libcuda on the host would, but a process sandbox has no
    setuid nvidia-modprobe to call, so its launch into the new instance would fail until the
    agent restarted (review 3, #5). mig-parted does the same after each change (``nvidia-ctk
    system create-device-nodes``)."""

    def __init__(
        self, context: HostContext, lifecycle: SandboxLifecycle, device_nodes: GpuNodes | None = None
    ) -> None:
        self.context = context
        self.lifecycle = lifecycle
        self.mig = MigManager(context.backend)
        self.device_nodes = device_nodes

    def execute(
        self, plan_id: int, stops: list[StopOrder], mig_plan: dict[str, Any] | None, busy: dict[str, str]
    ) -> PlanOutcome:
        """Checkpoint and stop each sandbox in ``stops``, then apply ``mig_plan`` (if any).

        Idempotent: a sandbox already gone counts as stopped, and the MIG manager skips work
        already done, so a redelivered message repeats nothing harmful.
        """
        settings = self.context.settings
        outcome = PlanOutcome()
        called_off = ""
        for order in map(renamed, stops):  # a portal not yet upgraded says allocation_id
            key, sandbox_id = order["allocation_key"], int(order["sandbox_id"])
            result = MoveResult(sandbox_id, key)
            outcome.results.append(result)
            if called_off:
                result.message = f"not stopped: {called_off}"
                continue
            handle = (
                SandboxHandle.from_json(order["handle"]) if order.get("handle") else self.lifecycle.find(key)
            )
            if handle is not None:
                result.checkpoint = run_checkpoint_hook(
                    handle,
                    settings.checkpoint_hook,
                    settings.checkpoint_timeout_s,
                    {"GPUSHARE_CHECKPOINT_REASON": "move", "GPUSHARE_PLAN_ID": str(plan_id)},
                )
                if result.checkpoint is not None and not result.checkpoint[0]:
                    result.message = result.checkpoint[1]
                    if mig_plan is not None:
                        called_off = (
                            f"the re-layout was called off: sandbox {sandbox_id}'s {result.checkpoint[1]}"
                        )
                    continue
            try:
                self.lifecycle.stop_quietly(key, handle)
            except DriverError as exc:
                result.message = f"stop failed: {exc}"
                if mig_plan is not None:
                    called_off = f"the re-layout was called off: sandbox {sandbox_id} did not stop ({exc})"
                continue
            result.stopped_ms = int(time.time() * 1000)
        if mig_plan is not None:
            if called_off:
                outcome.error = called_off
            else:
                self._relayout(plan_id, MigPlan.from_json(mig_plan), busy, outcome)
        return outcome

    def _relayout(self, plan_id: int, plan: MigPlan, busy: dict[str, str], outcome: PlanOutcome) -> None:
        # The control plane's busy set, and what this agent itself still runs on MIG
        # instances: never destroy an instance under a live sandbox.
        still = {**busy, **self.context.sandboxes.mig_instances_in_use()}
        try:
            self.retire_mps(plan, still)
            outcome.mig_steps = self.mig.execute_plan(plan, still)
        except MigError as exc:
            outcome.error, outcome.mig_steps = str(exc), exc.steps
            log.error("fleet plan %s: MIG re-layout failed: %s", plan_id, exc)
        # Also after a failure part-way: the instances it did create are offered all the same.
        self.make_device_nodes(plan_id, outcome.mig_steps)

    def make_device_nodes(self, plan_id: int, steps: list[MigStep]) -> None:
        """Create the missing nodes of every instance the plan leaves standing for a sandbox
        (created or kept), as the agent does for all its devices at start. A node that still
        cannot be made is left to the launch, which fails naming it and its command."""
        if self.device_nodes is None:
            return
        uuids = [s.mig_uuid for s in steps if s.action in ("create", "keep") and s.mig_uuid]
        if not uuids:
            return
        try:
            ran = self.device_nodes.create_missing(uuids)
        except DriverError as exc:
            log.warning("fleet plan %s: device nodes of the new MIG instances not made: %s", plan_id, exc)
            return
        if ran:
            log.info("fleet plan %s: made device nodes with %s", plan_id, [" ".join(argv) for argv in ran])

    def retire_mps(self, plan: MigPlan, busy: dict[str, str]) -> None:
        """Quit the MPS daemon of each free instance the plan destroys, before the destroy: an
        MPS server outlives its last client and keeps the instance in use, so NVML would refuse
        the destroy part-way through the re-layout (review §2.2). Busy instances are left to
        the MIG manager, which refuses the plan for them before changing anything."""
        for move in plan.moves:
            if move.kind in (DESTROY, MIGRATE) and move.instance and move.instance not in busy:
                try:
                    self.context.mps_daemons.retire(move.instance)
                except (MpsError, OSError) as exc:
                    raise MigError(
                        f"MPS daemon of {move.instance} did not stop before its destroy: {exc}"
                    ) from exc
