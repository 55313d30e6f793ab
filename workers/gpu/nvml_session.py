"""Short NVML sessions, and the one-off questions the agent asks NVML outside its backend.

NVML counts its initialisations, so a short ``nvmlInit`` … ``nvmlShutdown`` pair leaves the
backend's long-lived session (``NvmlBackend``) alone; ``nvml_session`` is that pair, written
once. The shutdown never raises: a failing shutdown would hide the answer (or the error) the
session was opened for, and there is nothing left to release.

The sandbox drivers ask NVML only through this package (``device_ids`` for the device nodes a
process sandbox gets), so ``workers/gpu/`` stays the one place that imports ``pynvml``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pynvml


class NvmlDidNotStart(RuntimeError):
    """``nvmlInit`` failed (no driver, no library, a driver/library mismatch): NVML cannot be
    asked anything. Says "NVML did not initialise: <NVML's reason>"."""


@contextmanager
def nvml_session() -> Iterator[None]:
    """NVML initialised for the ``with`` block; NvmlDidNotStart when it cannot be.

    Errors of the calls inside propagate as NVML raised them (``pynvml.NVMLError``), for the
    caller to name what it was asking.
    """
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlDidNotStart(f"NVML did not initialise: {err}") from err
    try:
        yield
    finally:
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


@dataclass(frozen=True)
class DeviceIds:
    """Where one GPU or MIG device lives: the minor of ``/dev/nvidia<minor>`` (a MIG
    device's parent's), and for a MIG device its GPU and compute instance ids."""

    minor: int
    gi: int | None = None
    ci: int | None = None


def device_ids(device_uuid: str) -> DeviceIds:
    """The ids of ``device_uuid`` from NVML; LookupError when NVML cannot say (NVML absent,
    UUID unknown)."""
    try:
        with nvml_session():
            handle = pynvml.nvmlDeviceGetHandleByUUID(device_uuid)
            if device_uuid.startswith("MIG-") or pynvml.nvmlDeviceIsMigDeviceHandle(handle):
                # NVML gives no minor for a MIG handle: the node is its parent GPU's.
                parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
                return DeviceIds(
                    minor=int(pynvml.nvmlDeviceGetMinorNumber(parent)),
                    gi=int(pynvml.nvmlDeviceGetGpuInstanceId(handle)),
                    ci=int(pynvml.nvmlDeviceGetComputeInstanceId(handle)),
                )
            return DeviceIds(minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)))
    except NvmlDidNotStart as exc:
        raise LookupError(str(exc)) from exc
    except pynvml.NVMLError as exc:
        raise LookupError(f"NVML: {exc}") from exc
