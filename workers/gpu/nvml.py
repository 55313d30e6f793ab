"""The GPU backend for real NVIDIA GPUs, on nvidia-ml-py (``pynvml``).

Every NVML failure leaves this module as a ``GpuBackendError`` naming the operation and
the device, so the agent handles one exception type. A GPU that answers
``NVML_ERROR_GPU_IS_LOST`` (or ``RESET_REQUIRED``) to any call raises ``GpuLost``, its
subclass that names the GPU, and is reported once as a ``gpu_lost`` fault event.

Utilization is None where NVML cannot measure it (a MIG device, a GPU in MIG mode) unless
GPM can (Hopper: gpm.py). Never 0 for "unknown": idle culling reads 0 as idle. Each
process's own utilization (``GpuSample.util_by_owner``, for sandboxes sharing a GPU) comes
from process_util.py, which says what NVML reports per process and where it cannot (MIG, MPS).

MIG: reading and changing GPU instances needs root (the agent runs as root on GPU hosts).
Changing MIG *mode* is never done here: that needs a GPU reset and stays an operator's job.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from scheduler.gpus import model_for_name
from workers.gpu import nvml_board
from workers.gpu.base import (
    COMPUTE_DEFAULT,
    COMPUTE_EXCLUSIVE_PROCESS,
    COMPUTE_PROHIBITED,
    FaultEvent,
    GpuBackendError,
    GpuInfo,
    GpuLost,
    GpuSample,
    MemoryRepairs,
    MigDevice,
    xid_event,
)
from workers.gpu.gpm import GpmUtilization
from workers.gpu.nvml_session import NvmlDidNotStart, nvml_session
from workers.gpu.nvml_topology import TopologyReader
from workers.gpu.process_util import ProcessUtilization

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# gpuInstanceId in event data when the event is not tied to one MIG instance.
_NO_INSTANCE = 0xFFFFFFFF

# Every GPU instance profile NVML knows; each GPU offers some of them.
_GI_PROFILE_ENUMS = tuple(
    value
    for key, value in sorted(vars(pynvml).items())
    if key.startswith("NVML_GPU_INSTANCE_PROFILE_") and key != "NVML_GPU_INSTANCE_PROFILE_COUNT"
)

# The compute instance that spans the whole GPU instance: one per slice count.
_CI_PROFILE_FOR_SLICES = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
}

# Clock event ("throttle") reason bits, named as GpuSample.throttle spells them.
_CLOCK_REASONS = (
    (pynvml.nvmlClocksEventReasonGpuIdle, "gpu_idle"),
    (pynvml.nvmlClocksEventReasonApplicationsClocksSetting, "applications_clocks_setting"),
    (pynvml.nvmlClocksEventReasonSwPowerCap, "sw_power_cap"),
    (pynvml.nvmlClocksEventReasonHwSlowdown, "hw_slowdown"),
    (pynvml.nvmlClocksEventReasonSyncBoost, "sync_boost"),
    (pynvml.nvmlClocksEventReasonSwThermalSlowdown, "sw_thermal"),
    (pynvml.nvmlClocksEventReasonHwThermalSlowdown, "hw_thermal"),
    (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, "hw_power_brake"),
    (pynvml.nvmlClocksEventReasonDisplayClockSetting, "display_clock_setting"),
)

# "GPU unavailable" (R570+ drivers; 0 with an older nvidia-ml-py) reports a lost GPU through
# the event set, so a GPU that falls off the bus is seen even when nothing else calls it.
_GPU_UNAVAILABLE = int(getattr(pynvml, "nvmlEventTypeGpuUnavailableError", 0))
_FAULT_EVENT_TYPES = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | _GPU_UNAVAILABLE
)
# XID 79: "GPU has fallen off the bus". The board is gone until a reset, whatever else works.
XID_FELL_OFF_BUS = 79
_WITHOUT_EVENTS = (
    "running without NVML events: XIDs and double-bit ECC errors go unseen (a lost GPU is "
    "still noticed by its failing calls); restart the agent once nvidia-smi works cleanly"
)
# Errors that mean the board is gone until someone resets it.
_LOST = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)
# Readings a GPU, driver or user cannot take.
_UNSUPPORTED = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_NoPermission,
    # pynvml raises this, not an NVMLError, when the driver lacks a versioned call
    pynvml.NVMLLibraryMismatchError,
)

T = TypeVar("T")

# nvmlComputeMode_t <-> the backends' names (workers.gpu.base.COMPUTE_MODES). EXCLUSIVE_THREAD
# (1) is deprecated and read as what it is not: never asked for, never mistaken for ours.
_COMPUTE_MODE_VALUES = {
    COMPUTE_DEFAULT: pynvml.NVML_COMPUTEMODE_DEFAULT,
    COMPUTE_EXCLUSIVE_PROCESS: pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    COMPUTE_PROHIBITED: pynvml.NVML_COMPUTEMODE_PROHIBITED,
}
_COMPUTE_MODE_NAMES = {value: name for name, value in _COMPUTE_MODE_VALUES.items()}


@dataclass(frozen=True)
class _GiProfile:
    id: int  # the profile id NVML's create and info calls use
    name: str  # e.g. "3g.40gb"
    slices: int  # compute slices
    memory_mib: int  # what NVML says an instance of it holds (memorySizeMB)
    instance_count: int  # how many of it fit on the GPU


def nvml_available() -> bool:
    """True when NVML loads and sees at least one GPU (GPU_BACKEND=auto picks nvml then)."""
    return nvml_problem() is None


def nvml_problem() -> str | None:
    """Why NVML cannot drive GPUs here ("NVML did not initialise: Driver Not Loaded", "NVML
    sees no GPU"), or None when it loads and sees at least one."""
    try:
        with nvml_session():
            return None if int(pynvml.nvmlDeviceGetCount()) > 0 else "NVML sees no GPU"
    except NvmlDidNotStart as err:
        return str(err)
    except pynvml.NVMLError as err:
        return f"NVML could not count GPUs: {err}"


def decode_clock_reasons(bits: int) -> tuple[str, ...]:
    return tuple(name for bit, name in _CLOCK_REASONS if bits & bit)


class NvmlBackend:
    name = "nvml"
    simulated = False

    def __init__(self) -> None:
        # The agent samples from its own thread while task threads change MIG layouts.
        self._lock = threading.RLock()
        self._events: list[FaultEvent] = []
        self._lost: set[str] = set()
        self._known: dict[int, str] = {}  # index -> GPU uuid, to name a GPU once it is lost
        self._mig_parent: dict[str, str] = {}  # MIG uuid -> GPU uuid
        self._mig_by_gi: dict[tuple[str, int], str] = {}  # (GPU uuid, GI id) -> MIG uuid
        self._gi_profiles_by_gpu: dict[str, dict[str, _GiProfile]] = {}
        self._closed = False
        self._gpm = GpmUtilization()
        self._process_util = ProcessUtilization()
        self._topology = TopologyReader()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise GpuBackendError(f"NVML did not initialise: {err}") from err
        try:
            self._event_set = self._register_events()
        except BaseException:
            pynvml.nvmlShutdown()
            raise

    # -- inventory -------------------------------------------------------------------------

    def list_gpus(self) -> list[GpuInfo]:
        with self._guard("count GPUs"):
            count = int(pynvml.nvmlDeviceGetCount())
        gpus = []
        for index in range(count):
            try:
                gpus.append(self._gpu_info(index))
            except GpuBackendError as err:
                if isinstance(err, GpuLost) or isinstance(err.__cause__, _LOST):
                    continue  # a lost GPU leaves the inventory; a gpu_lost event says why
                raise
        with self._lock:
            return self._topology.apply(gpus)

    def _gpu_info(self, index: int) -> GpuInfo:
        with self._guard(f"read GPU {index}", self._known.get(index)):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(pynvml.nvmlDeviceGetUUID(handle))
        with self._lock:
            self._known[index] = uuid
        with self._guard("read GPU", uuid):
            name = str(pynvml.nvmlDeviceGetName(handle))
            memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB
            mig_enabled = _mig_enabled(handle)
            migs = self._mig_devices(handle, uuid) if mig_enabled else []
            not_ready = nvml_board.fabric_problem(handle)
        if not_ready:
            log.warning("GPU %s is not offered: %s", uuid, not_ready)
        model = model_for_name(name, memory_mib)
        unusable = [d for d in migs if not d.usable]
        if unusable:
            log.warning(
                "GPU %s holds GPU instances no sandbox can use (no or several compute "
                "instances), taking their memory slices: %s",
                uuid,
                ", ".join(
                    f"{d.profile}@{d.start} gi{d.gpu_instance_id}: {d.compute_instances} CI" for d in unusable
                ),
            )
        return GpuInfo(
            uuid=uuid,
            index=index,
            name=name,
            model=model.name if model else "",
            memory_mib=memory_mib,
            mig_enabled=mig_enabled,
            mig_devices=tuple(d for d in migs if d.usable),
            simulated=False,
            unusable_mig=tuple(unusable),
            not_ready=not_ready,
        )

    def fabric_problem(self, uuid: str) -> str:
        """The GPU's NVLink fabric registration (nvml_board.fabric_problem), asked of the
        board for a MIG device."""
        with self._guard("read NVLink fabric state", uuid):
            return nvml_board.fabric_problem(self._board(uuid))

    def memory_repairs(self, uuid: str) -> MemoryRepairs:
        """Row remapping and page retirement (nvml_board.memory_repairs) of the board."""
        with self._guard("read memory repairs", uuid):
            return nvml_board.memory_repairs(self._board(uuid))

    @staticmethod
    def _board(uuid: str) -> Any:
        """The whole GPU's handle for a GPU or MIG uuid (the caller guards the calls)."""
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        if uuid.startswith("MIG-"):
            return pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        return handle

    def mig_layout(self, uuid: str) -> list[MigDevice]:
        with self._guard("read MIG layout", uuid):
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            return self._mig_devices(handle, uuid) if _mig_enabled(handle) else []

    def _mig_devices(self, parent: Any, parent_uuid: str) -> list[MigDevice]:
        """Every GPU instance of a GPU in MIG mode, once each, by placement.

        GPU instances are listed per profile (``nvmlDeviceGetGpuInstances``), so one without
        a compute instance still shows, and a GPU instance with several compute instances is
        one entry, not one per CI with the same placement. Memory is the profile's, as NVML
        states it (memorySizeMB); the MIG uuid is the one compute instance's, when it has one.
        """
        profiles = list(self._gi_profiles(parent, parent_uuid).values())
        compute = _compute_instances(parent)
        devices = []
        for profile in profiles:
            try:
                instances = _gpu_instances(parent, profile)
            except pynvml.NVMLError_NoPermission:
                instances = []  # not root: the GPU instances that hold a CI still show below
            for gpu_instance in instances:
                info = pynvml.nvmlGpuInstanceGetInfo(gpu_instance)
                cis = compute.pop(int(info.id), [])
                devices.append(_mig_device(parent_uuid, profile, info, cis))
        by_id = {p.id: p for p in profiles}
        for gi_id, cis in compute.items():  # a compute instance whose GI was not listed
            info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(parent, gi_id))
            pid = int(info.profileId)
            known = by_id.get(pid) or _GiProfile(pid, f"profile-{pid}", 0, 0, 0)
            devices.append(_mig_device(parent_uuid, known, info, cis))
        with self._lock:
            for device in devices:
                self._mig_parent[device.uuid] = parent_uuid
                # An event in an unusable instance names the GPU: the portal knows no such device.
                if device.usable:
                    self._mig_by_gi[(parent_uuid, device.gpu_instance_id)] = device.uuid
                else:
                    self._mig_by_gi.pop((parent_uuid, device.gpu_instance_id), None)
        return sorted(devices, key=lambda d: (d.start, d.gpu_instance_id))

    def _gi_profiles(self, handle: Any, uuid: str) -> dict[str, _GiProfile]:
        """The GPU instance profiles this GPU offers, by name (cached: they never change)."""
        with self._lock:
            cached = self._gi_profiles_by_gpu.get(uuid)
        if cached is not None:
            return cached
        profiles = {}
        for enum in _GI_PROFILE_ENUMS:
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                continue  # not offered by this GPU
            name = str(info.name).removeprefix("MIG ")  # NVML says e.g. "MIG 3g.40gb"
            profiles[name] = _GiProfile(
                int(info.id), name, int(info.sliceCount), int(info.memorySizeMB), int(info.instanceCount)
            )
        with self._lock:
            self._gi_profiles_by_gpu[uuid] = profiles
        return profiles

    # -- MIG changes -----------------------------------------------------------------------

    def create_mig(self, uuid: str, profile: str, start: int) -> MigDevice:
        with self._guard(f"create MIG {profile}@{start}", uuid):
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            if not _mig_enabled(handle):
                raise GpuBackendError(f"MIG mode is disabled on {uuid}")
            gi_profile = self._gi_profiles(handle, uuid).get(profile)
            if gi_profile is None:
                known = ", ".join(sorted(self._gi_profiles(handle, uuid)))
                raise GpuBackendError(f"{uuid} has no MIG profile {profile!r} (known: {known})")
            memory_slices = self._check_placement(handle, uuid, profile, start)
            placement = pynvml.c_nvmlGpuInstancePlacement_t(start=start, size=memory_slices)
            gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, gi_profile.id, ctypes.byref(placement)
            )
            try:
                _create_compute_instance(gpu_instance, gi_profile)
            except pynvml.NVMLError:
                # A GPU instance without a compute instance is no device a sandbox can use.
                with suppress(pynvml.NVMLError):
                    pynvml.nvmlGpuInstanceDestroy(gpu_instance)
                raise
            gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gpu_instance).id)
            for device in self._mig_devices(handle, uuid):
                if device.gpu_instance_id == gi_id:
                    return device
        raise GpuBackendError(f"created GPU instance {gi_id} on {uuid} but no MIG device shows it")

    def _check_placement(self, handle: Any, uuid: str, profile: str, start: int) -> int:
        """Refuse an illegal or overlapping start with a clear message; return its size.

        Legal starts come from scheduler.gpus for a model it knows, else from NVML's own
        placement list (a board this module has no table for still gets MIG)."""
        name = str(pynvml.nvmlDeviceGetName(handle))
        model = model_for_name(name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB)
        if model is not None and profile in {p.name for p in model.mig_profiles}:
            known = model.profile(profile)
            starts, size, where = known.starts, known.memory_slices, model.name
        else:
            starts, size = _possible_placements(handle, self._gi_profiles(handle, uuid)[profile])
            where = f"{name} (placements from NVML)"
        if start not in starts:
            legal = ", ".join(map(str, starts))
            raise GpuBackendError(
                f"{profile} cannot start at memory slice {start} on {where}; legal: {legal}"
            )
        wanted = set(range(start, start + size))
        clash = [
            f"{d.profile}@{d.start}"
            for d in self._mig_devices(handle, uuid)
            if wanted.intersection(range(d.start, d.start + d.memory_slices))
        ]
        if clash:
            raise GpuBackendError(f"{profile}@{start} overlaps {', '.join(clash)} on {uuid}")
        return size

    def destroy_mig(self, uuid: str, mig_uuid: str) -> None:
        """Destroy a MIG device: its compute instance(s), then its GPU instance.

        NVML refuses (IN_USE) while a process runs on it, an MPS server included. When the
        GPU instance refuses after its compute instance went, the compute instance is made
        again so the device stays usable (a new MIG uuid), or, failing that, the GPU instance
        stays in mig_layout as an unusable entry; either way the error says which.
        """
        with self._guard(f"destroy MIG {mig_uuid}", uuid):
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            device = next((d for d in self._mig_devices(handle, uuid) if d.uuid == mig_uuid), None)
            if device is None:
                raise GpuBackendError(f"{mig_uuid} is not a MIG device of {uuid}")
            gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, device.gpu_instance_id)
            for ci_id, _ in _compute_instances(handle).get(device.gpu_instance_id, []):
                compute_instance = pynvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, ci_id)
                try:
                    pynvml.nvmlComputeInstanceDestroy(compute_instance)
                except pynvml.NVMLError_InUse as err:
                    raise GpuBackendError(
                        f"destroy MIG {mig_uuid} on {uuid}: processes still run on it "
                        f"(an MPS server too keeps it in use): {err}"
                    ) from err
            try:
                pynvml.nvmlGpuInstanceDestroy(gpu_instance)
            except pynvml.NVMLError as err:
                if isinstance(err, _LOST):
                    raise
                raise GpuBackendError(self._left_behind(handle, uuid, device, gpu_instance, err)) from err
        self._forget_mig(uuid, device)

    def _left_behind(
        self, handle: Any, uuid: str, device: MigDevice, gpu_instance: Any, err: pynvml.NVMLError
    ) -> str:
        """After a failed GPU instance destroy: put a full compute instance back, and say so."""
        what = (
            f"destroy MIG {device.uuid} on {uuid}: its compute instance is gone but GPU instance "
            f"{device.gpu_instance_id} ({device.profile}@{device.start}) stays ({err})"
        )
        profile = self._gi_profiles(handle, uuid).get(device.profile)
        if device.compute_instances == 1 and profile is not None:
            try:
                _create_compute_instance(gpu_instance, profile)
                again = next(
                    d for d in self._mig_devices(handle, uuid) if d.gpu_instance_id == device.gpu_instance_id
                )
            except (pynvml.NVMLError, StopIteration):
                log.warning("could not re-create the compute instance of %s", device.uuid, exc_info=True)
            else:
                return f"{what}; its compute instance was made again: the device is now {again.uuid}"
        slices = f"{device.start}-{device.start + device.memory_slices - 1}"
        return (
            f"{what}; it holds memory slices {slices} without a compute instance and shows in the "
            f"MIG layout as {uuid}/gi{device.gpu_instance_id}"
        )

    def _forget_mig(self, uuid: str, device: MigDevice) -> None:
        with self._lock:
            self._mig_parent.pop(device.uuid, None)
            self._mig_by_gi.pop((uuid, device.gpu_instance_id), None)
        self._gpm.forget(uuid, device.gpu_instance_id)
        self._process_util.forget(device.uuid)

    # -- telemetry -------------------------------------------------------------------------

    def sample(self, uuid: str) -> GpuSample:
        """Temperature, power and clocks come from the whole GPU; memory and utilization from
        the device. Raises GpuLost when the GPU (a MIG device's board) is lost."""
        with self._guard("sample", uuid):
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            mig = uuid.startswith("MIG-")
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle) if mig else handle
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = self._utilization(handle, parent, uuid, mig)
            power_mw = _unless_unsupported(lambda: int(pynvml.nvmlDeviceGetPowerUsage(parent)), 0)
            reasons = _unless_unsupported(lambda: _clock_reasons(parent), 0)
            # ECC is counted per board: a MIG device reports its parent's counts.
            corrected, uncorrected = _unless_unsupported(lambda: _ecc_counts(parent), (0, 0))
            no_processes: tuple[dict[str, int], set[int]] = ({}, set())
            held, mps_clients = _unless_unsupported(lambda: _memory_by_pid(handle), no_processes)
            return GpuSample(
                uuid=uuid,
                t_ms=int(time.time() * 1000),
                temp_c=float(pynvml.nvmlDeviceGetTemperature(parent, pynvml.NVML_TEMPERATURE_GPU)),
                util_pct=util,
                mem_used_mib=int(memory.used) // MIB,
                mem_total_mib=int(memory.total) // MIB,
                power_w=power_mw / 1000,
                sm_clock_mhz=int(pynvml.nvmlDeviceGetClockInfo(parent, pynvml.NVML_CLOCK_SM)),
                throttle=decode_clock_reasons(reasons),
                mem_by_owner=held,
                util_by_owner=self._process_util.read(handle, uuid, mps_clients),
                ecc_corrected=corrected,
                ecc_uncorrected=uncorrected,
            )

    def _utilization(self, handle: Any, parent: Any, uuid: str, mig: bool) -> float | None:
        """Busy %, or None when nothing measures it: NVML has no utilization for a MIG
        device nor for a GPU in MIG mode, so GPM reads those where the GPU has it."""
        if not mig:
            with suppress(*_UNSUPPORTED):
                return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            return self._gpm.read(parent, uuid, None)
        parent_uuid = self._mig_parent.get(uuid) or str(pynvml.nvmlDeviceGetUUID(parent))
        return self._gpm.read(parent, parent_uuid, int(pynvml.nvmlDeviceGetGpuInstanceId(handle)))

    # -- faults ----------------------------------------------------------------------------

    def _register_events(self) -> Any:
        """An event set for XID, double-bit ECC and GPU-unavailable events on every GPU,
        each registered for the types it supports."""
        with self._guard("create NVML event set"):
            try:
                event_set = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError_NotSupported:
                return None
            except pynvml.NVMLError_Unknown as err:
                log.warning("NVML could not create an event set (%s): %s", err, _WITHOUT_EVENTS)
                return None
            for index in range(int(pynvml.nvmlDeviceGetCount())):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    self._known[index] = str(pynvml.nvmlDeviceGetUUID(handle))
                    wanted = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
                    wanted &= _FAULT_EVENT_TYPES
                    if wanted:
                        pynvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
                except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission):
                    continue  # such a GPU still reports loss through failing calls
                except pynvml.NVMLError_GpuIsLost:
                    continue  # already gone: it stays out of list_gpus, the others still work
                except pynvml.NVMLError_Unknown as err:
                    # nvml.h: "event set is in undefined state and should be freed"
                    log.warning(
                        "NVML could not register fault events on GPU %d (%s), so the event set is freed: %s",
                        index,
                        err,
                        _WITHOUT_EVENTS,
                    )
                    with suppress(pynvml.NVMLError):
                        pynvml.nvmlEventSetFree(event_set)
                    return None
            return event_set

    def fault_events(self) -> list[FaultEvent]:
        """Events since the last call: NVML's event set, drained without waiting, and losses."""
        with self._lock:
            while self._event_set is not None:
                try:
                    data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
                except pynvml.NVMLError_Timeout:
                    break  # drained
                except pynvml.NVMLError_GpuIsLost:
                    self._find_lost()
                    break
                except pynvml.NVMLError as err:
                    raise GpuBackendError(f"read NVML events: {err}") from err
                try:
                    self._events.extend(self._events_from(data))
                except GpuBackendError:
                    # No device to name it by (if lost, _find_lost has queued that instead).
                    log.warning("dropped an NVML event", exc_info=True)
            events, self._events = self._events, []
            return events

    def _events_from(self, data: Any) -> list[FaultEvent]:
        """The fault events one NVML event means (a lost GPU is reported once)."""
        with self._guard("read NVML event"):
            gpu_uuid = str(pynvml.nvmlDeviceGetUUID(data.device))
        gi_id = int(data.gpuInstanceId)
        # An error tied to one MIG instance names that device, so only its sandbox is hit.
        uuid = self._mig_by_gi.get((gpu_uuid, gi_id), gpu_uuid) if gi_id != _NO_INSTANCE else gpu_uuid
        t_ms = int(time.time() * 1000)
        kind = int(data.eventType)
        if kind == pynvml.nvmlEventTypeXidCriticalError:
            xid = int(data.eventData)
            event = xid_event(uuid, xid, t_ms)
            # The XID first, then the loss it means: it says why the GPU went.
            return [event, *self._mark_lost(gpu_uuid)] if xid == XID_FELL_OFF_BUS else [event]
        if _GPU_UNAVAILABLE and kind == _GPU_UNAVAILABLE:
            return self._mark_lost(gpu_uuid)
        return [FaultEvent(uuid, "ecc_dbe", "double-bit ECC error", t_ms)]

    def _find_lost(self) -> None:
        """The event set only says *a* GPU is lost: ask each known one."""
        for uuid in list(self._known.values()):
            with suppress(GpuBackendError), self._guard("probe", uuid):
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)

    def _note_lost(self, uuid: str) -> None:
        with self._lock:
            self._events.extend(self._mark_lost(uuid))

    def _mark_lost(self, uuid: str) -> list[FaultEvent]:
        """The one ``gpu_lost`` event for ``uuid``, or none when it was reported already."""
        with self._lock:
            if uuid in self._lost:
                return []
            self._lost.add(uuid)
            return [FaultEvent(uuid, "gpu_lost", "GPU is lost", int(time.time() * 1000))]

    @contextmanager
    def _guard(self, what: str, uuid: str | None = None) -> Iterator[None]:
        """Turn NVML errors into GpuBackendError, noting a lost GPU on the way.

        ``uuid`` is the device the calls address, None when that is not known yet.
        """
        where = uuid or "this host"
        try:
            yield
        except _LOST as err:
            if uuid is None:
                self._find_lost()
                raise GpuBackendError(f"{what}: a GPU on this host is lost") from err
            gpu = self._mig_parent.get(uuid, uuid)
            self._note_lost(gpu)
            raise GpuLost(f"{what}: {uuid} is lost ({err})", gpu) from err
        except pynvml.NVMLError as err:
            raise GpuBackendError(f"{what} on {where}: {err}") from err

    # -- compute mode (MPS enforcement: workers.gpu.mps) ---------------------------------------

    def compute_mode(self, uuid: str) -> str:
        """``nvmlDeviceGetComputeMode`` of the device ``uuid`` names: the GPU, or for a MIG
        uuid the MIG device handle, whose mode is its own (nvml.h)."""
        with self._guard("read compute mode", uuid):
            value = int(pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid)))
        return _COMPUTE_MODE_NAMES.get(value, f"unknown ({value})")

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """``nvmlDeviceSetComputeMode`` (root; what ``nvidia-smi -c`` does). nvml.h: "If MIG is
        enabled on a GPU, device must be MIG device handle", so a MIG uuid is set on its own
        handle, never on its parent (which would refuse, or change every instance)."""
        if mode not in _COMPUTE_MODE_VALUES:
            raise GpuBackendError(f"no compute mode {mode!r}: one of {', '.join(_COMPUTE_MODE_VALUES)}")
        with self._guard(f"set compute mode {mode}", uuid):
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            pynvml.nvmlDeviceSetComputeMode(handle, _COMPUTE_MODE_VALUES[mode])

    # -- load (nothing to do: real GPUs measure it) -----------------------------------------

    def note_load(self, owner: str, device_uuids: list[str], mem_mib: int, util_pct: float) -> None:
        """Real GPUs report their own load."""

    def forget_load(self, owner: str) -> None:
        """Real GPUs report their own load."""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._gpm.close()
            if self._event_set is not None:
                with suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(self._event_set)
            with suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()


