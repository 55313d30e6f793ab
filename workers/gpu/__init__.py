"""GPU backends: real GPUs through NVML, or simulated ones (see base.py for the seam)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from workers.gpu.base import GpuBackend, GpuBackendError
from workers.gpu.nvml import NvmlBackend, nvml_available, nvml_problem
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

BACKEND_KINDS = ("nvml", "simulated", "auto")
# Present on a host with the NVIDIA kernel driver loaded: such a host has GPUs, whatever NVML says.
NVIDIA_DRIVER_PATHS = (Path("/proc/driver/nvidia/version"), Path("/dev/nvidiactl"))

__all__ = ["BACKEND_KINDS", "NVIDIA_DRIVER_PATHS", "make_backend", "nvml_available"]


def make_backend(
    kind: str, host: str, sim_spec: str, driver_paths: Sequence[Path] = NVIDIA_DRIVER_PATHS
) -> GpuBackend:
    """The backend GPU_BACKEND names; ``auto`` takes NVML when it sees a GPU.

    ``sim_spec`` (e.g. ``"H100-80GB:4:mig=0,1;A100-80GB:2"``) is used only when the
    result is simulated. ``auto`` never simulates on a host with the NVIDIA driver
    (``driver_paths``): NVML failing there (a driver/library mismatch after an upgrade
    without a reboot, libnvidia-ml.so.1 missing) is an error to fix, not a reason to offer
    made-up H100s in place of the real ones.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown GPU backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")
    if kind == "nvml":
        return NvmlBackend()
    if kind == "auto":
        problem = nvml_problem()
        if problem is None:
            return NvmlBackend()
        present = [str(path) for path in driver_paths if path.exists()]
        if present:
            raise GpuBackendError(
                f"GPU_BACKEND=auto: {problem}, yet this host has the NVIDIA driver "
                f"({', '.join(present)} exists), so it will not simulate GPUs here. Fix NVML "
                "(does nvidia-smi work? a driver upgraded without a reboot?), or set "
                "GPU_BACKEND=simulated to simulate on purpose"
            )
    return SimulatedBackend(host, parse_sim_spec(sim_spec))
