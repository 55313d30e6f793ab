"""gpushare's measures of a node beside FGD's F: stranded capacity S and eventual waste E."""

from __future__ import annotations

import random

import pytest

from scheduler.placement.fragmentation import (
    FILLER_MIN_SHARE,
    MULTI_GPU_FLOOR,
    WHOLE_NODE_WEIGHT,
    EventualWaste,
    Fragmentation,
    MultiGpuRoom,
    StrandedCapacity,
    scarcity_weights,
    undominated_models,
)
from scheduler.placement.workload import TypicalPod

WHOLE_GPU = [TypicalPod(10000, 1000, 1, (), 1.0)]


def test_stranded_capacity_counts_cpu_and_share_copies() -> None:
    whole = StrandedCapacity(WHOLE_GPU, [1.0])
    assert whole.amount("G2", 40000, (1000,) * 4) == 0  # CPU for all four GPUs
    assert whole.amount("G2", 15000, (1000,) * 4) == 3000  # CPU for one: three GPUs stranded
    assert whole.amount("G2", 5000, (1000,) * 4) == 4000  # no CPU: everything
    share = StrandedCapacity([TypicalPod(1000, 470, 1, (), 1.0)], [1.0])
    assert share.amount("G2", 8000, (300, 1000, 1000)) == 2300 - 4 * 470  # two copies per GPU
    model_bound = StrandedCapacity([TypicalPod(1000, 1000, 1, ("T4",), 1.0)], [1.0])
    assert model_bound.amount("G2", 8000, (1000, 1000)) == 2000  # cannot use the model at all
    pairs = StrandedCapacity([TypicalPod(1000, 1000, 2, (), 1.0)], [1.0])
    assert pairs.amount("G2", 8000, (0, 500, 1000, 1000, 1000)) == 1500  # one pair of whole GPUs


def test_room_for_multi_gpu_work_needs_idle_gpus_and_cpu_and_weighs_by_their_demand() -> None:
    nodes = {("G3", 128000, 8), ("G2", 96000, 8), ("A10", 128000, 1)}
    assert undominated_models(nodes) == {"G3": 128000}
    kinds = [("G3", 128000, 8, 1), ("G2", 96000, 8, 1)]
    eight = [TypicalPod(88000, 1000, 8, (), 1.0)]
    room = MultiGpuRoom(eight, 0.2, kinds)
    seven = (0,) + (1000,) * 7
    weight = WHOLE_NODE_WEIGHT * 0.2
    assert room.amount("G3", 128000, (1000,) * 8) == pytest.approx(weight * 8000)  # one copy fits
    assert room.amount("G2", 96000, (1000,) * 8) == pytest.approx(weight * 8000)
    # A GPU taken, or too much CPU (a CPU-only request), and there is no room left for it.
    assert room.amount("G2", 96000, seven) == 0
    assert room.amount("G2", 80000, (1000,) * 8) == 0
    # Pairs: as many copies as idle GPUs and CPU allow.
    pairs = MultiGpuRoom([TypicalPod(16000, 1000, 2, (), 1.0)], 0.2, kinds)
    assert pairs.amount("G2", 40000, seven) == pytest.approx(weight * 2 * 2000)  # CPU for two
    # Never weighed below the floor, though no multi-GPU request was seen yet.
    unseen = MultiGpuRoom(eight, 0.0, kinds)
    assert unseen.amount("G2", 96000, (1000,) * 8) == pytest.approx(
        WHOLE_NODE_WEIGHT * MULTI_GPU_FLOOR * 8000
    )


def test_a_multi_gpu_shape_few_nodes_can_take_weighs_more() -> None:
    # Half the multi-GPU demand fits the G2 nodes too, half only the one G3 node.
    kinds = [("G3", 128000, 8, 1), ("G2", 96000, 8, 3)]
    shapes = [TypicalPod(88000, 1000, 8, (), 0.5), TypicalPod(120000, 1000, 8, (), 0.5)]
    room = MultiGpuRoom(shapes, 1.0, kinds)
    weights = {t.cpu_milli: t.probability for t in room.shapes}
    assert weights[120000] == pytest.approx(4 * weights[88000])  # 32 GPUs can take it against 8
    assert sum(weights.values()) == pytest.approx(1.0)
    # So a G3 loses more room to a CPU-only request than a G2 does.
    g3 = room.amount("G3", 128000, (1000,) * 8) - room.amount("G3", 100000, (1000,) * 8)
    g2 = room.amount("G2", 96000, (1000,) * 8) - room.amount("G2", 60000, (1000,) * 8)
    assert g3 == pytest.approx(4 * g2) and g2 > 0


def test_rare_models_weigh_more() -> None:
    typical = [
        TypicalPod(1000, 500, 1, (), 0.5),
        TypicalPod(1000, 500, 1, ("T4",), 0.25),
        TypicalPod(1000, 0, 0, (), 0.25),
    ]
    weights = scarcity_weights(typical, {"G2": 8, "T4": 2})
    assert sum(weights) == pytest.approx(1)
    # T4 holds 2 of the 10 GPUs: x 25; CPU-only and unconstrained pods keep their probability.
    assert weights[1] / weights[0] == pytest.approx(0.25 * 25 / 0.5)
    assert weights[2] == pytest.approx(weights[0] / 2)


SHARES = [
    TypicalPod(8000, 470, 1, (), 0.4),
    TypicalPod(4000, 320, 1, (), 0.2),
    TypicalPod(8000, 650, 1, (), 0.2),
    TypicalPod(12000, 1000, 1, (), 0.2),
]


