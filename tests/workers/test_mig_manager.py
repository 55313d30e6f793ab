"""MigManager on the simulated backend: layouts applied by diff, busy instances kept, and
defragmentation plans from ``scheduler.defrag.plan_mig`` carried out to their exact target."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from scheduler.defrag import (
    CREATE,
    DESTROY,
    MIGRATE,
    MigGpu,
    MigInstance,
    MigMove,
    MigPlan,
    apply_mig_plan,
    plan_mig,
)
from scheduler.gpus import MODELS, check_layout, placeable_starts
from workers.gpu.base import GpuBackendError, MigDevice
from workers.gpu.mig import MigError, MigManager, MigStep
from workers.gpu.simulated import SimulatedBackend, SimulatedGpuConfig

H100 = MODELS["H100-80GB"]


def mig_host(gpus: int = 1, layout: tuple[tuple[str, int], ...] = ()) -> tuple[SimulatedBackend, list[str]]:
    """MIG-enabled H100s; each starts with ``layout`` (empty: no instances)."""
    configs = [SimulatedGpuConfig("H100-80GB", mig=True, mig_layout=layout or (("7g.80gb", 0),))] * gpus
    backend = SimulatedBackend("host-m", configs)
    uuids = [g.uuid for g in backend.list_gpus()]
    if not layout:
        for uuid in uuids:
            for mig in backend.mig_layout(uuid):
                backend.destroy_mig(uuid, mig.uuid)
    return backend, uuids


def layout_of(backend: SimulatedBackend, gpu: str) -> list[tuple[str, int]]:
    return sorted((m.profile, m.start) for m in backend.mig_layout(gpu))


# -- apply -----------------------------------------------------------------------------------


def test_apply_builds_a_layout_and_is_idempotent() -> None:
    backend, (gpu,) = mig_host()
    manager = MigManager(backend)
    wanted = [("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)]
    steps = manager.apply(gpu, wanted)
    assert [(s.action, s.profile, s.start) for s in steps] == [("create", p, s) for p, s in wanted]
    assert {s.mig_uuid for s in steps} == {m.uuid for m in backend.mig_layout(gpu)}
    assert all(s.gpu == gpu for s in steps)
    assert layout_of(backend, gpu) == sorted(wanted)
    assert manager.apply(gpu, wanted) == []
    assert manager.apply(gpu, list(reversed(wanted))) == []  # order does not matter


def test_apply_keeps_what_stays_destroys_before_it_creates() -> None:
    backend, (gpu,) = mig_host(layout=(("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)))
    manager = MigManager(backend)
    kept = next(m for m in backend.mig_layout(gpu) if m.profile == "3g.40gb")
    steps = manager.apply(gpu, [("3g.40gb", 4), ("4g.40gb", 0)], busy={kept.uuid: "sb-7"})
    assert [(s.action, s.profile, s.start) for s in steps] == [
        ("destroy", "2g.20gb", 0),
        ("destroy", "1g.10gb", 2),
        ("destroy", "1g.10gb", 3),
        ("create", "4g.40gb", 0),
    ]
    assert kept in backend.mig_layout(gpu)  # same instance, same UUID: its sandbox lives on
    assert layout_of(backend, gpu) == [("3g.40gb", 4), ("4g.40gb", 0)]
    assert manager.apply(gpu, []) == [
        MigStep("destroy", gpu, "4g.40gb", 0, steps[-1].mig_uuid),
        MigStep("destroy", gpu, "3g.40gb", 4, kept.uuid),
    ]


def test_apply_handles_repeated_profiles() -> None:
    backend, (gpu,) = mig_host(layout=(("1g.10gb", 0), ("1g.10gb", 1)))
    wanted = [("1g.10gb", s) for s in range(7)]
    steps = MigManager(backend).apply(gpu, wanted)
    assert [(s.action, s.start) for s in steps] == [("create", s) for s in range(2, 7)]
    assert layout_of(backend, gpu) == wanted


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ([("3g.40gb", 2)], r"3g\.40gb cannot start at memory slice 2 \(legal: 0, 4\)"),
        ([("7g.80gb", 0), ("1g.10gb", 0)], r"1g\.10gb@0 overlaps 7g\.80gb@0"),
        ([("1g.10gb+me", 0), ("1g.10gb+me", 1)], r"2 instances with media extensions"),
        ([("5g.50gb", 0)], r"no MIG profile '5g\.50gb'"),
    ],
)
def test_illegal_layout_is_refused_before_anything_changes(
    layout: list[tuple[str, int]], message: str
) -> None:
    backend, (gpu,) = mig_host(layout=(("4g.40gb", 0), ("3g.40gb", 4)))
    before = backend.mig_layout(gpu)
    with pytest.raises(MigError, match=rf"refusing MIG layout .* on {gpu}: .*{message}"):
        MigManager(backend).apply(gpu, layout)
    assert backend.mig_layout(gpu) == before


def test_busy_instance_is_never_destroyed() -> None:
    backend, (gpu,) = mig_host(layout=(("4g.40gb", 0), ("3g.40gb", 4)))
    before = backend.mig_layout(gpu)
    busy = next(m for m in before if m.profile == "3g.40gb")
    manager = MigManager(backend)
    pattern = rf"refusing to destroy MIG 3g\.40gb@4 \({busy.uuid}\) on {gpu}: it holds sandbox 42"
    with pytest.raises(MigError, match=pattern):
        manager.apply(gpu, [("7g.80gb", 0)], busy={busy.uuid: "42"})
    with pytest.raises(MigError, match="it holds a sandbox; stop the sandbox first"):
        manager.apply(gpu, [("4g.40gb", 0), ("2g.20gb", 4)], busy={busy.uuid})
    assert backend.mig_layout(gpu) == before  # refused whole: not even the idle 4g went


def test_gpu_that_cannot_take_a_layout() -> None:
    backend = SimulatedBackend("host-p", [SimulatedGpuConfig("H100-80GB")])
    manager = MigManager(backend)
    plain = backend.list_gpus()[0].uuid
    with pytest.raises(MigError, match=f"MIG mode is disabled on {plain}"):
        manager.apply(plain, [("7g.80gb", 0)])
    with pytest.raises(MigError, match="no GPU GPU-nope on this host"):
        manager.apply("GPU-nope", [])


class FailingCreate(SimulatedBackend):
    """A backend whose next create fails, as NVML can (e.g. the driver runs out of memory)."""

    def create_mig(self, uuid: str, profile: str, start: int) -> MigDevice:
        raise GpuBackendError(f"create MIG {profile}@{start} on {uuid}: Insufficient Resources")


def test_a_failure_midway_reports_the_steps_already_taken() -> None:
    backend = FailingCreate(
        "host-f", [SimulatedGpuConfig("H100-80GB", mig=True, mig_layout=(("7g.80gb", 0),))]
    )
    gpu = backend.list_gpus()[0].uuid
    with pytest.raises(MigError, match=r"stopped after 1 step\(s\): create MIG 3g\.40gb@0") as caught:
        MigManager(backend).apply(gpu, [("3g.40gb", 0)])
    assert [(s.action, s.profile) for s in caught.value.steps] == [("destroy", "7g.80gb")]
    assert isinstance(caught.value, GpuBackendError)  # the agent's one exception type


# -- plans -----------------------------------------------------------------------------------


def fleet_of(backend: SimulatedBackend, sandbox_of: dict[str, str]) -> list[MigGpu]:
    """The control plane's picture of this host, as it would hand it to plan_mig."""
    return [
        MigGpu(
            g.uuid,
            g.model,
            tuple(MigInstance(m.uuid, m.profile, m.start, sandbox_of.get(m.uuid, "")) for m in g.mig_devices),
        )
        for g in backend.list_gpus()
    ]


