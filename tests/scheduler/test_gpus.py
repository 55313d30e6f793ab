"""GPU model tables against NVIDIA's MIG user guide, the trace models, and check_layout."""

from __future__ import annotations

from itertools import combinations

import pytest

from scheduler.gpus import (
    CATALOG,
    COMPUTE_SLICES,
    MEMORY_SLICES,
    MODELS,
    GpuModel,
    check_layout,
    model_for_name,
    placeable_starts,
)

MIG_MODELS = (
    "A100-40GB",
    "A100-80GB",
    "H100-80GB",
    "H200",
    "H100-PCIe",
    "H100-NVL",
    "H800-80GB",
    "GH200-96GB",
)

# "Supported MIG Profiles": names per model, smallest first (1-slice, +me, 2-slice 1g, 2g,
# 3g, 4g, 7g), and how many instances of each fit on one GPU ("Number of Instances Available").
PROFILE_NAMES = {
    "A100-40GB": ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200": ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    "H100-PCIe": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-NVL": ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    "H800-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "GH200-96GB": ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
}
INSTANCES_AVAILABLE = (7, 1, 4, 3, 2, 1, 1)
# ``nvidia-smi mig -lgipp`` placements, the same on all of them.
PLACEMENTS = ((0, 1, 2, 3, 4, 5, 6), (0, 1, 2, 3, 4, 5, 6), (0, 2, 4, 6), (0, 2, 4), (0, 4), (0,), (0,))
SLICES = ((1, 1), (1, 1), (1, 2), (2, 2), (3, 4), (4, 4), (7, 8))  # (compute, memory)


@pytest.mark.parametrize("name", MIG_MODELS)
def test_profile_tables_follow_nvidia(name: str) -> None:
    model = CATALOG[name]
    assert tuple(p.name for p in model.mig_profiles) == PROFILE_NAMES[name]
    assert tuple(p.starts for p in model.mig_profiles) == PLACEMENTS
    assert tuple((p.compute_slices, p.memory_slices) for p in model.mig_profiles) == SLICES
    assert [p.media_extension for p in model.mig_profiles] == [False, True] + [False] * 5
    whole = model.mig_profiles[-1]
    assert whole.sm_count <= model.sm_count and whole.memory_mib <= model.memory_mib


def _most_instances(model: GpuModel, profile: str) -> int:
    starts = model.profile(profile).starts
    for count in range(len(starts), 0, -1):
        for chosen in combinations(starts, count):
            if not check_layout(model, [(profile, s) for s in chosen]):
                return count
    return 0


@pytest.mark.parametrize("name", MIG_MODELS)
def test_instances_per_gpu_follow_nvidia(name: str) -> None:
    model = CATALOG[name]
    assert tuple(_most_instances(model, p.name) for p in model.mig_profiles) == INSTANCES_AVAILABLE


def test_sizes_spot_checks() -> None:
    h100, h200 = CATALOG["H100-80GB"], CATALOG["H200"]
    assert [p.sm_count for p in h100.mig_profiles] == [16, 16, 26, 32, 60, 64, 132]
    assert [p.sm_count for p in h200.mig_profiles] == [16, 16, 26, 32, 60, 64, 132]
    assert h200.profile("1g.18gb").memory_mib == 16 * 1024
    assert h200.profile("3g.71gb").memory_mib == int(69.5 * 1024)
    assert CATALOG["A100-40GB"].profile("1g.5gb").memory_mib == 4864  # 4.75 GiB in the guide
    assert [p.sm_count for p in CATALOG["A100-80GB"].mig_profiles] == [14, 14, 14, 28, 42, 56, 98]
    # Guards review §2.4 (the table was 128-256 MiB low): NVML's memorySizeMB on a lent H100
    # 80GB HBM3. 1g.20gb is 20096 MiB, not the 20090 that nvidia-smi's rounded 19.62 GiB gave.
    assert [h100.profile(n).memory_mib for n in ("1g.10gb", "1g.20gb", "3g.40gb", "7g.80gb")] == [
        9984,
        20096,
        40448,
        81152,
    ]


def test_existing_models_and_defaults_kept() -> None:
    assert list(MODELS)[:4] == ["H100-80GB", "A100-80GB", "A100-40GB", "H200"]
    assert set(MODELS) < set(CATALOG)
    # The first one-slice 1g profile is the plain one (the simulated default layout relies on it).
    first = next(p for p in MODELS["H100-80GB"].mig_profiles if p.memory_slices == 1)
    assert first.name == "1g.10gb"


