"""Departments: guarantees, ceilings and fair share along a tree of units above projects
(scheduler/departments.py), on the live cycle."""

from __future__ import annotations

from dataclasses import replace

from scheduler.cluster import (
    DepartmentShare,
    FairShareState,
    ModelLimit,
    Pending,
    Place,
    Preempt,
    ProjectShare,
    Running,
    Snapshot,
)
from scheduler.cycle import run_cycle
from scheduler.departments import OrgTree
from scheduler.fairshare import FairOrder
from tests.scheduler.test_fairshare import POLICY, dedicated_fleet, occupy, req


def physics(**projects: ProjectShare) -> FairShareState:
    """Department physics (guaranteeing what its two groups do), with projects optics and
    lasers in it, and project bio outside any department."""
    shares = {
        "optics": ProjectShare(guaranteed_milli=2000, department="physics"),
        "lasers": ProjectShare(guaranteed_milli=2000, department="physics"),
        "bio": ProjectShare(guaranteed_milli=2000),
        **projects,
    }
    return FairShareState(shares, {"physics": DepartmentShare()})


def held_by(snapshot: Snapshot, project: str, count: int, first_id: int, borrowed_from: int) -> list[Running]:
    """``count`` GPUs of the fleet's first free ones held by ``project``; those from the
    ``borrowed_from``-th on were borrowed (over a guarantee) when placed."""
    free = [g for h in snapshot.hosts for g in h.gpus if g.idle][:count]
    return [
        occupy(snapshot, first_id + i, project, gpu, started_at=float(i), borrowed=i >= borrowed_from)
        for i, gpu in enumerate(free)
    ]


def test_a_department_guarantees_what_its_projects_do_unless_it_says_otherwise() -> None:
    state = physics()
    tree = OrgTree(state)
    assert tree.path("optics") == ("p:optics", "d:physics") and tree.path("bio") == ("p:bio",)
    assert tree.guaranteed("d:physics") == 4000
    nested = FairShareState(
        state.projects,
        {"physics": DepartmentShare(parent="science", guaranteed_milli=3000), "science": DepartmentShare()},
    )
    tree = OrgTree(nested)
    assert tree.path("lasers") == ("p:lasers", "d:physics", "d:science")
    assert tree.guaranteed("d:science") == 3000  # the child's own figure, not its projects'
    looped = FairShareState(state.projects, {"physics": DepartmentShare(parent="physics")})
    assert OrgTree(looped).path("optics") == ("p:optics", "d:physics")  # a loop is cut


def test_a_project_borrows_its_siblings_idle_guarantee_and_loses_it_when_the_sibling_asks() -> None:
    snapshot = dedicated_fleet(1, per_host=4)
    state = physics()
    # Optics alone: the department's four GPUs, two of them over its own guarantee (borrowed).
    decisions = run_cycle(
        snapshot, [req(i, "optics", at=i) for i in range(1, 5)], POLICY, 0.0, fairshare=state
    )
    assert [d.borrowed for d in decisions if isinstance(d, Place)] == [False, False, True, True]

    full = dedicated_fleet(1, per_host=4)
    held_by(full, "optics", 4, 100, borrowed_from=2)
    asked = run_cycle(full, [req(9, "lasers", gpu_count=2)], POLICY, 10.0, fairshare=state)
    assert [type(d).__name__ for d in asked] == ["Preempt", "Preempt", "Place"]
    assert {d.sandbox_id for d in asked if isinstance(d, Preempt)} == {103, 102}  # the borrowed ones
    assert asked[0].reason.startswith("reclaimed: project optics borrowed")  # type: ignore[union-attr]
    # Within its own guarantee, optics keeps the rest: a third GPU for lasers is not reclaimed.
    more = run_cycle(full, [req(9, "lasers", gpu_count=3)], POLICY, 10.0, fairshare=state)
    assert isinstance(more[-1], Pending)


