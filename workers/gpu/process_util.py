"""Each process's SM utilization on a device, from NVML, for the sandboxes that share a GPU.

On a time-sliced or MPS GPU the device's utilization is everyone's: an idle tenant beside a
busy one would show the neighbour's 95 % and never be culled. NVML keeps a short history of
per-process samples instead: ``nvmlDeviceGetProcessesUtilizationInfo`` (R550 and later) or
the older ``nvmlDeviceGetProcessUtilization``. nvml.h: "One utilization sample structure is
returned per process running, that had some non-zero utilization during the last sample
period", with the CPU timestamp it was taken at; only samples newer than the
``lastSeenTimeStamp`` passed in come back, and NOT_FOUND when there is none. So a read here
passes the newest timestamp the previous read of that device returned, and each read covers
the time since the last sample; a process missing from the answer was idle (0 %).

``smUtil`` is the percentage of the sample period in which that process had a kernel
running on the device: a share of the whole device's time, summed over a sandbox's processes
by the agent (workers/host/reports.py ``HostReports.util_of``).

Where NVML cannot measure it, the answer is None (unmeasured), never {} (all idle):

* MIG devices and GPUs in MIG mode: NOT_SUPPORTED (as for the device's own utilization).
* MPS. NVIDIA's MPS documentation ("nvidia-cuda-mps-server"): the server "owns the CUDA
  context on the GPU and uses it to execute GPU operations for its client application
  processes. Due to this, when querying active processes via nvidia-smi (or any NVML-based
  application) nvidia-cuda-mps-server will appear as the active CUDA process rather than any
  of the client processes." Volta and later list each client's memory on its own
  (``nvmlDeviceGetMPSComputeRunningProcesses``), but no NVIDIA document found says that the
  per-process utilization samples name the clients rather than the server: **unverified**,
  and the project's device script checks it on a lent GPU. Until a sample proves it, a
  device with MPS clients is unmeasured per process; a sample from a pid that is not one of
  its MPS clients (the server, taking its clients' work as its own) makes it unmeasured for
  good; samples that name only clients make it measured for good. Never a mix that would
  read a busy MPS client as idle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import pynvml

log = logging.getLogger(__name__)

# What NVML answers where it cannot measure per-process utilization here.
_UNMEASURABLE = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_NoPermission,
    pynvml.NVMLLibraryMismatchError,
)
# Errors that mean the board is gone: they must reach the backend's guard (GpuLost).
_LOST = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)


class ProcessUtilization:
    """Per-process SM utilization of each device since the previous read of that device."""

    def __init__(self) -> None:
        self._last_seen: dict[str, int] = {}  # device uuid -> newest sample's timestamp (µs)
        self._mps_by_client: dict[str, bool] = {}  # device uuid -> do its samples name MPS clients?
        # nvmlDeviceGetProcessesUtilizationInfo exists (R550+): None until first tried.
        self._info_call: bool | None = None

    def read(self, handle: Any, uuid: str, mps_clients: Iterable[int] = ()) -> dict[str, float] | None:
        """{"pid:<pid>": SM %} of the processes busy since the last read of ``uuid``, or None
        when this device cannot say (see the module's docstring). ``mps_clients``: the pids
        NVML lists as MPS clients on the device."""
        try:
            samples = self._samples(handle, self._last_seen.get(uuid, 0))
        except pynvml.NVMLError_NotFound:
            samples = []  # no process was busy since the last read: all idle
        except _LOST:
            raise
        except _UNMEASURABLE:
            return None
        except pynvml.NVMLError as err:
            if err.value != pynvml.NVML_SUCCESS:  # pynvml raises SUCCESS when there are no samples
                log.debug("per-process utilization of %s not read: %s", uuid, err)
                return None
            samples = []
        newest: dict[int, Any] = {}  # pid -> its newest sample (nvml.h: one per process)
        for sample in samples:
            pid = int(sample.pid)
            if pid not in newest or int(sample.timeStamp) >= int(newest[pid].timeStamp):
                newest[pid] = sample
        if newest:
            self._last_seen[uuid] = max(int(s.timeStamp) for s in newest.values())
        clients = set(mps_clients)
        if clients and not self._mps_measurable(uuid, clients, set(newest)):
            return None
        return {f"pid:{pid}": float(min(100, int(s.smUtil))) for pid, s in newest.items()}

    def forget(self, uuid: str) -> None:
        self._last_seen.pop(uuid, None)
        self._mps_by_client.pop(uuid, None)

    def _mps_measurable(self, uuid: str, clients: set[int], busy: set[int]) -> bool:
        known = self._mps_by_client.get(uuid)
        if known is None and busy:
            known = self._mps_by_client[uuid] = busy <= clients
        return bool(known)

    def _samples(self, handle: Any, last_seen: int) -> list[Any]:
        if self._info_call is not False:
            call: Callable[[Any, int], list[Any]] | None = getattr(
                pynvml, "nvmlDeviceGetProcessesUtilizationInfo", None
            )
            if call is not None:
                try:
                    found = call(handle, last_seen)
                    self._info_call = True
                    return found
                except pynvml.NVMLError_FunctionNotFound:
                    pass  # a driver before R550: the older call below
            self._info_call = False
        return list(pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen))