def test_eventual_waste_fills_gaps_with_common_shares_that_fit_the_cpu() -> None:
    waste = EventualWaste(SHARES)
    assert waste.gpu("G2", 530, 96000) == 60  # one more 470
    assert waste.gpu("G2", 350, 96000) == 30  # a 320
    assert waste.gpu("G2", 210, 96000) == 210  # nothing common fits
    assert waste.gpu("G2", 1000, 96000) == 30  # 650 + 320 beats 470 + 470
    assert waste.gpu("G2", 530, 6000) == 210  # CPU for a 320 only
    assert waste.gpu("G2", 530, 3000) == 530  # CPU for nothing
    assert waste.amount("G2", 96000, (210, 530)) == 270


def test_rare_shares_are_not_fillers() -> None:
    rare = FILLER_MIN_SHARE / 2
    waste = EventualWaste([TypicalPod(4000, 810, 1, (), 1.0), TypicalPod(4000, 160, 1, (), rare)])
    assert waste.gpu("G2", 190, 96000) == 190  # a 190 gap does not count on the rare 160
    models = EventualWaste([TypicalPod(4000, 500, 1, ("T4",), 1.0)])
    assert models.gpu("G2", 1000, 96000) == 1000 and models.gpu("T4", 1000, 96000) == 0


def test_nodes_that_differ_only_in_cpu_that_cannot_matter_share_a_memo_entry_exactly() -> None:
    """The memos key on the CPU capped where more changes nothing: every answer read from a
    memo filled by other nodes must equal the answer worked out afresh for that node alone."""
    rng = random.Random(7)
    typical = [
        TypicalPod(rng.choice((0, 2000, 6000, 12000)), milli, num, models, rng.random())
        for milli, num, models in (
            (250, 1, ()),
            (470, 1, ()),
            (1000, 1, ()),
            (1000, 2, ()),
            (1000, 8, ("G3",)),
            (0, 0, ()),
        )
    ]
    weights = scarcity_weights(typical, {"G2": 64, "G3": 32})

    def measures() -> tuple[Fragmentation, StrandedCapacity, EventualWaste]:
        return Fragmentation(typical), StrandedCapacity(typical, weights), EventualWaste(typical)

    shared = measures()
    for _ in range(600):
        model = rng.choice(("G2", "G3"))
        cpu_left = rng.choice((-1000, 0, 1000, 4000, 8000, 30000, 64000, 128000, rng.randrange(130000)))
        free = tuple(sorted(rng.choice((0, 30, 250, 500, 530, 750, 1000)) for _ in range(rng.randint(1, 8))))
        fresh = measures()
        for n in range(3):
            assert shared[n].amount(model, cpu_left, free) == fresh[n].amount(model, cpu_left, free)


def stranded_by_the_definition(
    typical: list[TypicalPod], weights: list[float], model: str, cpu_left: int, free: tuple[int, ...]
) -> float:
    """S(n) as a plain loop over the typical pods, in their order."""
    total, value = sum(free), 0.0
    for t, weight in zip(typical, weights, strict=True):
        copies = 0
        if t.gpu_milli and (not t.models or model in t.models) and cpu_left >= t.cpu_milli:
            if t.num_gpu == 1:
                copies = sum(f // t.gpu_milli for f in free)
            else:
                copies = sum(1 for f in free if f >= t.gpu_milli) // t.num_gpu
            if t.cpu_milli:
                copies = min(copies, cpu_left // t.cpu_milli)
        value += weight * (total - copies * t.gpu_milli * t.num_gpu)
    return value


def test_stranded_capacity_is_bit_equal_to_its_definition_whatever_the_memos_hold() -> None:
    """S is worked out per size of pod and summed at once, its memos keyed on the CPU that
    counts: every answer must still be the plain loop's, to the last bit, as the ranks
    round S's changes."""
    rng = random.Random(11)
    typical = [
        TypicalPod(rng.choice((0, 1000, 4000, 6000, 12000)), milli, num, models, rng.random())
        for milli, num, models in (
            (100, 1, ()),
            (250, 1, ()),
            (250, 1, ()),
            (470, 1, ("G2",)),
            (1000, 1, ()),
            (1000, 2, ()),
            (1000, 8, ("G3",)),
            (0, 0, ()),
        )
    ]
    weights = scarcity_weights(typical, {"G2": 64, "G3": 32})
    stranded = StrandedCapacity(typical, weights)
    for _ in range(2000):
        model = rng.choice(("G2", "G3"))
        cpu_left = rng.choice((0, 1000, 8000, 64000, rng.randrange(-2000, 130000)))
        free = tuple(
            sorted(rng.choice((0, 30, 100, 250, 500, 530, 750, 1000)) for _ in range(rng.randint(1, 8)))
        )
        assert stranded.amount(model, cpu_left, free) == stranded_by_the_definition(
            typical, weights, model, cpu_left, free
        )


def test_eventual_waste_of_a_node_is_the_sum_over_its_gpus() -> None:
    waste = EventualWaste(SHARES)
    rng = random.Random(5)
    for _ in range(300):
        cpu_left = rng.randrange(0, 60000)
        free = tuple(sorted(rng.choice((0, 30, 210, 350, 530, 1000)) for _ in range(rng.randint(1, 8))))
        assert waste.amount("G2", cpu_left, free) == sum(
            EventualWaste(SHARES).gpu("G2", f, cpu_left) for f in free
        )
