"""GPU models and their MIG geometry.

A MIG-capable GPU has 8 memory slices and 7 compute slices. A profile takes a number of
each and may only start at the memory-slice offsets NVIDIA lists as its placements
(``nvidia-smi mig -lgipp``). Two instances may not share a memory slice, their compute
slices may not add up to more than 7, and only one instance per GPU may hold the media
extensions (``+me``: the GPU has one set of JPEG and OFA engines to give away).

Profile tables follow NVIDIA's MIG user guide ("Supported MIG Profiles"); memory sizes and
SM counts are what ``nvidia-smi mig -lgip`` reports, which shifts a little between driver
releases, so treat them as close estimates, not as limits to fill to the last MiB.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MEMORY_SLICES = 8
COMPUTE_SLICES = 7
MEDIA_EXTENSION = "+me"


@dataclass(frozen=True)
class MigProfile:
    name: str  # e.g. "1g.10gb"
    compute_slices: int
    memory_slices: int
    memory_mib: int
    sm_count: int
    starts: tuple[int, ...]  # legal memory-slice start offsets

    def slots(self, start: int) -> range:
        """Memory slices occupied when the instance starts at ``start``."""
        return range(start, start + self.memory_slices)

    def mask(self, start: int) -> int:
        """``slots`` as a bit mask (bit i = memory slice i), for fast overlap tests."""
        return ((1 << self.memory_slices) - 1) << start

    @property
    def media_extension(self) -> bool:
        return self.name.endswith(MEDIA_EXTENSION)

    @property
    def milli_gpu(self) -> int:
        """Share of the whole GPU, in thousandths, by compute slices (used for pricing)."""
        return self.compute_slices * 1000 // COMPUTE_SLICES


@dataclass(frozen=True)
class GpuModel:
    name: str  # canonical short name, e.g. "H100-80GB"
    memory_mib: int
    sm_count: int
    tdp_w: int
    idle_w: int
    max_sm_clock_mhz: int
    mig_profiles: tuple[MigProfile, ...] = ()
    note: str = ""  # e.g. why a model cannot do MIG, or where its figures come from

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def profile(self, name: str) -> MigProfile:
        for profile in self.mig_profiles:
            if profile.name == name:
                return profile
        raise KeyError(f"{self.name} has no MIG profile {name!r}")


# NVIDIA lists no start at slice 7 for one-slice profiles: an eighth 1g instance would need
# an eighth compute slice.
_ALL_1G = (0, 1, 2, 3, 4, 5, 6)


def _mig_table(
    names: tuple[str, str, str, str, str, str], mib: tuple[int, int, int, int], sms: tuple[int, ...]
) -> tuple[MigProfile, ...]:
    """The profile table every 8-slice GPU shares, named and sized per model.

    ``names`` are the 1-slice, 2-slice 1g, 2g, 3g, 4g and 7g names; ``mib`` the memory of a
    1-, 2-, 4- and 8-slice instance; ``sms`` the SMs of 1g, 1g (2 slices), 2g, 3g, 4g, 7g.
    The ``+me`` variant of the 1-slice profile comes right after its plain twin, so code
    that picks "the first 1g profile of one slice" gets the plain one.
    """
    one, one_wide, two, three, four, seven = names
    m1, m2, m4, m8 = mib
    s1, s1w, s2, s3, s4, s7 = sms
    return (
        MigProfile(one, 1, 1, m1, s1, _ALL_1G),
        MigProfile(one + MEDIA_EXTENSION, 1, 1, m1, s1, _ALL_1G),
        MigProfile(one_wide, 1, 2, m2, s1w, (0, 2, 4, 6)),
        MigProfile(two, 2, 2, m2, s2, (0, 2, 4)),
        MigProfile(three, 3, 4, m4, s3, (0, 4)),
        MigProfile(four, 4, 4, m4, s4, (0,)),
        MigProfile(seven, 7, 8, m8, s7, (0,)),
    )


_H100_80GB = GpuModel(
    "H100-80GB",
    memory_mib=81559,
    sm_count=132,
    tdp_w=700,
    idle_w=70,
    max_sm_clock_mhz=1980,
    mig_profiles=_mig_table(
        ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        # NVML memorySizeMB on an H100 80GB HBM3 (driver 580.159.04, read on a lent H100)
        (9984, 20096, 40448, 81152),
        (16, 26, 32, 60, 64, 132),
    ),
)

# The other Hopper boards. On a real host the MIG memory comes from NVML (the profile's
# memorySizeMB), and so do placements for a profile this module does not know; these
# tables serve simulation, planning and fit estimates. Figures marked estimated are scaled
# from the H100 80GB HBM3's by memory (MIG user guide profile names, NVIDIA datasheets).
_ESTIMATED = (
    "MIG memory sizes estimated from the H100 80GB HBM3's, scaled by memory; NVML's are used on a host"
)

_H100_PCIE = GpuModel(
    "H100-PCIe",
    memory_mib=81559,
    sm_count=114,
    tdp_w=350,
    idle_w=50,
    max_sm_clock_mhz=1755,
    mig_profiles=_mig_table(
        ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        (9984, 20096, 40448, 81152),
        (14, 14, 28, 42, 56, 114),
    ),
    note="H100 PCIe 80GB (HBM2e, 114 SMs); MIG SM counts estimated (7 GPCs of 14-16 SMs).",
)

_H100_NVL = GpuModel(
    "H100-NVL",
    memory_mib=95830,
    sm_count=132,
    tdp_w=400,
    idle_w=60,
    max_sm_clock_mhz=1785,
    mig_profiles=_mig_table(
        ("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
        (11731, 23606, 47526, 95354),
        (16, 26, 32, 60, 64, 132),
    ),
    note=f"H100 NVL 94GB (PCIe, HBM3); {_ESTIMATED}.",
)

# Export variant of the H100 SXM: the same GPU, MIG geometry and memory (NVLink is cut).
_H800 = GpuModel(
    "H800-80GB",
    memory_mib=81559,
    sm_count=132,
    tdp_w=700,
    idle_w=70,
    max_sm_clock_mhz=1980,
    mig_profiles=_H100_80GB.mig_profiles,
    note="H800 80GB (an H100 with reduced NVLink); MIG as the H100 80GB HBM3.",
)

_GH200_96GB = GpuModel(
    "GH200-96GB",
    memory_mib=97871,
    sm_count=132,
    tdp_w=900,
    idle_w=90,
    max_sm_clock_mhz=1980,
    mig_profiles=_mig_table(
        ("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
        (11981, 24108, 48538, 97382),
        (16, 26, 32, 60, 64, 132),
    ),
    note=f"GH200 Grace Hopper with 96 GB HBM3 (NVML says 'GH200 480GB': CPU and GPU memory); {_ESTIMATED}.",
)

_H200 = GpuModel(
    "H200",
    memory_mib=143771,
    sm_count=132,
    tdp_w=700,
    idle_w=75,
    max_sm_clock_mhz=1980,
    mig_profiles=_mig_table(
        ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
        (16384, 33024, 71168, 143104),
        (16, 26, 32, 60, 64, 132),
    ),
    note="H200 SXM5 141GB; MIG memory sizes as nvidia-smi -lgip reports them on R550.",
)

_A100_80GB = GpuModel(
    "A100-80GB",
    memory_mib=81920,
    sm_count=108,
    tdp_w=400,
    idle_w=55,
    max_sm_clock_mhz=1410,
    mig_profiles=_mig_table(
        ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        (9728, 19968, 40192, 80896),
        (14, 14, 28, 42, 56, 98),
    ),
)

_A100_40GB = GpuModel(
    "A100-40GB",
    memory_mib=40960,
    sm_count=108,
    tdp_w=400,
    idle_w=50,
    max_sm_clock_mhz=1410,
    mig_profiles=_mig_table(
        ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
        (4864, 9856, 19968, 40192),
        (14, 14, 28, 42, 56, 98),
    ),
)

_NO_MIG = "no MIG: it needs compute capability 8.0 (A100, A30, H100 and later)"
_TRACE_SIZE = "memory as the Alibaba trace simulator (MapGpuTypeMemoryMiB) counts it"
_ANONYMOUS = (
    "an anonymised model of the Alibaba GPU trace; only its memory is published, so power, "
    "clock and SM figures are 0 (unknown), and it is treated as unable to do MIG"
)

# The GPU models of the Alibaba 2023 trace (cluster-trace-gpu-v2023, "openb") that cannot be
# partitioned: shared there by milli-GPU, here by MPS or time-slicing. SMs, TDP and boost
# clocks are the datasheet's; idle power is an estimate.
_TRACE_MODELS = (
    GpuModel("P100", 16280, 56, 250, 30, 1329, note=f"Tesla P100 PCIe 16GB; {_NO_MIG}; {_TRACE_SIZE}"),
    GpuModel("T4", 15109, 40, 70, 10, 1590, note=f"Tesla T4; {_NO_MIG}; {_TRACE_SIZE}"),
    GpuModel("V100M16", 16160, 80, 300, 40, 1530, note=f"Tesla V100 SXM2 16GB; {_NO_MIG}; {_TRACE_SIZE}"),
    GpuModel("V100M32", 32510, 80, 300, 40, 1530, note=f"Tesla V100 SXM2 32GB; {_NO_MIG}; {_TRACE_SIZE}"),
    GpuModel("A10", 22731, 72, 150, 20, 1695, note=f"NVIDIA A10; {_NO_MIG} (GA102); {_TRACE_SIZE}"),
    # The simulator's table says 10000 MiB for G1 in its comment but computes 1000 (a
    # dropped zero); 10/20/30 GB is the evident intent.
    GpuModel("G1", 10000, 0, 0, 0, 0, note=_ANONYMOUS),
    GpuModel("G2", 20000, 0, 0, 0, 0, note=_ANONYMOUS),
    GpuModel("G3", 30000, 0, 0, 0, 0, note=_ANONYMOUS),
)

# The models the platform runs sandboxes on, and that the simulated backend can imitate.
MODELS: dict[str, GpuModel] = {
    m.name: m for m in (_H100_80GB, _A100_80GB, _A100_40GB, _H200, _H100_PCIE, _H100_NVL, _H800, _GH200_96GB)
}

# Every model this module knows: MODELS plus the trace's models, for replay and planning.
CATALOG: dict[str, GpuModel] = {**MODELS, **{m.name: m for m in _TRACE_MODELS}}

# NVML reports marketing names; map the ones we know to canonical models: (family as a
# whole word, a size the name must contain, canonical name, memory the GPU must stay below).
# Whole words, because "A10" is a prefix of "A100".
# "GH200" is not the word "H200", so the H200 hint cannot catch it; a GH200 with 144 GB of
# HBM3e has the H200's memory and MIG geometry.
_NAME_HINTS = (
    (r"GH200", "144G", "H200", 0),
    (r"GH200", "", "GH200-96GB", 0),
    (r"H100", "NVL", "H100-NVL", 0),
    (r"H100", "PCIE", "H100-PCIe", 0),
    (r"H100", "80GB", "H100-80GB", 0),
    (r"H800", "", "H800-80GB", 0),
    (r"H200", "", "H200", 0),  # H200 SXM and H200 NVL: both 141 GB
    (r"A100", "80GB", "A100-80GB", 0),
    (r"A100", "", "A100-40GB", 60000),
    (r"A10", "", "A10", 0),
    (r"V100S?", "32GB", "V100M32", 0),
    (r"V100S?", "", "V100M16", 24000),
    (r"P100", "", "P100", 0),
    (r"T4", "", "T4", 0),
)


def model_for_name(nvml_name: str, memory_mib: int) -> GpuModel | None:
    """Best-effort mapping from an NVML device name (e.g. "NVIDIA H100 80GB HBM3")."""
    upper = nvml_name.upper()
    for family, size, canonical, below_mib in _NAME_HINTS:
        if not re.search(rf"\b{family}\b", upper) or size not in upper:
            continue
        if below_mib and memory_mib >= below_mib:
            continue
        return CATALOG[canonical]
    return None


def check_layout(model: GpuModel, layout: Sequence[tuple[str, int]]) -> list[str]:
    """Why ``layout`` ([(profile, start), ...]) cannot exist on one ``model`` GPU; [] if it can."""
    if not model.mig_capable:
        return [f"{model.name} cannot do MIG"]
    problems: list[str] = []
    placed: list[tuple[str, int, int]] = []  # (profile, start, mask) of the known ones
    compute = media = 0
    for name, start in layout:
        try:
            profile = model.profile(name)
        except KeyError:
            problems.append(f"{model.name} has no MIG profile {name!r}")
            continue
        if start not in profile.starts:
            legal = ", ".join(map(str, profile.starts))
            problems.append(f"{name} cannot start at memory slice {start} (legal: {legal})")
            continue
        mask = profile.mask(start)
        problems.extend(
            f"{name}@{start} overlaps {other}@{other_start}"
            for other, other_start, other_mask in placed
            if mask & other_mask
        )
        placed.append((name, start, mask))
        compute += profile.compute_slices
        media += profile.media_extension
    if compute > COMPUTE_SLICES:
        problems.append(f"{compute} compute slices in use, {COMPUTE_SLICES} exist")
    if media > 1:
        problems.append(f"{media} instances with media extensions (+me), at most 1")
    return problems


def placeable_starts(model: GpuModel, profile_name: str, layout: Sequence[tuple[str, int]]) -> list[int]:
    """Starts where ``profile_name`` can be added to a legal ``layout`` and keep it legal:
    free memory slices, compute slices left and at most one ``+me`` instance. The tests'
    oracle for the planners' choices (``check_layout`` judges whole layouts)."""
    profile = model.profile(profile_name)
    taken = compute = media = 0
    for name, start in layout:
        other = model.profile(name)
        taken |= other.mask(start)
        compute += other.compute_slices
        media += other.media_extension
    if compute + profile.compute_slices > COMPUTE_SLICES or (profile.media_extension and media):
        return []
    return [s for s in profile.starts if not taken & profile.mask(s)]
