"""What a GPU board says, through NVML, about whether it can take work: its NVLink fabric
registration and its memory repairs. NVML raises no event for either, so the agent reads
them: at inventory and then on a period (``workers.host.gpu_conditions``).

**Fabric.** On Hopper + NVSwitch systems (HGX H100/H200) a GPU is usable by CUDA only once
NVIDIA Fabric Manager has registered it in the NVLink fabric (nvml.h,
``nvmlDeviceGetGpuFabricInfoV``: state COMPLETED and status SUCCESS). Until then NVML
answers normally while every CUDA call fails with ``CUDA_ERROR_SYSTEM_NOT_READY`` (802):
after a boot while nvidia-fabricmanager starts, when it is not running, or when its
version differs from the driver's after an upgrade. NOT_SUPPORTED (a PCIe GPU, no
NVSwitch), or a driver without the call, means there is no fabric to wait for.

**Memory repairs.** Row remapping (Ampere and later) and dynamic page retirement (before
it) are recorded in the board's InfoROM and take effect at the next GPU reset: state from
before the agent started, which no event repeats. See ``MemoryRepairs``.

Functions take an NVML device handle of a whole GPU (a MIG device's parent: NVML answers
these per board) and let ``GpuIsLost`` through for the backend's guard to report.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from workers.gpu.base import MemoryRepairs

T = TypeVar("T")

# Readings this GPU, driver or user cannot take: nothing to report.
_NOT_REPORTED = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_NoPermission,
    pynvml.NVMLError_FunctionNotFound,  # a driver older than the call
    pynvml.NVMLLibraryMismatchError,
)
_LOST = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)

FABRIC_STATES = {
    pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not supported",
    pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not started",
    pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in progress",
    pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
}
_FABRIC_REMEDY = (
    "CUDA fails with error 802 on it until then; check that nvidia-fabricmanager runs, at the "
    "driver's version"
)


def fabric_problem(handle: Any) -> str:
    """Why the GPU's NVLink fabric keeps it from CUDA work, or "" when it does not (ready,
    or no fabric). An NVML error other than a lost GPU is a problem too (the fabric state
    is unknown, so the GPU is not offered); the next read may clear it."""
    try:
        info = _fabric_info(handle)
    except _LOST:
        raise
    except pynvml.NVMLError as err:
        return f"NVLink fabric state unreadable ({err}): the GPU is not offered until NVML reports it"
    if info is None:
        return ""
    # nvml.h declares nvmlGpuFabricState_t an unsigned char; pynvml reads it as a c_uint,
    # whose upper bytes are the structure's padding: only the low byte is the state.
    state = int(info.state) & 0xFF
    if state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
        return ""
    if state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
        status = int(info.status)
        if status == pynvml.NVML_SUCCESS:
            return ""
        return (
            f"NVLink fabric not ready: Fabric Manager failed to register this GPU "
            f"({pynvml.NVMLError(status)}); {_FABRIC_REMEDY}"
        )
    name = FABRIC_STATES.get(state, f"unknown state {state}")
    return (
        f"NVLink fabric not ready: Fabric Manager has not registered this GPU (state {name}); "
        f"{_FABRIC_REMEDY}"
    )


def _fabric_info(handle: Any) -> Any:
    """The fabric info structure, from the versioned call (R550+) or the one before it;
    None when the GPU or driver has neither."""
    try:
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        return info
    except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
        pass  # a driver before the versioned call: ask the older one
    except _NOT_REPORTED:
        return None
    try:
        older = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(older))
        return older
    except _NOT_REPORTED:
        return None


def memory_repairs(handle: Any) -> MemoryRepairs:
    """Row remapping where the GPU has it (Ampere and later), page retirement where it has
    that (before Ampere); each left unreported (None) where NVML does not support it."""
    rows = _reported(lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
    pending_pages = _reported(lambda: int(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)))
    dbe_pages = None
    if pending_pages is not None:
        dbe_cause = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        dbe_pages = _reported(lambda: len(pynvml.nvmlDeviceGetRetiredPages(handle, dbe_cause)))
    corrected, uncorrected, pending, failed = rows if rows is not None else (None, None, 0, 0)
    return MemoryRepairs(
        remapped_uncorrectable=None if uncorrected is None else int(uncorrected),
        remapped_correctable=None if corrected is None else int(corrected),
        remap_pending=bool(pending),
        remap_failed=bool(failed),
        retired_pages_dbe=dbe_pages,
        retirement_pending=pending_pages == pynvml.NVML_FEATURE_ENABLED,
    )


def _reported(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except _NOT_REPORTED:
        return None
