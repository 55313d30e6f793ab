"""GPU models and their MIG geometry.

A MIG-capable GPU has 8 memory slices and 7 compute slices. A profile takes a number of
each and may only start at the memory-slice offsets NVIDIA lists as its placements
(``nvidia-smi mig -lgipp``). Two instances may not share a memory slice.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_SLICES = 8
COMPUTE_SLICES = 7


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

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def profile(self, name: str) -> MigProfile:
        for profile in self.mig_profiles:
            if profile.name == name:
                return profile
        raise KeyError(f"{self.name} has no MIG profile {name!r}")


def _p(name: str, c: int, m: int, mib: int, sms: int, starts: tuple[int, ...]) -> MigProfile:
    return MigProfile(name, c, m, mib, sms, starts)


_H100_80GB = GpuModel(
    "H100-80GB",
    memory_mib=81559,
    sm_count=132,
    tdp_w=700,
    idle_w=70,
    max_sm_clock_mhz=1980,
    mig_profiles=(
        _p("1g.10gb", 1, 1, 9856, 16, (0, 1, 2, 3, 4, 5, 6)),
        _p("1g.20gb", 1, 2, 19968, 26, (0, 2, 4, 6)),
        _p("2g.20gb", 2, 2, 19968, 32, (0, 2, 4)),
        _p("3g.40gb", 3, 4, 40192, 60, (0, 4)),
        _p("4g.40gb", 4, 4, 40192, 64, (0,)),
        _p("7g.80gb", 7, 8, 80896, 132, (0,)),
    ),
)

_A100_80GB = GpuModel(
    "A100-80GB",
    memory_mib=81920,
    sm_count=108,
    tdp_w=400,
    idle_w=55,
    max_sm_clock_mhz=1410,
    mig_profiles=(
        _p("1g.10gb", 1, 1, 9728, 14, (0, 1, 2, 3, 4, 5, 6)),
        _p("1g.20gb", 1, 2, 19968, 14, (0, 2, 4, 6)),
        _p("2g.20gb", 2, 2, 19968, 28, (0, 2, 4)),
        _p("3g.40gb", 3, 4, 40192, 42, (0, 4)),
        _p("4g.40gb", 4, 4, 40192, 56, (0,)),
        _p("7g.80gb", 7, 8, 80896, 98, (0,)),
    ),
)

_A100_40GB = GpuModel(
    "A100-40GB",
    memory_mib=40960,
    sm_count=108,
    tdp_w=400,
    idle_w=50,
    max_sm_clock_mhz=1410,
    mig_profiles=(
        _p("1g.5gb", 1, 1, 4864, 14, (0, 1, 2, 3, 4, 5, 6)),
        _p("1g.10gb", 1, 2, 9856, 14, (0, 2, 4, 6)),
        _p("2g.10gb", 2, 2, 9856, 28, (0, 2, 4)),
        _p("3g.20gb", 3, 4, 19968, 42, (0, 4)),
        _p("4g.20gb", 4, 4, 19968, 56, (0,)),
        _p("7g.40gb", 7, 8, 40192, 98, (0,)),
    ),
)

MODELS: dict[str, GpuModel] = {m.name: m for m in (_H100_80GB, _A100_80GB, _A100_40GB)}

# NVML reports marketing names; map the ones we know to canonical models.
_NAME_HINTS = (("H100", "80GB", "H100-80GB"), ("A100", "80GB", "A100-80GB"), ("A100", "", "A100-40GB"))


def model_for_name(nvml_name: str, memory_mib: int) -> GpuModel | None:
    """Best-effort mapping from an NVML device name (e.g. "NVIDIA H100 80GB HBM3")."""
    upper = nvml_name.upper()
    for family, size, canonical in _NAME_HINTS:
        if family in upper and (size in upper or (not size and memory_mib < 60000)):
            return MODELS[canonical]
    return None


def free_starts(model: GpuModel, profile_name: str, used: list[tuple[int, int]]) -> list[int]:
    """Legal starts for ``profile_name`` given used (start, memory_slices) instances."""
    profile = model.profile(profile_name)
    taken: set[int] = set()
    for start, size in used:
        taken.update(range(start, start + size))
    return [s for s in profile.starts if not taken.intersection(profile.slots(s))]
