"""Properties of the live cycle over random department trees (scheduler/departments.py):
no level of the tree goes over its limit, and a project within its guarantee at every level
gets what it asks in one cycle, reclaiming borrowed capacity by preemption where it must.

Each example is drawn from one seed, so a failure names the seed that reproduces it.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cluster import (
    DepartmentShare,
    FairShareState,
    Place,
    Preempt,
    ProjectShare,
    Request,
    Running,
    Snapshot,
    book,
)
from scheduler.cycle import run_cycle
from scheduler.departments import OrgTree
from scheduler.fairshare import FairOrder
from scheduler.placement import get_policy
from tests.scheduler.test_cycle_properties import LIVE_POLICIES, random_cluster, replay
from tests.scheduler.test_fairshare import dedicated_fleet

NOW = 10_000.0
PROJECTS = "abcdef"
DEPARTMENTS = ("inst", "groupA", "groupB")


def random_tree(rng: random.Random, guarantees: bool) -> FairShareState:
    """Projects a-f, some in groupA or groupB or straight in inst, groups maybe in inst; with
    random limits (and with ``guarantees``, a guarantee on every project)."""
    departments = {
        "inst": DepartmentShare(
            weight=rng.choice((1.0, 2.0)),
            guaranteed_milli=rng.choice((None, 2000, 4000)),
            limit_milli=rng.choice((None, 3000, 6000)),
        ),
        **{
            group: DepartmentShare(
                parent=rng.choice((None, "inst", "inst")),
                weight=rng.choice((1.0, 3.0)),
                guaranteed_milli=rng.choice((None, 1000, 3000)),
                limit_milli=rng.choice((None, 2000, 4000)),
            )
            for group in ("groupA", "groupB")
        },
    }
    projects = {
        p: ProjectShare(
            weight=rng.choice((1.0, 2.0)),
            guaranteed_milli=rng.choice((0, 1000, 2000)) if guarantees else rng.choice((None, 0, 1000)),
            limit_milli=rng.choice((None, 2000, 5000)),
            usage_gpu_s=rng.uniform(0, 1e5),
            department=rng.choice((None, *DEPARTMENTS)),
        )
        for p in PROJECTS
    }
    return FairShareState(projects, departments, half_life_s=3600.0, usage_at=NOW - 300)


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_no_level_of_the_tree_goes_over_its_limit(seed: int, policy: str) -> None:
    snapshot, queue, _ = random_cluster(seed)
    rng = random.Random(seed)
    state = random_tree(rng, guarantees=False)
    queue = [replace(r, project=rng.choice(PROJECTS)) for r in queue]
    snapshot.running = [replace(r, project=rng.choice(PROJECTS)) for r in snapshot.running]
    decisions = run_cycle(snapshot, queue, get_policy(policy), NOW, fairshare=state)
    _, running = replay(snapshot, queue, decisions)
    tree = OrgTree(state)
    placed = {d.request_id for d in decisions if isinstance(d, Place)}
    held: dict[str, int] = {}
    touched: set[str] = set()
    for alloc in running:
        for node in tree.path(alloc.project):
            held[node] = held.get(node, 0) + alloc.milli_gpu
            if alloc.sandbox_id in placed:
                touched.add(node)
    for node in touched:  # a level this cycle placed under: within its limit after
        limit = tree.limit(node)
        assert limit is None or held[node] <= limit, (node, held[node], limit)


def filled(rng: random.Random, state: FairShareState, gpus: int) -> Snapshot:
    """One host of ``gpus`` whole GPUs, filled by random projects' one-GPU requests placed
    one cycle at a time, so that each is flagged borrowed as the cycle flags it."""
    snapshot = dedicated_fleet(1, per_host=gpus)
    by_uuid = {g.uuid: g for g in snapshot.hosts[0].gpus}
    for i in range(gpus * 2):
        if all(not g.idle for g in by_uuid.values()):
            break
        request = Request(
            id=100 + i, project=rng.choice(PROJECTS), priority=100, submitted_at=float(i), mode="dedicated"
        )
        for d in run_cycle(snapshot, [request], get_policy("first-fit"), float(i), fairshare=state):
            if isinstance(d, Place):
                for grant in d.grants:
                    book(by_uuid[grant.gpu_uuid], grant)
                snapshot.running.append(
                    Running(
                        request.id,
                        request.project,
                        d.host,
                        d.grants,
                        started_at=float(i),
                        borrowed=d.borrowed,
                    )
                )
    return snapshot


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_guarantee_is_reached_within_one_cycle_by_preemption(seed: int, policy: str) -> None:
    """Guarantees that fit the fleet (the top level's add up to at most its GPUs): a full
    fleet, and a project whose request keeps every level of its path within its guarantee
    is placed in one cycle, the preemptions it needs decided with it."""
    rng = random.Random(seed)
    state = random_tree(rng, guarantees=True)
    tree = OrgTree(state)
    promised = sum(tree.guaranteed(top) or 0 for top in {tree.path(p)[-1] for p in PROJECTS})
    gpus = max(rng.randint(2, 8), -(-promised // 1000))  # enough GPUs for what is guaranteed
    snapshot = filled(rng, state, gpus)
    held: dict[str, int] = {}
    for alloc in snapshot.running:
        for node in tree.path(alloc.project):
            held[node] = held.get(node, 0) + alloc.milli_gpu

    def entitled(project: str, count: int) -> bool:
        """Within the guarantee of every level of its path, and over no limit."""
        path = tree.path(project)
        within = all(
            (g := tree.guaranteed(node)) is not None and held.get(node, 0) + 1000 * count <= g
            for node in path
        )
        return within and all(
            (limit := tree.limit(node)) is None or held.get(node, 0) + 1000 * count <= limit for node in path
        )

    asks = [(p, n) for p in PROJECTS for n in (1, 2, 3) if n <= gpus and entitled(p, n)]
    if not asks:
        return
    project, count = rng.choice(asks)
    request = Request(
        id=1, project=project, priority=100, submitted_at=NOW, mode="dedicated", gpu_count=count
    )
    decisions = run_cycle(snapshot, [request], get_policy(policy), NOW, fairshare=state)
    assert isinstance(decisions[-1], Place), (decisions, held)
    victims = [d for d in decisions if isinstance(d, Preempt)]
    assert all(next(r for r in snapshot.running if r.sandbox_id == v.sandbox_id).borrowed for v in victims)


def reference_order(queue: list[Request], state: FairShareState) -> list[int]:
    """The fair tree's order by its definition, recomputed from scratch at every step: the
    highest priority, then the standings from the top level down (a shorter path first on
    a tie), then age, then id; each request charged an hour of its GPU before the next."""
    tree = OrgTree(state)
    usage: dict[str, float] = {}
    for name, share in state.projects.items():
        for node in tree.path(name):
            usage[node] = usage.get(node, 0.0) + share.usage_gpu_s
    waiting = sorted(queue, key=lambda r: (r.submitted_at, r.id))
    order = []
    while waiting:

        def key(r: Request) -> tuple[object, ...]:
            path = tree.path(r.project)
            standings = tuple(
                usage.get(n, 0.0) / w if (w := tree.weight(n)) > 0 else float("inf") for n in reversed(path)
            )
            return (-r.priority, standings, r.submitted_at, r.id)

        heads: dict[str, Request] = {}
        for r in waiting:  # each project's best request: its highest priority, then oldest
            best = heads.get(r.project)
            if best is None or (-r.priority, r.submitted_at, r.id) < (
                -best.priority,
                best.submitted_at,
                best.id,
            ):
                heads[r.project] = r
        chosen = min(heads.values(), key=key)
        waiting.remove(chosen)
        order.append(chosen.id)
        for node in tree.path(chosen.project):
            usage[node] = usage.get(node, 0.0) + 3600.0
    return order


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_fair_tree_order_is_its_definition(seed: int) -> None:
    rng = random.Random(seed)
    state = random_tree(rng, guarantees=False)
    state = FairShareState(state.projects, state.departments, half_life_s=3600.0, usage_at=NOW)
    queue = [
        Request(
            id=i,
            project=rng.choice(PROJECTS),
            priority=rng.choice((50, 100)),
            submitted_at=rng.choice((1.0, 2.0, 3.0)),
            mode="dedicated",
        )
        for i in range(rng.randint(1, 25))
    ]
    order = FairOrder(queue, state, [], NOW)
    got = []
    while (request := order.next()) is not None:
        got.append(request.id)
        order.settle(request, 1000, NOW + 3600.0)
    assert got == reference_order(queue, state)