def test_an_outsider_reclaims_only_what_the_department_borrowed_beyond_its_guarantee() -> None:
    """Physics guarantees 4 GPUs (its two projects' 2 each); optics holds 5 of 6, 3 over its
    own guarantee but only 1 over the department's. Bio, guaranteed 4, may take back that 1
    and no more: physics keeps its guarantee against outsiders, however its projects share it."""
    snapshot = dedicated_fleet(1, per_host=6)
    state = physics(bio=ProjectShare(guaranteed_milli=4000))
    held_by(snapshot, "optics", 5, 100, borrowed_from=2)
    two = run_cycle(snapshot, [req(9, "bio", gpu_count=2)], POLICY, 10.0, fairshare=state)
    assert [type(d).__name__ for d in two] == ["Preempt", "Place"]  # the idle GPU and one reclaimed
    assert two[0].reason.startswith("reclaimed: department physics (of project optics) borrowed")  # type: ignore[union-attr]
    [three] = run_cycle(snapshot, [req(9, "bio", gpu_count=3)], POLICY, 10.0, fairshare=state)
    assert isinstance(three, Pending)  # a second reclaim would take physics below its guarantee
    # Without the department, optics' own three borrowed GPUs were all bio's to take.
    flat = FairShareState({p: replace(s, department=None) for p, s in state.projects.items()})
    decisions = run_cycle(snapshot, [req(9, "bio", gpu_count=3)], POLICY, 10.0, fairshare=flat)
    assert [type(d).__name__ for d in decisions] == ["Preempt", "Preempt", "Place"]


def test_no_level_exceeds_its_limit() -> None:
    snapshot = dedicated_fleet(1)
    state = FairShareState(physics().projects, {"physics": DepartmentShare(limit_milli=3000)})
    held_by(snapshot, "optics", 2, 100, borrowed_from=9)
    [decision] = run_cycle(snapshot, [req(9, "lasers", gpu_count=2)], POLICY, 0.0, fairshare=state)
    assert isinstance(decision, Pending)
    assert (
        decision.reason
        == "quota: department physics holds 2000 of its 3000 milli-GPU limit and this needs 2000 more"
    )
    [one] = run_cycle(snapshot, [req(9, "lasers")], POLICY, 0.0, fairshare=state)
    assert isinstance(one, Place)


def test_a_departments_model_limit_binds_all_of_its_projects() -> None:
    snapshot = dedicated_fleet(1)
    h100 = ModelLimit("H100-80GB", frozenset({"H100-80GB"}), 1000)
    state = FairShareState(physics().projects, {"physics": DepartmentShare(model_limits=(h100,))})
    held_by(snapshot, "optics", 1, 100, borrowed_from=9)
    [decision] = run_cycle(snapshot, [req(9, "lasers")], POLICY, 0.0, fairshare=state)
    assert isinstance(decision, Pending)
    assert "quota: department physics holds 1 of its 1 H100-80GB GPU limit" in decision.reason
    [outside] = run_cycle(snapshot, [req(9, "bio")], POLICY, 0.0, fairshare=state)
    assert isinstance(outside, Place)


def test_fair_share_follows_the_tree() -> None:
    """Physics used much (all of it optics'), chemistry little: chemistry's project goes first,
    although lasers itself used nothing at all."""
    projects = {
        "optics": ProjectShare(usage_gpu_s=9000.0, department="physics"),
        "lasers": ProjectShare(usage_gpu_s=0.0, department="physics"),
        "catalysis": ProjectShare(usage_gpu_s=3000.0, department="chemistry"),
    }
    tree = FairShareState(
        projects, {"physics": DepartmentShare(), "chemistry": DepartmentShare()}, usage_at=0.0
    )
    queue = [req(1, "lasers"), req(2, "catalysis")]
    order = FairOrder(queue, tree, [], 0.0)
    assert [order.next().id for _ in range(2)] == [2, 1]  # type: ignore[union-attr]
    flat = FairShareState(
        {p: ProjectShare(usage_gpu_s=s.usage_gpu_s) for p, s in projects.items()}, usage_at=0.0
    )
    order = FairOrder(queue, flat, [], 0.0)
    assert [order.next().id for _ in range(2)] == [1, 2]  # type: ignore[union-attr]
    # Weighted: physics' weight of 4 makes its 9000 GPU-s weigh less than chemistry's 3000.
    heavy = FairShareState(
        projects, {"physics": DepartmentShare(weight=4.0), "chemistry": DepartmentShare()}, usage_at=0.0
    )
    order = FairOrder(queue, heavy, [], 0.0)
    assert order.next().id == 1  # type: ignore[union-attr]


