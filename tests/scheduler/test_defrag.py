"""Defragmentation planners: fixed cases with known optimal answers, and properties."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.defrag import (
    CREATE,
    DESTROY,
    MIGRATE,
    MigGpu,
    MigInstance,
    MigMove,
    MigPlan,
    Share,
    SharedGpu,
    ShareMigration,
    SharePlan,
    apply_mig_plan,
    apply_share_plan,
    place_mig,
    plan_consolidation,
    plan_mig,
)
from scheduler.gpus import CATALOG, check_layout, placeable_starts

H100 = "H100-80GB"


def busy(gpu: str, profile: str, start: int) -> MigInstance:
    return MigInstance(f"{gpu}/{profile}@{start}", profile, start, f"sb-{gpu}-{start}")


def idle(gpu: str, profile: str, start: int) -> MigInstance:
    return MigInstance(f"{gpu}/{profile}@{start}", profile, start)


def mig_gpu(uuid: str, *instances: MigInstance, model: str = H100, available: bool = True) -> MigGpu:
    return MigGpu(uuid, model, instances, available)


def sandboxes(fleet: list[MigGpu]) -> Counter[tuple[str, str]]:
    return Counter((i.sandbox, i.profile) for g in fleet for i in g.instances if i.busy)


def check_plan(fleet: list[MigGpu], plan: MigPlan) -> list[MigGpu]:
    """Apply ``plan`` and assert what every plan must satisfy; the fleet after it."""
    after = apply_mig_plan(fleet, plan)  # raises on any illegal intermediate layout
    for gpu in after:
        assert check_layout(CATALOG[gpu.model], gpu.layout()) == []
    target = next(g for g in after if g.uuid == plan.gpu)
    assert plan.start in placeable_starts(CATALOG[target.model], plan.profile, target.layout())
    assert sandboxes(after) == sandboxes(fleet)
    touched = {m.sandbox for m in plan.moves if m.sandbox}
    assert touched == set(plan.disturbed) and len(plan.disturbed) == len(set(plan.disturbed))
    before = {(g.uuid, i.sandbox, i.start) for g in fleet for i in g.instances if i.busy}
    unmoved = {(g.uuid, i.sandbox, i.start) for g in after for i in g.instances if i.busy}
    assert {sb for _, sb, _ in before - unmoved} <= set(plan.disturbed)
    return after


# -- MIG: fixed cases ------------------------------------------------------------------------


def test_fits_already_means_an_empty_plan() -> None:
    fleet = [mig_gpu("A", busy("A", "3g.40gb", 0))]
    plan = plan_mig(fleet, "3g.40gb")
    assert plan == MigPlan("3g.40gb", "A", 4, (), ())


def test_idle_instances_go_for_free() -> None:
    fleet = [mig_gpu("A", *(idle("A", "1g.10gb", s) for s in range(7)))]
    plan = plan_mig(fleet, "7g.80gb")
    assert plan is not None and plan.disturbed == () and (plan.gpu, plan.start) == ("A", 0)
    assert [m.kind for m in plan.moves] == [DESTROY] * 7
    check_plan(fleet, plan)


def test_one_move_within_the_gpu() -> None:
    """1g at 0, 2, 4, 6: any 2g start overlaps one of them; moving it to a hole is optimal."""
    fleet = [mig_gpu("A", *(busy("A", "1g.10gb", s) for s in (0, 2, 4, 6)))]
    plan = plan_mig(fleet, "2g.20gb")
    assert plan is not None
    assert plan.moves == (
        MigMove(DESTROY, "A", "1g.10gb", 0, "A/1g.10gb@0", "sb-A-0"),
        MigMove(CREATE, "A", "1g.10gb", 3, sandbox="sb-A-0"),
    )
    assert (plan.gpu, plan.start, plan.disturbed) == ("A", 0, ("sb-A-0",))
    check_plan(fleet, plan)


def test_migration_when_the_gpu_has_no_room() -> None:
    """A: 4g@0 + 1g@4, B: 2g@0 + 1g@2 + 3g@4 (slice 3 free). One migration lets 3g in at A:4."""
    fleet = [
        mig_gpu("A", busy("A", "4g.40gb", 0), busy("A", "1g.10gb", 4)),
        mig_gpu("B", busy("B", "2g.20gb", 0), busy("B", "1g.10gb", 2), busy("B", "3g.40gb", 4)),
    ]
    plan = plan_mig(fleet, "3g.40gb")
    assert plan is not None
    assert plan.moves == (MigMove(MIGRATE, "A", "1g.10gb", 4, "A/1g.10gb@4", "sb-A-4", "B", 3),)
    assert (plan.gpu, plan.start, plan.disturbed) == ("A", 4, ("sb-A-4",))
    check_plan(fleet, plan)


def test_prefers_the_gpu_that_disturbs_fewest() -> None:
    """A needs two 1g moved for a 3g at either start, B only one: B wins though A comes first."""
    fleet = [
        mig_gpu("A", *(busy("A", "1g.10gb", s) for s in (1, 2, 4, 6))),
        mig_gpu("B", busy("B", "4g.40gb", 0), busy("B", "1g.10gb", 5)),
    ]
    plan = plan_mig(fleet, "3g.40gb")
    assert plan is not None and plan.gpu == "B" and plan.disturbed == ("sb-B-5",)
    assert plan.moves[0].kind == MIGRATE and plan.moves[0].to_gpu == "A"
    check_plan(fleet, plan)


def test_media_extension_stays_one_per_gpu() -> None:
    """A +me request where a busy +me sits: that one cannot stay, nor go to a GPU with a +me."""
    fleet = [
        mig_gpu("A", busy("A", "1g.10gb+me", 0), busy("A", "3g.40gb", 4)),
        mig_gpu("B", busy("B", "1g.10gb+me", 0), *(busy("B", "1g.10gb", s) for s in range(1, 6))),
    ]
    assert place_mig(fleet, "1g.10gb+me") is None
    assert plan_mig(fleet, "1g.10gb+me") is None
    # A full of plain 1g, B with a +me and room: a plain 1g moves to B, the +me goes on A.
    fleet = [
        mig_gpu("A", *(busy("A", "1g.10gb", s) for s in range(7))),
        mig_gpu("B", busy("B", "4g.40gb", 0), busy("B", "1g.10gb+me", 4)),
    ]
    assert place_mig(fleet, "1g.10gb+me") is None
    plan = plan_mig(fleet, "1g.10gb+me")
    assert plan is not None and plan.gpu == "A" and len(plan.disturbed) == 1
    assert [m.kind for m in plan.moves] == [MIGRATE] and plan.moves[0].to_gpu == "B"
    check_plan(fleet, plan)


def test_no_plan_when_nothing_can_move() -> None:
    fleet = [mig_gpu("A", busy("A", "3g.40gb", 0), busy("A", "3g.40gb", 4))]
    assert plan_mig(fleet, "1g.10gb") is None
    assert plan_mig([mig_gpu("T", model="T4")], "1g.10gb") is None
    assert plan_mig(fleet, "9g.90gb") is None


def test_max_disturbed_caps_the_plan() -> None:
    fleet = [mig_gpu("A", *(busy("A", "1g.10gb", s) for s in (0, 2, 4, 6)))]
    assert plan_mig(fleet, "2g.20gb", max_disturbed=0) is None
    assert plan_mig(fleet, "2g.20gb", max_disturbed=1) is not None


def test_drained_gpus_take_nothing() -> None:
    fleet = [
        mig_gpu("A", busy("A", "4g.40gb", 0), busy("A", "1g.10gb", 4)),
        mig_gpu("B", busy("B", "4g.40gb", 0), available=False),
    ]
    assert place_mig(fleet, "3g.40gb") is None
    assert plan_mig(fleet, "3g.40gb") is None  # B cannot host the request nor A's 1g


def test_migrations_stay_within_a_model() -> None:
    fleet = [
        mig_gpu("A", busy("A", "4g.40gb", 0), busy("A", "1g.10gb", 4)),
        mig_gpu("B", model="A100-80GB"),
    ]
    plan = plan_mig(fleet, "3g.40gb")
    assert plan is not None and plan.gpu == "B" and plan.disturbed == ()


def test_apply_rejects_an_illegal_move() -> None:
    fleet = [mig_gpu("A", busy("A", "4g.40gb", 0))]
    bad = MigPlan("3g.40gb", "A", 0, (MigMove(CREATE, "A", "3g.40gb", 0),), ())
    with pytest.raises(ValueError, match="overlaps"):
        apply_mig_plan(fleet, bad)
    with pytest.raises(ValueError, match="no MIG instance"):
        apply_mig_plan(fleet, MigPlan("3g.40gb", "A", 0, (MigMove(DESTROY, "A", "4g.40gb", 0, "nope"),), ()))


# -- MIG: properties -------------------------------------------------------------------------


@st.composite
def fleets(draw: st.DrawFn, max_gpus: int = 3) -> list[MigGpu]:
    fleet = []
    for g in range(draw(st.integers(1, max_gpus))):
        uuid, model = f"G{g}", CATALOG[draw(st.sampled_from(["H100-80GB", "H100-80GB", "A100-40GB"]))]
        layout: list[MigInstance] = []
        for _ in range(draw(st.integers(0, 7))):
            profile = draw(st.sampled_from(model.mig_profiles))
            starts = placeable_starts(model, profile.name, [(i.profile, i.start) for i in layout])
            if starts:
                start = draw(st.sampled_from(starts))
                maker = busy if draw(st.booleans()) or draw(st.booleans()) else idle
                layout.append(maker(uuid, profile.name, start))
        fleet.append(MigGpu(uuid, model.name, tuple(layout), draw(st.integers(0, 9)) > 0))
    return fleet


def _fits_alone(model_name: str, kept: list[tuple[str, int]], todo: list[str]) -> bool:
    """Brute force: can every profile in ``todo`` be added to ``kept`` on one GPU?"""
    if not todo:
        return True
    model = CATALOG[model_name]
    return any(
        _fits_alone(model_name, [*kept, (todo[0], s)], todo[1:])
        for s in placeable_starts(model, todo[0], kept)
    )


def _fewest_moves_alone(gpu: MigGpu, profile: str) -> int | None:
    """Brute force on a lone GPU: fewest busy instances to move so ``profile`` fits too."""
    live = [i for i in gpu.instances if i.busy]
    for count in range(len(live) + 1):
        for moved in combinations(live, count):
            kept = [(i.profile, i.start) for i in live if i not in moved]
            if _fits_alone(gpu.model, kept, [profile, *(i.profile for i in moved)]):
                return count
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), data=st.data())
def test_every_plan_is_legal_and_makes_room(fleet: list[MigGpu], data: st.DataObject) -> None:
    model = CATALOG[data.draw(st.sampled_from([g.model for g in fleet]))]
    profile = data.draw(st.sampled_from(model.mig_profiles)).name
    plan = plan_mig(fleet, profile)
    if plan is not None:
        check_plan(fleet, plan)
        assert sum(m.kind == MIGRATE for m in plan.moves) <= len(plan.disturbed)


@settings(max_examples=300, deadline=None)
@given(fleet=fleets(max_gpus=1), data=st.data())
def test_lone_gpu_plans_are_optimal(fleet: list[MigGpu], data: st.DataObject) -> None:
    gpu = replace(fleet[0], available=True)
    model = CATALOG[gpu.model]
    profile = data.draw(st.sampled_from(model.mig_profiles)).name
    plan = plan_mig([gpu], profile)
    best = _fewest_moves_alone(gpu, profile)
    assert (None if plan is None else len(plan.disturbed)) == best
    if plan is not None:
        check_plan([gpu], plan)


# -- shared GPUs -----------------------------------------------------------------------------


def shared(uuid: str, *millis: int, model: str = "T4", available: bool = True) -> SharedGpu:
    shares = tuple(Share(f"{uuid}-{i}", m, 1000) for i, m in enumerate(millis))
    return SharedGpu(uuid, model, 15109, shares, available=available)


def test_consolidation_frees_the_emptiest() -> None:
    """Used 300 + 400 + 500 of 3000: one GPU can go, best with one migration (A's share)."""
    gpus = [shared("A", 300), shared("B", 200, 200), shared("C", 500)]
    plan = plan_consolidation(gpus)
    assert plan.frees == ("A",)
    assert plan.migrations == (ShareMigration("A-0", "A", "C", 300),)


def test_consolidation_packs_onto_one_destination() -> None:
    gpus = [shared(u, 250) for u in "ABCD"]
    plan = plan_consolidation(gpus)
    assert plan.frees == ("A", "C", "D") and len(plan.migrations) == 3
    assert {m.to_gpu for m in plan.migrations} == {"B"}
    after = apply_share_plan(gpus, plan)
    assert sum(s.milli for s in after[1].shares) == 1000


def test_consolidation_moves_an_mps_share_only_beside_shares_of_its_size() -> None:
    """One size per MPS GPU: a 10 % share never joins 30 % ones, though there is room."""
    mps = [replace(g, one_size=True) for g in (shared("A", 100), shared("B", 300, 300), shared("C", 100))]
    plan = plan_consolidation(mps)
    assert plan.migrations == (ShareMigration("A-0", "A", "C", 100),)
    assert "B" not in {m.to_gpu for m in plan.migrations}
    anywhere = plan_consolidation([shared("A", 100), shared("B", 300, 300), shared("C", 100)])
    assert {m.to_gpu for m in anywhere.migrations} == {"B"}  # milli-GPU shares pack by size alone


def test_consolidation_respects_models_memory_and_drain() -> None:
    pinned = SharedGpu("A", "T4", 15109, (Share("a", 100, 1000, ("T4",)),))  # no other T4
    big = SharedGpu("B", "V100M32", 32510, (Share("b", 100, 32400),))  # fits on no other GPU
    other = SharedGpu("C", "V100M32", 32510, (Share("c", 100, 200), Share("d", 100, 200)))
    plan = plan_consolidation([pinned, big, other])
    assert plan.frees == ("C",) and {m.to_gpu for m in plan.migrations} == {"A"}
    drained = shared("D", 600, available=False)
    plan = plan_consolidation([shared("E", 100), drained, shared("F", 300)])
    assert plan.frees == ("E", "D") and plan.migrations[0] == ShareMigration("D-0", "D", "F", 600)
    assert all(m.to_gpu != "D" for m in plan.migrations)
    assert plan_consolidation([shared("E", 100), shared("F", 300)], max_migrations=0).migrations == ()


def test_apply_share_plan_checks_capacity() -> None:
    gpus = [shared("A", 600), shared("B", 600)]
    with pytest.raises(ValueError, match="over capacity"):
        apply_share_plan(gpus, SharePlan((ShareMigration("A-0", "A", "B", 600),), ()))


@st.composite
def share_fleets(draw: st.DrawFn) -> list[SharedGpu]:
    gpus = []
    for g in range(draw(st.integers(1, 8))):
        model = draw(st.sampled_from(["T4", "V100M32"]))
        memory = CATALOG[model].memory_mib
        shares: list[Share] = []
        used = mem = 0
        for s in range(draw(st.integers(0, 6))):
            milli = draw(st.integers(1, 1000))
            mib = draw(st.integers(0, memory // 3))
            models = draw(st.sampled_from([(), (), ("T4",), ("V100M32",), ("T4", "V100M32")]))
            if used + milli <= 1000 and mem + mib <= memory and (not models or model in models):
                shares.append(Share(f"s{g}-{s}", milli, mib, models))
                used, mem = used + milli, mem + mib
        gpus.append(SharedGpu(f"G{g}", model, memory, tuple(shares), available=draw(st.integers(0, 5)) > 0))
    return gpus


@settings(max_examples=300, deadline=None)
@given(gpus=share_fleets(), cap=st.one_of(st.none(), st.integers(0, 10)))
def test_consolidation_never_overfills_and_frees_what_it_claims(
    gpus: list[SharedGpu], cap: int | None
) -> None:
    plan = plan_consolidation(gpus, max_migrations=cap)
    after = apply_share_plan(gpus, plan)
    for gpu in after:
        assert sum(s.milli for s in gpu.shares) <= gpu.capacity_milli
        assert sum(s.memory_mib for s in gpu.shares) <= gpu.memory_mib
        assert all(not s.models or gpu.model in s.models for s in gpu.shares)
    freed = set(plan.frees)
    assert all(not g.shares for g in after if g.uuid in freed)
    before = {g.uuid: g for g in gpus}
    assert all(before[u].shares for u in freed)
    # Only freed GPUs lose shares, each exactly once, and never to a freed or drained GPU.
    assert len(plan.migrations) == sum(len(before[u].shares) for u in freed)
    assert all(m.from_gpu in freed and m.to_gpu not in freed for m in plan.migrations)
    assert all(before[m.to_gpu].available for m in plan.migrations)
    assert cap is None or len(plan.migrations) <= cap
    assert Counter(s.sandbox for g in after for s in g.shares) == Counter(
        s.sandbox for g in gpus for s in g.shares
    )


def test_consolidation_across_hosts_needs_cpu_and_memory_there() -> None:
    from scheduler.defrag import HostRoom, Share, SharedGpu, plan_consolidation

    gpus = [
        SharedGpu("a/0", "T4", 0, (Share("s1", 300, 0, (), cpu_milli=4000, host_memory_mib=8192),), host="a"),
        SharedGpu("b/0", "T4", 0, (Share("s2", 500, 0, (), cpu_milli=1000),), host="b"),
    ]
    tight = {"a": HostRoom(0, 0), "b": HostRoom(2000, 65536)}
    assert plan_consolidation(gpus, hosts=tight).frees == ()
    roomy = {"a": HostRoom(0, 0), "b": HostRoom(4000, 8192)}
    plan = plan_consolidation(gpus, hosts=roomy)
    assert plan.frees == ("a/0",) and [m.to_gpu for m in plan.migrations] == ["b/0"]
    assert roomy["b"].cpu_milli == 4000  # the caller's capacities are not modified
    assert plan_consolidation(gpus).frees == ("a/0",)  # without hosts, only the GPU counts
