"""MIG layouts on a host's GPUs: make a GPU hold exactly a wanted set of instances.

The control plane decides layouts (``scheduler.defrag`` plans re-layouts); this module only
carries them out through a ``GpuBackend``, with three rules an operator relies on:

* Validate first. The target layout is checked with ``scheduler.gpus.check_layout`` and
  every instance to destroy is checked against the busy set before anything changes, so a
  refused request leaves the GPU exactly as it was.
* Never destroy an instance that holds a sandbox. NVML itself refuses only while processes
  run (a sandbox between two jobs would lose its slice); the busy set is the control
  plane's word on which instances are allocated.
* Destroy, then create. Every intermediate layout is then a subset of either the old or the
  new layout, both legal, so no step can fail for lack of room.

Both entry points are idempotent: a repeated message finds its work done and does nothing.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.defrag import CREATE, DESTROY, MIGRATE, MigPlan
from scheduler.gpus import CATALOG, GpuModel, check_layout
from workers.gpu.base import GpuBackend, GpuBackendError, MigDevice

# What a busy set may be: MIG uuids, or MIG uuid -> sandbox, which names the sandbox in errors.
Busy = Mapping[str, str] | Collection[str]


@dataclass(frozen=True)
class MigStep:
    """One change made on a GPU, in the order it was made."""

    action: str  # "destroy" | "create" | "keep" (a plan's instance found already standing)
    gpu: str
    profile: str
    start: int
    mig_uuid: str  # the instance destroyed, created or kept
    sandbox: str = ""  # for plan steps: the sandbox that left (destroy) or goes into (create) it


class MigError(GpuBackendError):
    """A layout change refused or failed; ``steps`` are the changes made before it stopped."""

    def __init__(self, message: str, steps: Sequence[MigStep] = ()) -> None:
        super().__init__(message)
        self.steps = list(steps)


@dataclass
class _Work:
    """What one GPU must lose and gain, checked and ready to run."""

    gpu: str
    destroy: list[MigDevice] = field(default_factory=list)
    create: list[tuple[str, int, str]] = field(default_factory=list)  # (profile, start, sandbox)
    sandbox_of: dict[str, str] = field(default_factory=dict)  # destroyed MIG uuid -> sandbox
    keep: list[MigStep] = field(default_factory=list)  # instances reused as they stand


class MigManager:
    """Carries out MIG layouts on one host's GPUs through ``backend``.

    One change at a time per manager: the agent may receive two layout messages at once,
    and a diff taken while another call is half done would undo its work.
    """

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()

    # -- one GPU, one wanted layout ------------------------------------------------------------

    def apply(self, gpu_uuid: str, layout: Sequence[tuple[str, int]], busy: Busy = ()) -> list[MigStep]:
        """Make ``gpu_uuid`` hold exactly ``layout`` ([(profile, start), ...]).

        Instances already in place stay (same profile and start: their UUIDs and sandboxes
        survive); the others are destroyed, then the missing ones created. ``busy`` holds the
        MIG uuids that carry a sandbox; destroying one of them is refused. Returns the steps
        taken, [] when the GPU already holds ``layout``.
        """
        wanted = [(str(profile), int(start)) for profile, start in layout]
        with self._lock:
            model = self._model(gpu_uuid)
            problems = check_layout(model, wanted)
            if problems:
                raise MigError(f"refusing MIG layout {_show(wanted)} on {gpu_uuid}: {'; '.join(problems)}")
            current = self.backend.mig_layout(gpu_uuid)
            missing = Counter(wanted)
            doomed = []
            for device in current:
                key = (device.profile, device.start)
                if device.usable and missing[key] > 0:
                    missing[key] -= 1  # already there: keep it, with its sandbox
                else:
                    doomed.append(device)
            work = _Work(gpu_uuid, doomed, _take(missing, wanted))
            _refuse_busy(work, busy)
            return self._run([work])

    # -- a defragmentation plan ------------------------------------------------------------------

    def execute_plan(self, plan: MigPlan, busy_after_stop: Busy = ()) -> list[MigStep]:
        """Carry out the GPU side of a ``scheduler.defrag`` plan on this host.

        The control plane first stops the sandboxes the plan disturbs (``plan.disturbed``),
        then calls this with the MIG uuids still busy after that, then relaunches each
        disturbed sandbox on the instance the returned ``create`` (or ``keep``) step names.

        A MIGRATE is a destroy at its home GPU and a create on ``to_gpu``; per GPU every
        destroy runs before any create, so each intermediate layout is a subset of the old or
        of the new one. All of the plan is checked before the first change: the instances to
        destroy must exist and be free, and every GPU's resulting layout must be legal.

        Idempotent: a destroy whose instance is already gone is skipped, and a create whose
        instance already stands (free, or holding the sandbox the create is for) is reported
        as a ``keep`` step, so a redelivered plan changes nothing yet still names each
        sandbox's instance. Pass ``busy_after_stop`` as MIG uuid -> sandbox for that.
        Returns the steps: destroys, then creates, then keeps.
        """
        with self._lock:
            works: dict[str, _Work] = {}
            layouts: dict[str, list[MigDevice]] = {}

            def work_for(gpu: str) -> _Work:
                if gpu not in works:
                    works[gpu] = _Work(gpu)
                    layouts[gpu] = self.backend.mig_layout(gpu)
                return works[gpu]

            for move in plan.moves:
                if move.kind not in (CREATE, DESTROY, MIGRATE):
                    raise MigError(f"unknown MIG move kind {move.kind!r} in the plan for {plan.profile}")
                if move.kind in (DESTROY, MIGRATE):
                    work = work_for(move.gpu)
                    device = next((d for d in layouts[move.gpu] if d.uuid == move.instance), None)
                    if device is not None:
                        _expect(device, move.profile, move.start)
                        work.destroy.append(device)
                        work.sandbox_of[device.uuid] = move.sandbox
                if move.kind == CREATE:
                    work_for(move.gpu).create.append((move.profile, move.start, move.sandbox))
                elif move.kind == MIGRATE:
                    work_for(move.to_gpu).create.append((move.profile, move.to_start, move.sandbox))
            for work in works.values():
                self._settle(work, layouts[work.gpu], busy_after_stop)
                _refuse_busy(work, busy_after_stop)
            return self._run(list(works.values()))

    # -- shared machinery --------------------------------------------------------------------------

    def _settle(self, work: _Work, current: list[MigDevice], busy: Busy) -> None:
        """Match each create with an instance already standing there; check the end layout.

        Such an instance is left alone and its sandbox, if any, goes into it (a ``keep``
        step says so): an earlier delivery of the plan made it, or the plan destroys an idle
        instance only to make the same one again. One that holds another sandbox is never
        taken over, so the create then fails the layout check instead.
        """
        creates = []
        taken: set[str] = set()
        for profile, start, sandbox in work.create:
            match = next(
                (
                    d
                    for d in current
                    if d.uuid not in taken
                    and (d.profile, d.start) == (profile, start)
                    and _holder(busy, d.uuid) in (None, sandbox or None)
                ),
                None,
            )
            if match is None:
                creates.append((profile, start, sandbox))
                continue
            taken.add(match.uuid)
            work.destroy = [d for d in work.destroy if d.uuid != match.uuid]
            if sandbox:
                work.keep.append(MigStep("keep", work.gpu, profile, start, match.uuid, sandbox))
        work.create = creates
        leaving = {d.uuid for d in work.destroy}
        final = [(d.profile, d.start) for d in current if d.uuid not in leaving]
        final += [(p, s) for p, s, _ in creates]
        problems = check_layout(self._model(work.gpu), final)
        if problems:
            raise MigError(f"the plan would leave {work.gpu} with {_show(final)}: {'; '.join(problems)}")

    def _run(self, works: Sequence[_Work]) -> list[MigStep]:
        steps: list[MigStep] = []
        try:
            for work in works:
                for device in work.destroy:
                    self.backend.destroy_mig(work.gpu, device.uuid)
                    steps.append(
                        MigStep(
                            "destroy",
                            work.gpu,
                            device.profile,
                            device.start,
                            device.uuid,
                            work.sandbox_of.get(device.uuid, ""),
                        )
                    )
            for work in works:
                for profile, start, sandbox in work.create:
                    made = self.backend.create_mig(work.gpu, profile, start)
                    steps.append(MigStep("create", work.gpu, profile, start, made.uuid, sandbox))
        except GpuBackendError as err:
            raise MigError(f"MIG change stopped after {len(steps)} step(s): {err}", steps) from err
        return steps + [step for work in works for step in work.keep]

    def _model(self, gpu_uuid: str) -> GpuModel:
        info = next((g for g in self.backend.list_gpus() if g.uuid == gpu_uuid), None)
        if info is None:
            raise MigError(f"no GPU {gpu_uuid} on this host")
        if not info.mig_enabled:
            raise MigError(f"MIG mode is disabled on {gpu_uuid} ({info.name})")
        model = CATALOG.get(info.model)
        if model is None or not model.mig_capable:
            raise MigError(f"no MIG geometry known for {info.name} ({gpu_uuid})")
        return model


def _take(missing: Counter[tuple[str, int]], wanted: Sequence[tuple[str, int]]) -> list[tuple[str, int, str]]:
    """The wanted instances still missing, each as many times as it is missing, in order."""
    left = Counter(missing)
    out = []
    for profile, start in wanted:
        if left[(profile, start)] > 0:
            left[(profile, start)] -= 1
            out.append((profile, start, ""))
    return out


def _holder(busy: Busy, mig_uuid: str) -> str | None:
    """The sandbox in ``mig_uuid``: None when free, "" when busy with an unnamed one."""
    if mig_uuid not in busy:
        return None
    return busy[mig_uuid] if isinstance(busy, Mapping) else ""


def _refuse_busy(work: _Work, busy: Busy) -> None:
    for device in work.destroy:
        holder = _holder(busy, device.uuid)
        if holder is not None:
            holder = holder or work.sandbox_of.get(device.uuid, "")
            who = f"sandbox {holder}" if holder else "a sandbox"
            raise MigError(
                f"refusing to destroy MIG {device.profile}@{device.start} ({device.uuid}) on "
                f"{work.gpu}: it holds {who}; stop the sandbox first"
            )


def _expect(device: MigDevice, profile: str, start: int) -> None:
    """A plan move must name the instance as it is: a mismatch means a stale plan."""
    if (device.profile, device.start) != (profile, start):
        raise MigError(
            f"stale plan: {device.uuid} is {device.profile}@{device.start} on "
            f"{device.parent_uuid}, the plan says {profile}@{start}"
        )


def _show(layout: Iterable[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{p}@{s}" for p, s in layout) + "]"
