"""GPU backends: real GPUs through NVML, or simulated ones (see base.py for the seam)."""

from __future__ import annotations

from workers.gpu.base import GpuBackend
from workers.gpu.nvml import NvmlBackend, nvml_available
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

BACKEND_KINDS = ("nvml", "simulated", "auto")


def make_backend(kind: str, host: str, sim_spec: str) -> GpuBackend:
    """The backend GPU_BACKEND names; ``auto`` takes NVML when it sees a GPU.

    ``sim_spec`` (e.g. ``"H100-80GB:4:mig=0,1;A100-80GB:2"``) is used only when the
    result is simulated.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown GPU backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")
    if kind == "nvml" or (kind == "auto" and nvml_available()):
        return NvmlBackend()
    return SimulatedBackend(host, parse_sim_spec(sim_spec))