def _create_compute_instance(gpu_instance: Any, profile: _GiProfile) -> None:
    """The one compute instance that spans the whole GPU instance (``-C`` of nvidia-smi)."""
    ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gpu_instance,
        _CI_PROFILE_FOR_SLICES[profile.slices],
        pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    )
    pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, ci_info.id)


def _possible_placements(handle: Any, profile: _GiProfile) -> tuple[tuple[int, ...], int]:
    """(legal starts, memory slices) of a profile as NVML lists them (MIG on or off)."""
    count = ctypes.c_uint(0)
    # NVML fills as many as the profile allows; a GPU has at most 8 memory slices to start at.
    found = (pynvml.c_nvmlGpuInstancePlacement_t * max(8, profile.instance_count))()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile.id, found, ctypes.byref(count))
    placements = [found[i] for i in range(count.value)]
    if not placements:
        raise GpuBackendError(f"NVML lists no placement for MIG profile {profile.name}")
    return tuple(int(p.start) for p in placements), int(placements[0].size)


def _gpu_instances(parent: Any, profile: _GiProfile) -> list[Any]:
    """The GPU instances of one profile on a GPU (root only)."""
    count = ctypes.c_uint(0)
    found = (pynvml.c_nvmlGpuInstance_t * max(8, profile.instance_count))()  # instanceCount is the most
    pynvml.nvmlDeviceGetGpuInstances(parent, profile.id, found, ctypes.byref(count))
    return [found[i] for i in range(count.value)]


