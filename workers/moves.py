"""A host's part of a fleet plan: checkpoint and stop sandboxes, then change the MIG layout.

``portal.control.plans`` sends each host ``execute_plan`` with the sandboxes it must stop and,
for a MIG re-layout, the plan itself. The agent answers with one ``plan_executed`` report;
the control worker relaunches the sandboxes on their new slots. Nothing here touches the
database.

The checkpoint hook is the operator's: ``SANDBOX_CHECKPOINT_HOOK`` names an executable run
as ``<hook> checkpoint`` before a sandbox is stopped, with the sandbox in its environment
(``GPUSHARE_SANDBOX_ID``, ``GPUSHARE_ALLOCATION_ID``, ``GPUSHARE_DRIVER``,
``GPUSHARE_SANDBOX_REF``, ``GPUSHARE_PLAN_ID``). It might ask the job to save its state, or
run CRIU. A hook that fails or outlasts ``SANDBOX_CHECKPOINT_TIMEOUT_S`` leaves that
sandbox running; in a MIG re-layout it also calls the whole re-layout off, since the plan's
layout needs the sandbox out of its instance.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.defrag import DESTROY, MIGRATE, MigPlan
from workers.drivers.base import DriverError, SandboxHandle
from workers.gpu.mig import MigError, MigStep
from workers.gpu.mps import MpsError

if TYPE_CHECKING:
    from workers.agent import Agent

log = logging.getLogger(__name__)


@dataclass
class MoveResult:
    """What became of one sandbox the plan asked this host to stop."""

    sandbox_id: int
    allocation_id: str
    stopped_ms: int | None = None  # None: still running where it was
    checkpoint: tuple[bool, str] | None = None  # (ok, what the hook said); None: no hook
    message: str = ""


@dataclass
class PlanOutcome:
    results: list[MoveResult] = field(default_factory=list)
    mig_steps: list[MigStep] = field(default_factory=list)
    error: str = ""

    def report(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
        return [asdict(r) for r in self.results], [asdict(s) for s in self.mig_steps], self.error


def run_checkpoint_hook(
    handle: SandboxHandle, plan_id: int, hook: str, timeout: int
) -> tuple[bool, str] | None:
    """Run the operator's checkpoint hook for one sandbox: (ok, message), None without a hook
    (``hook`` "-")."""
    if hook == "-":
        return None
    env = {
        **os.environ,
        "GPUSHARE_SANDBOX_ID": str(handle.sandbox_id),
        "GPUSHARE_ALLOCATION_ID": handle.allocation_id,
        "GPUSHARE_DRIVER": handle.driver,
        "GPUSHARE_SANDBOX_REF": handle.ref,
        "GPUSHARE_PLAN_ID": str(plan_id),
    }
    started = time.monotonic()
    try:
        done = subprocess.run(  # noqa: S603 - the operator's own hook, no shell
            [hook, "checkpoint"], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return False, f"checkpoint hook {hook} ran past {timeout} s"
    except OSError as exc:
        return False, f"checkpoint hook {hook} could not run: {exc}"
    took = time.monotonic() - started
    said = (done.stdout.strip() or done.stderr.strip()).splitlines()[-1:] or [""]
    if done.returncode != 0:
        return False, f"checkpoint hook exited with {done.returncode}: {said[0]}"[:300]
    return True, f"checkpoint done in {took:.1f} s" + (f": {said[0]}" if said[0] else "")


def retire_mps(agent: Agent, plan: MigPlan, busy: dict[str, str]) -> None:
    """Quit the MPS daemon of each free instance the plan destroys, before the destroy: an MPS
    server outlives its last client and keeps the instance in use, so NVML would refuse the
    destroy part-way through the re-layout (review §2.2). Busy instances are left to the MIG
    manager, which refuses the plan for them before changing anything."""
    for move in plan.moves:
        if move.kind in (DESTROY, MIGRATE) and move.instance and move.instance not in busy:
            try:
                agent.mps_daemons.retire(move.instance)
            except (MpsError, OSError) as exc:
                raise MigError(
                    f"MPS daemon of {move.instance} did not stop before its destroy: {exc}"
                ) from exc


def execute_plan(
    agent: Agent,
    plan_id: int,
    stops: list[dict[str, Any]],
    mig_plan: dict[str, Any] | None,
    busy: dict[str, str],
) -> PlanOutcome:
    """Checkpoint and stop each sandbox in ``stops``, then apply ``mig_plan`` (if any).

    Idempotent: a sandbox already gone counts as stopped, and the MIG manager skips work
    already done, so a redelivered message repeats nothing harmful.
    """
    outcome = PlanOutcome()
    called_off = ""
    for order in stops:
        key, sandbox_id = order["allocation_id"], int(order["sandbox_id"])
        result = MoveResult(sandbox_id, key)
        outcome.results.append(result)
        if called_off:
            result.message = f"not stopped: {called_off}"
            continue
        handle = SandboxHandle.from_json(order["handle"]) if order.get("handle") else agent.find(key)
        if handle is not None:
            result.checkpoint = run_checkpoint_hook(
                handle, plan_id, agent.settings.checkpoint_hook, agent.settings.checkpoint_timeout_s
            )
            if result.checkpoint is not None and not result.checkpoint[0]:
                result.message = result.checkpoint[1]
                if mig_plan is not None:
                    called_off = (
                        f"the re-layout was called off: sandbox {sandbox_id}'s {result.checkpoint[1]}"
                    )
                continue
        try:
            agent.stop_quietly(key, handle)
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
            # The control plane's busy set, and what this agent itself still runs on MIG
            # instances: never destroy an instance under a live sandbox.
            still = {**busy, **agent.mig_instances_in_use()}
            plan = MigPlan.from_json(mig_plan)
            try:
                retire_mps(agent, plan, still)
                outcome.mig_steps = agent.mig.execute_plan(plan, still)
            except MigError as exc:
                outcome.error, outcome.mig_steps = str(exc), exc.steps
                log.error("fleet plan %s: MIG re-layout failed: %s", plan_id, exc)
    return outcome
