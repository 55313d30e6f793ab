"""GPU utilization through GPM (GPU Performance Monitoring, Hopper and later).

NVML has no utilization for a MIG device, nor for a GPU in MIG mode
(``nvmlDeviceGetUtilizationRates`` answers NOT_SUPPORTED there). GPM does: two samples of a
GPU, or of one GPU instance on it (``nvmlGpmMigSampleGet``), give the share of time the
graphics/compute engine was busy between them (``NVML_GPM_METRIC_GRAPHICS_UTIL``, the signal
DCGM exposes as ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``, what NVIDIA points MIG users to).

``GpmUtilization`` keeps the newest sample of each device, so each ``read`` measures from the
previous one: the first read of a device has nothing to compare with and says None, as
does a GPU without GPM (the A100 and older). None means "not measured", never 0.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pynvml

log = logging.getLogger(__name__)

_UNSUPPORTED = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NoPermission,
    pynvml.NVMLLibraryMismatchError,
)
# The board is gone: that must reach the caller (it reports the GPU lost).
_LOST = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)
METRIC = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL


class GpmUtilization:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._supported: dict[str, bool] = {}  # GPU uuid -> GPM works there
        self._last: dict[tuple[str, int | None], Any] = {}  # (GPU uuid, GI id) -> sample
        self._warned: set[tuple[str, int | None]] = set()

    def supported(self, parent: Any, parent_uuid: str) -> bool:
        """Whether the GPU offers GPM (asked once per GPU; NVML says so per device)."""
        with self._lock:
            known = self._supported.get(parent_uuid)
        if known is None:
            try:
                known = bool(pynvml.nvmlGpmQueryDeviceSupport(parent).isSupportedDevice)
            except _LOST:
                raise
            except (*_UNSUPPORTED, pynvml.NVMLError) as err:
                self._note_unmeasured(parent_uuid, None, err)
                known = False
            with self._lock:
                self._supported[parent_uuid] = known
        return known

    def read(self, parent: Any, parent_uuid: str, gpu_instance_id: int | None) -> float | None:
        """Busy % of the GPU (``gpu_instance_id`` None) or of one of its GPU instances since
        the previous read of the same device; None on the first read or without GPM.

        A lost GPU's error propagates (the caller reports the loss); any other NVML error
        leaves the reading unmeasured, with one warning per device, so a GPM quirk never
        stops the GPU's other figures."""
        if not self.supported(parent, parent_uuid):
            return None
        sample = pynvml.nvmlGpmSampleAlloc()
        try:
            if gpu_instance_id is None:
                pynvml.nvmlGpmSampleGet(parent, sample)
            else:
                pynvml.nvmlGpmMigSampleGet(parent, gpu_instance_id, sample)
        except _LOST:
            _free(sample)
            raise
        except (*_UNSUPPORTED, pynvml.NVMLError) as err:
            _free(sample)
            self._note_unmeasured(parent_uuid, gpu_instance_id, err)
            return None
        key = (parent_uuid, gpu_instance_id)
        with self._lock:
            previous, self._last[key] = self._last.get(key), sample
        if previous is None:
            return None
        try:
            return _metric(previous, sample)
        except _LOST:
            raise
        except pynvml.NVMLError as err:
            self._note_unmeasured(parent_uuid, gpu_instance_id, err)
            return None
        finally:
            _free(previous)

    def _note_unmeasured(self, parent_uuid: str, gpu_instance_id: int | None, err: Exception) -> None:
        key = (parent_uuid, gpu_instance_id)
        if not isinstance(err, _UNSUPPORTED) and key not in self._warned:
            self._warned.add(key)
            where = (
                parent_uuid if gpu_instance_id is None else f"{parent_uuid} GPU instance {gpu_instance_id}"
            )
            log.warning("GPM utilization of %s unavailable (%s): reported as unmeasured", where, err)

    def forget(self, parent_uuid: str, gpu_instance_id: int | None = None) -> None:
        """Drop a device's kept sample (an instance destroyed: its id may be reused)."""
        with self._lock:
            sample = self._last.pop((parent_uuid, gpu_instance_id), None)
        if sample is not None:
            _free(sample)

    def close(self) -> None:
        with self._lock:
            samples, self._last = list(self._last.values()), {}
        for sample in samples:
            _free(sample)


def _metric(first: Any, second: Any) -> float | None:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 1
    request.sample1, request.sample2 = first, second
    request.metrics[0].metricId = METRIC
    try:
        pynvml.nvmlGpmMetricsGet(request)
    except _UNSUPPORTED:
        return None
    metric = request.metrics[0]
    if metric.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    return round(min(100.0, max(0.0, float(metric.value))), 1)


def _free(sample: Any) -> None:
    try:
        pynvml.nvmlGpmSampleFree(sample)
    except pynvml.NVMLError:
        log.warning("could not free a GPM sample", exc_info=True)