def _compute_instances(parent: Any) -> dict[int, list[tuple[int, str]]]:
    """GPU instance id -> [(compute instance id, MIG uuid)], from the MIG device handles
    (each compute instance is one MIG device; no privilege needed)."""
    found: dict[int, list[tuple[int, str]]] = {}
    for index in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(parent))):
        try:
            handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
        except pynvml.NVMLError_NotFound:
            continue  # an empty MIG device slot
        gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(handle))
        ci_id = int(pynvml.nvmlDeviceGetComputeInstanceId(handle))
        found.setdefault(gi_id, []).append((ci_id, str(pynvml.nvmlDeviceGetUUID(handle))))
    return {gi: sorted(cis) for gi, cis in found.items()}


def _mig_device(parent_uuid: str, profile: _GiProfile, info: Any, cis: list[tuple[int, str]]) -> MigDevice:
    gi_id = int(info.id)
    ci_id, uuid = cis[0] if len(cis) == 1 else (cis[0][0] if cis else -1, f"{parent_uuid}/gi{gi_id}")
    return MigDevice(
        uuid=uuid,
        parent_uuid=parent_uuid,
        profile=profile.name,
        start=int(info.placement.start),
        memory_slices=int(info.placement.size),
        memory_mib=profile.memory_mib,
        gpu_instance_id=gi_id,
        compute_instance_id=ci_id,
        compute_instances=len(cis),
    )