@pytest.mark.parametrize(
    ("name", "memory_mib"),
    [
        ("P100", 16280),
        ("T4", 15109),
        ("V100M16", 16160),
        ("V100M32", 32510),
        ("A10", 22731),
        ("G1", 10000),
        ("G2", 20000),
        ("G3", 30000),
    ],
)
def test_trace_models_cannot_do_mig(name: str, memory_mib: int) -> None:
    model = CATALOG[name]
    assert model.memory_mib == memory_mib
    assert not model.mig_capable and model.note
    assert check_layout(model, [("1g.10gb", 0)]) == [f"{name} cannot do MIG"]


@pytest.mark.parametrize(
    ("nvml_name", "memory_mib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H200", 143771, "H200"),
        # Guards review §2.4: the other Hopper boards were unknown, so MIG was refused on them.
        ("NVIDIA H100 PCIe", 81559, "H100-PCIe"),
        ("NVIDIA H100 NVL", 95830, "H100-NVL"),
        ("NVIDIA H800", 81559, "H800-80GB"),
        ("NVIDIA H800 80GB HBM3", 81559, "H800-80GB"),
        ("NVIDIA GH200 480GB", 97871, "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", 146831, "H200"),
        ("NVIDIA H200 NVL", 143771, "H200"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A10", 22731, "A10"),
        ("Tesla V100-SXM2-16GB", 16160, "V100M16"),
        ("Tesla V100S-PCIE-32GB", 32510, "V100M32"),
        ("Tesla T4", 15109, "T4"),
        ("Tesla P100-PCIE-16GB", 16280, "P100"),
        ("NVIDIA A100 PCIe", 81920, None),  # an 80 GB A100 whose name does not say so
        ("NVIDIA L4", 23034, None),
    ],
)
def test_model_for_name(nvml_name: str, memory_mib: int, expected: str | None) -> None:
    model = model_for_name(nvml_name, memory_mib)
    assert (model.name if model else None) == expected


def test_check_layout_accepts_full_layouts() -> None:
    h100 = CATALOG["H100-80GB"]
    assert check_layout(h100, [("4g.40gb", 0), ("3g.40gb", 4)]) == []
    assert check_layout(h100, [("1g.10gb+me", 0), *(("1g.10gb", s) for s in range(1, 7))]) == []
    assert check_layout(h100, [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.20gb", 6)]) == []
    assert check_layout(h100, [("7g.80gb", 0)]) == []
    assert check_layout(h100, []) == []


def test_check_layout_names_each_problem() -> None:
    h100 = CATALOG["H100-80GB"]
    assert check_layout(h100, [("3g.40gb", 2)]) == ["3g.40gb cannot start at memory slice 2 (legal: 0, 4)"]
    assert check_layout(h100, [("1g.10gb", 7)])[0].startswith("1g.10gb cannot start at memory slice 7")
    assert check_layout(h100, [("2g.20gb", 0), ("1g.10gb", 1)]) == ["1g.10gb@1 overlaps 2g.20gb@0"]
    assert check_layout(h100, [("5g.50gb", 0)]) == ["H100-80GB has no MIG profile '5g.50gb'"]
    assert check_layout(h100, [("1g.10gb+me", 0), ("1g.10gb+me", 1)]) == [
        "2 instances with media extensions (+me), at most 1"
    ]
    doubled = check_layout(h100, [("4g.40gb", 0), ("4g.40gb", 0)])
    assert doubled == ["4g.40gb@0 overlaps 4g.40gb@0", "8 compute slices in use, 7 exist"]


def test_no_legal_layout_exceeds_the_gpu() -> None:
    """Exhaustively: every legal layout of single-profile instances fits 8 + 7 slices."""
    h100 = CATALOG["H100-80GB"]
    placements = [(p.name, s) for p in h100.mig_profiles for s in p.starts]
    legal = 0
    for size in range(1, 4):
        for layout in combinations(placements, size):
            if not check_layout(h100, layout):
                legal += 1
                profiles = [h100.profile(n) for n, _ in layout]
                assert sum(p.memory_slices for p in profiles) <= MEMORY_SLICES
                assert sum(p.compute_slices for p in profiles) <= COMPUTE_SLICES
    assert legal > 100


def test_placeable_starts_counts_compute_and_media() -> None:
    h100 = CATALOG["H100-80GB"]
    layout = [("4g.40gb", 0), ("2g.20gb", 4), ("1g.10gb+me", 6)]
    assert placeable_starts(h100, "1g.10gb", layout) == []
    assert placeable_starts(h100, "1g.10gb", [("1g.10gb+me", 0)]) == [1, 2, 3, 4, 5, 6]
    assert placeable_starts(h100, "1g.10gb+me", [("1g.10gb+me", 0)]) == []
    assert placeable_starts(h100, "3g.40gb", [("1g.10gb", 1)]) == [4]