def test_a_placement_in_a_department_moves_its_other_projects_back() -> None:
    """Within one cycle: once catalysis was given a GPU, chemistry's standing grew, so the
    next GPU goes to physics although catalysis still waits and was ahead at the start."""
    projects = {
        "lasers": ProjectShare(department="physics", usage_gpu_s=1000.0),
        "catalysis": ProjectShare(department="chemistry"),
        "polymers": ProjectShare(department="chemistry"),
    }
    state = FairShareState(
        projects, {"physics": DepartmentShare(), "chemistry": DepartmentShare()}, usage_at=0.0
    )
    queue = [req(1, "catalysis"), req(2, "polymers", at=1), req(3, "lasers", at=2)]
    order = FairOrder(queue, state, [], 0.0)
    first = order.next()
    assert first is not None and first.id == 1
    order.settle(first, 1000, ends_at=None)  # an hour's commitment: 3600 GPU-s for chemistry
    assert order.next().id == 3  # type: ignore[union-attr]


def test_at_the_departments_limit_a_sibling_still_takes_back_what_was_borrowed() -> None:
    """Physics may hold 4 GPUs, its guarantee: optics holds all 4 (2 borrowed from lasers),
    on a fleet with GPUs to spare. Lasers' request is over the department's limit, yet within
    its own guarantee: it takes back optics' borrowed GPUs, and physics stays at 4."""
    snapshot = dedicated_fleet(1, per_host=8)
    state = FairShareState(physics().projects, {"physics": DepartmentShare(limit_milli=4000)})
    held_by(snapshot, "optics", 4, 100, borrowed_from=2)
    decisions = run_cycle(snapshot, [req(9, "lasers", gpu_count=2)], POLICY, 10.0, fairshare=state)
    assert [type(d).__name__ for d in decisions] == ["Preempt", "Preempt", "Place"]
    assert {d.sandbox_id for d in decisions if isinstance(d, Preempt)} == {103, 102}
    freed = {f"GPU-0-{n}" for n in (2, 3)}
    assert {g.gpu_uuid for g in decisions[-1].grants} == freed  # type: ignore[union-attr]
    # Bio, outside physics, cannot make room under physics' limit; nor lasers beyond its guarantee.
    [outside] = run_cycle(snapshot, [req(9, "bio", gpu_count=2)], POLICY, 10.0, fairshare=state)
    assert isinstance(outside, Place)  # bio is not under physics' limit: the spare GPUs are its
    [greedy] = run_cycle(snapshot, [req(9, "lasers", gpu_count=3)], POLICY, 10.0, fairshare=state)
    assert isinstance(greedy, Pending) and greedy.reason.startswith("quota: department physics holds 4000")


def test_a_plan_one_project_could_not_make_is_still_tried_for_another() -> None:
    """X (another department) finds nothing it may reclaim from b; a, b's sibling, may take
    back b's borrowed GPU. X asks first (its department used nothing): a must not inherit
    X's hopeless answer."""
    snapshot = dedicated_fleet(1, per_host=2)
    projects = {
        "a": ProjectShare(guaranteed_milli=1000, department="d1"),
        "b": ProjectShare(guaranteed_milli=1000, department="d1"),
        "x": ProjectShare(guaranteed_milli=1000, department="d2"),
    }
    state = FairShareState(projects, {"d1": DepartmentShare(guaranteed_milli=3000), "d2": DepartmentShare()})
    held_by(snapshot, "b", 2, 100, borrowed_from=1)
    decisions = run_cycle(snapshot, [req(1, "x"), req(2, "a", at=1)], POLICY, 10.0, fairshare=state)
    assert [type(d).__name__ for d in decisions] == ["Pending", "Preempt", "Place"], decisions
    assert decisions[0].request_id == 1 and decisions[-1].request_id == 2  # type: ignore[union-attr]


def test_nested_limits_let_siblings_swap_too() -> None:
    """Group g (limit 2) inside department d (limit 2): p1 holds 2, one borrowed from p2;
    p2's request is over both limits, and the swap inside g leaves both where they were."""
    snapshot = dedicated_fleet(1, per_host=4)
    projects = {
        "p1": ProjectShare(guaranteed_milli=1000, department="g"),
        "p2": ProjectShare(guaranteed_milli=1000, department="g"),
    }
    departments = {"g": DepartmentShare(parent="d", limit_milli=2000), "d": DepartmentShare(limit_milli=2000)}
    state = FairShareState(projects, departments)
    held_by(snapshot, "p1", 2, 100, borrowed_from=1)
    decisions = run_cycle(snapshot, [req(9, "p2")], POLICY, 10.0, fairshare=state)
    assert [type(d).__name__ for d in decisions] == ["Preempt", "Place"], decisions
    assert decisions[0].sandbox_id == 101  # type: ignore[union-attr]