def run_plan(
    backend: SimulatedBackend, sandbox_of: dict[str, str], profile: str
) -> tuple[MigPlan, list[MigStep]]:
    """Plan, stop the disturbed sandboxes, execute, relaunch: the control plane's dance."""
    fleet = fleet_of(backend, sandbox_of)
    plan = plan_mig(fleet, profile)
    assert plan is not None
    disturbed = set(plan.disturbed)
    for mig, sandbox in list(sandbox_of.items()):
        backend.note_load(sandbox, [mig], 1000, 50.0)
    for mig, sandbox in list(sandbox_of.items()):
        if sandbox in disturbed:
            backend.forget_load(sandbox)  # the control plane stopped it
            del sandbox_of[mig]
    steps = MigManager(backend).execute_plan(plan, busy_after_stop=dict(sandbox_of))
    for step in steps:
        if step.action in ("create", "keep") and step.sandbox:
            sandbox_of[step.mig_uuid] = step.sandbox  # relaunched on its new instance
            backend.note_load(step.sandbox, [step.mig_uuid], 1000, 50.0)
    # The backend now holds exactly the plan's target, legal on every GPU.
    target = {g.uuid: sorted(g.layout()) for g in apply_mig_plan(fleet, plan)}
    for gpu in backend.list_gpus():
        assert layout_of(backend, gpu.uuid) == target[gpu.uuid]
        assert check_layout(H100, layout_of(backend, gpu.uuid)) == []
    assert plan.start in placeable_starts(H100, profile, layout_of(backend, plan.gpu))
    # Every sandbox is somewhere, once; the undisturbed ones never moved.
    assert sorted(sandbox_of.values()) == sorted(i.sandbox for g in fleet for i in g.instances if i.busy)
    return plan, steps