def _mig_enabled(handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return False  # not a MIG-capable GPU
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def _clock_reasons(handle: Any) -> int:
    """Current clock event reasons; the older "throttle" call for drivers before R535."""
    current = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if current is not None:
        with suppress(pynvml.NVMLError_FunctionNotFound):
            return int(current(handle))
    return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _ecc_counts(handle: Any) -> tuple[int, int]:
    """Volatile (since driver load) corrected and uncorrected ECC errors of the board."""
    corrected = pynvml.nvmlDeviceGetTotalEccErrors(
        handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
    )
    uncorrected = pynvml.nvmlDeviceGetTotalEccErrors(
        handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
    )
    return int(corrected), int(uncorrected)


def _memory_by_pid(handle: Any) -> tuple[dict[str, int], set[int]]:
    """GPU memory per process, keyed "pid:<pid>" (host pids: the agent maps them to sandboxes
    through their cgroups), and the pids of the device's MPS clients. On a MIG device handle
    NVML lists that instance's processes.

    MPS clients are listed by a call of their own (nvidia-smi's "M+C"); a pid in both lists
    counts once."""
    held = _held(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    clients: set[int] = set()
    with suppress(*_UNSUPPORTED):
        mps = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
        clients = {int(process.pid) for process in mps}
        for key, mib in _held(mps).items():
            held[key] = max(held.get(key, 0), mib)
    return held, clients


def _held(processes: list[Any]) -> dict[str, int]:
    held: dict[str, int] = {}
    for process in processes:
        if process.usedGpuMemory is None:
            continue  # not reported (e.g. without the rights to see other users' processes)
        key = f"pid:{process.pid}"
        held[key] = held.get(key, 0) + int(process.usedGpuMemory) // MIB
    return held


def _unless_unsupported(read: Callable[[], T], default: T) -> T:
    """A reading this GPU, driver or user cannot take is left at its default."""
    try:
        return read()
    except _UNSUPPORTED:
        return default