def test_plan_with_a_migration_and_local_moves() -> None:
    # GPU 0: 1g busy at 0, 1g busy at 4, 2g idle at 2 -> a 4g.40gb (start 0 only) needs the
    # 1g@0 out of the way; GPU 1 has room for it.
    backend, (a, b) = mig_host(2, layout=(("1g.10gb", 0), ("2g.20gb", 2), ("1g.10gb", 4), ("1g.10gb", 5)))
    on_a = {(m.profile, m.start): m.uuid for m in backend.mig_layout(a)}
    on_b = {(m.profile, m.start): m.uuid for m in backend.mig_layout(b)}
    sandbox_of = {on_a[("1g.10gb", 0)]: "sb-1", on_a[("1g.10gb", 4)]: "sb-2", on_b[("1g.10gb", 0)]: "sb-3"}
    plan, steps = run_plan(backend, sandbox_of, "4g.40gb")
    assert plan.disturbed  # something had to move
    # Per GPU, every destroy came before every create.
    for gpu in (a, b):
        actions = [s.action for s in steps if s.gpu == gpu and s.action != "keep"]
        assert actions == sorted(actions, key=lambda x: x != "destroy")
    placed = {s.sandbox: s.mig_uuid for s in steps if s.action in ("create", "keep") and s.sandbox}
    assert set(placed) == set(plan.disturbed)
    # Redelivered: nothing changes, and each moved sandbox is still told where it lives.
    again = MigManager(backend).execute_plan(plan, dict(sandbox_of))
    assert {s.action for s in again} <= {"keep"}
    assert {s.sandbox: s.mig_uuid for s in again} == placed


def test_plans_on_random_fleets_reach_their_target() -> None:
    rng = random.Random(7)
    kinds: Counter[str] = Counter()
    profiles = [p.name for p in H100.mig_profiles]
    for _ in range(40):
        backend, gpus = mig_host(3)
        sandbox_of: dict[str, str] = {}
        for gpu in gpus:
            layout: list[tuple[str, int]] = []
            for _ in range(rng.randint(1, 7)):
                profile = rng.choice(profiles)
                starts = placeable_starts(H100, profile, layout)
                if starts:
                    layout.append((profile, rng.choice(starts)))
            for step in MigManager(backend).apply(gpu, layout):
                if rng.random() < 0.6:
                    sandbox_of[step.mig_uuid] = f"sb-{len(sandbox_of)}"
        wanted = rng.choice(["3g.40gb", "4g.40gb", "2g.20gb", "7g.80gb"])
        fleet = fleet_of(backend, sandbox_of)
        if plan_mig(fleet, wanted) is None:
            continue
        plan, _ = run_plan(backend, sandbox_of, wanted)
        kinds.update(m.kind for m in plan.moves)
    assert kinds[MIGRATE] and kinds[DESTROY] and kinds[CREATE]  # every kind was exercised


def test_plan_refused_while_a_disturbed_sandbox_still_runs() -> None:
    backend, (a, b) = mig_host(2, layout=(("1g.10gb", 0), ("2g.20gb", 2), ("1g.10gb", 4), ("1g.10gb", 5)))
    sandbox_of = {
        m.uuid: f"sb-{g[-4:]}-{m.start}" for g in (a, b) for m in backend.mig_layout(g) if m.start in (0, 4)
    }
    plan = plan_mig(fleet_of(backend, sandbox_of), "4g.40gb")
    assert plan is not None and plan.disturbed
    before = {g: backend.mig_layout(g) for g in (a, b)}
    with pytest.raises(MigError, match=r"refusing to destroy MIG 1g\.10gb@\d .* it holds sandbox sb-"):
        MigManager(backend).execute_plan(plan, busy_after_stop=sandbox_of)  # nobody stopped
    assert {g: backend.mig_layout(g) for g in (a, b)} == before


def test_stale_or_broken_plans_are_refused() -> None:
    backend, (gpu,) = mig_host(layout=(("4g.40gb", 0), ("3g.40gb", 4)))
    three = next(m for m in backend.mig_layout(gpu) if m.profile == "3g.40gb")
    manager = MigManager(backend)
    stale = MigPlan("1g.10gb", gpu, 4, (MigMove(DESTROY, gpu, "2g.20gb", 4, instance=three.uuid),), ())
    with pytest.raises(MigError, match=r"stale plan: .* is 3g\.40gb@4 .* the plan says 2g\.20gb@4"):
        manager.execute_plan(stale)
    crowded = MigPlan("1g.10gb", gpu, 4, (MigMove(CREATE, gpu, "1g.10gb", 4),), ())
    with pytest.raises(MigError, match=r"the plan would leave .* 1g\.10gb@4 overlaps"):
        manager.execute_plan(crowded)
    odd = MigPlan("1g.10gb", gpu, 4, (MigMove("teleport", gpu, "1g.10gb", 4),), ())
    with pytest.raises(MigError, match="unknown MIG move kind 'teleport'"):
        manager.execute_plan(odd)
    assert layout_of(backend, gpu) == [("3g.40gb", 4), ("4g.40gb", 0)]
