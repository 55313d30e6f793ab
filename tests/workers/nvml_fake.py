"""A fake of exactly the pynvml functions NvmlBackend calls, holding plausible GPUs.

Two GPUs: an H100 80GB HBM3 with MIG disabled and an A100-80GB in MIG mode with a
2g.20gb@0 and a 3g.40gb@4 instance. ``install`` replaces every other ``pynvml.nvml*``
function by a trap, so a call the fake does not model fails the test instead of reaching a
real driver. Used by test_nvml_backend.py; kept apart so neither file grows past a read.

What it models as NVML does: no utilization for MIG devices nor for a GPU in MIG mode
(NOT_SUPPORTED); GPM on the H100 only (the A100 has none); MPS clients in a list of their
own; IN_USE when an instance with processes is destroyed; GPU instances without a compute
instance, or with several; a lost GPU (``lost``) failing every call with GPU_IS_LOST.
"""

from __future__ import annotations

import ctypes
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

MIB = 1024 * 1024
NO_INSTANCE = 0xFFFFFFFF
H100_UUID = "GPU-11111111-1111-1111-1111-111111111111"
A100_UUID = "GPU-22222222-2222-2222-2222-222222222222"

# What an A100-80GB answers for each GPU instance profile enum: (id, name, slices, size).
A100_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, "MIG 1g.10gb", 1, 1, 9728),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, "MIG 2g.20gb", 2, 2, 19968),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, "MIG 3g.40gb", 3, 4, 40192),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, "MIG 4g.40gb", 4, 4, 40192),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, "MIG 7g.80gb", 7, 8, 80896),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, "MIG 1g.10gb+me", 1, 1, 9728),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, "MIG 1g.20gb", 1, 2, 19968),
}
# The same for an H100 80GB HBM3: same profile ids, a little more memory per slice
# (nvidia-smi mig -lgip: 9.75, 19.62, 39.50, 79.25 GiB).
H100_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, "MIG 1g.10gb", 1, 1, 9984),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, "MIG 2g.20gb", 2, 2, 20096),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, "MIG 3g.40gb", 3, 4, 40448),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, "MIG 4g.40gb", 4, 4, 40448),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, "MIG 7g.80gb", 7, 8, 81152),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, "MIG 1g.10gb+me", 1, 1, 9984),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, "MIG 1g.20gb", 1, 2, 20096),
}
Profiles = dict[int, tuple[int, str, int, int, int]]


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml turns the code into its NVMLError_* subclass


@dataclass(eq=False)
class Dev:
    uuid: str
    name: str = ""
    memory_mib: int = 0
    used_mib: int = 0
    mig_mode: int | None = pynvml.NVML_DEVICE_MIG_DISABLE  # None: MIG not supported
    temp: int = 41
    util: int = 55
    power_mw: int = 312_500
    sm_clock: int = 1755
    reasons: int = 0
    events_supported: int = 0
    procs: list[SimpleNamespace] = field(default_factory=list)
    mps_procs: list[SimpleNamespace] = field(default_factory=list)  # MPS clients ("M+C")
    # Per-process utilization samples NVML holds for the device (pid, timeStamp µs, smUtil, ...):
    # only processes busy in a sample period have one (FakeNvml.record_process_util).
    proc_util: list[SimpleNamespace] = field(default_factory=list)
    gpm: bool = False  # GPM (Hopper+): utilization of MIG instances through GPM samples
    parent: Dev | None = None  # set on MIG device handles
    gi_id: int = 0
    ci_id: int = 0
    # Volatile ECC counts by pynvml.NVML_MEMORY_ERROR_TYPE_*; None: ECC not supported.
    ecc: dict[int, int] | None = None
    profiles: Profiles = field(default_factory=lambda: A100_PROFILES)
    # -- NVLink fabric and memory repairs (issue 36) ---------------------------------------
    # (state, status) nvmlDeviceGetGpuFabricInfoV fills in: NVML_GPU_FABRIC_STATE_*, and an
    # nvmlReturn_t once COMPLETED. None: the call answers NOT_SUPPORTED (no NVSwitch fabric).
    fabric: tuple[int, int] | None = None
    # nvmlDeviceGetRemappedRows: (corrected, uncorrected, isPending, failureOccurred); None:
    # NOT_SUPPORTED (a board before Ampere, which retires pages instead)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    # Page retirement (before Ampere): retired page addresses by NVML_PAGE_RETIREMENT_CAUSE_*,
    # and whether pages wait for the next reset. None: NOT_SUPPORTED (Ampere and later).
    retired_pages: dict[int, list[int]] | None = None
    retirement_pending: bool = False
    # -- compute mode (issue 36 item 1, MPS enforced): each GPU's and each MIG device's own --
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    compute_mode_refused: int | None = None  # the NVML error Set raises (NO_PERMISSION: not root)
    compute_mode_sticks: bool = True  # False: Set answers SUCCESS and the mode stays as it was
    # -- topology (issue 40 item 7): the NUMA node of its nearest CPUs; None: NOT_SUPPORTED --
    numa_node: int | None = None

    def profile(self, profile_id: int) -> tuple[int, str, int, int, int]:
        return next(p for p in self.profiles.values() if p[0] == profile_id)


@dataclass(eq=False)
class ComputeInstance:
    id: int
    mig: Dev


@dataclass(eq=False)
class GpuInstance:
    parent: Dev
    id: int
    profile_id: int
    start: int
    size: int
    cis: dict[int, ComputeInstance] = field(default_factory=dict)


class FakeNvml:
    FUNCTIONS = frozenset(
        {
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetHandleByUUID",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetName",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetMigMode",
            "nvmlDeviceGetMaxMigDeviceCount",
            "nvmlDeviceGetMigDeviceHandleByIndex",
            "nvmlDeviceGetGpuInstanceId",
            "nvmlDeviceGetComputeInstanceId",
            "nvmlDeviceGetGpuInstanceById",
            "nvmlGpuInstanceGetInfo",
            "nvmlDeviceGetGpuInstanceProfileInfo",
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            "nvmlGpuInstanceCreateComputeInstance",
            "nvmlGpuInstanceDestroy",
            "nvmlGpuInstanceGetComputeInstanceById",
            "nvmlComputeInstanceDestroy",
            "nvmlEventSetCreate",
            "nvmlDeviceGetSupportedEventTypes",
            "nvmlDeviceRegisterEvents",
            "nvmlEventSetWait_v2",
            "nvmlEventSetFree",
            "nvmlDeviceGetGpuInstances",
            "nvmlDeviceGetGpuInstancePossiblePlacements",
            "nvmlDeviceGetMPSComputeRunningProcesses",
            # per-process utilization (issue 36)
            "nvmlDeviceGetProcessUtilization",
            "nvmlDeviceGetProcessesUtilizationInfo",
            "nvmlGpmQueryDeviceSupport",
            "nvmlGpmSampleAlloc",
            "nvmlGpmSampleGet",
            "nvmlGpmMigSampleGet",
            "nvmlGpmMetricsGet",
            "nvmlGpmSampleFree",
        }
    )
    # compute modes (issue 36 item 1): per GPU and per MIG device handle
    FUNCTIONS = FUNCTIONS | frozenset({"nvmlDeviceGetComputeMode", "nvmlDeviceSetComputeMode"})

    def __init__(self) -> None:
        self.initialised = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, int] = {}  # function name -> NVML error code, raised once
        self.lost: set[str] = set()
        self.pending: list[SimpleNamespace] = []
        self.wait_lost = False
        self.registered: dict[str, int] = {}
        self.freed = False
        # GPM samples: address of the handle -> utilization recorded (None: not yet taken)
        self.gpm_samples: dict[int, int | None] = {}
        self._gpm_keep: list[Any] = []
        self._gi_handles: dict[int, GpuInstance] = {}  # ctypes handle address -> instance
        self._gi_keep: list[Any] = []
        self.made_cis = 0
        # Topology (issue 40 item 7; presets in nvml_boards.py): pairs of GPU uuids linked by
        # NVLink, and each pair's closest PCIe ancestor (NVML_TOPOLOGY_*); a pair absent from
        # ``ancestors`` answers NOT_SUPPORTED, as a VM's passed-through GPUs do.
        self.nvlink: set[frozenset[str]] = set()
        self.ancestors: dict[frozenset[str], int] = {}
        xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
        self.h100 = Dev(
            H100_UUID,
            "NVIDIA H100 80GB HBM3",
            81559,
            used_mib=4_600,
            reasons=pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap,
            events_supported=xid | dbe | pynvml.nvmlEventTypeSingleBitEccError,
            ecc={pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: 0, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: 0},
            profiles=H100_PROFILES,
            gpm=True,
            procs=[
                SimpleNamespace(pid=101, usedGpuMemory=3_000 * MIB),
                SimpleNamespace(pid=101, usedGpuMemory=100 * MIB),
                SimpleNamespace(pid=202, usedGpuMemory=1_000 * MIB),
                SimpleNamespace(pid=303, usedGpuMemory=None),
            ],
        )
        self.a100 = Dev(
            A100_UUID,
            "NVIDIA A100-SXM4-80GB",
            81920,
            mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE,
            temp=63,
            power_mw=287_000,
            sm_clock=1410,
            events_supported=xid,
        )
        self.gpus = [self.h100, self.a100]
        self.instances: dict[tuple[str, int], GpuInstance] = {}
        self._make_instance(self.a100, 14, start=0, gi_id=3)
        self._make_instance(self.a100, 9, start=4, gi_id=2)
        self.mig(2).procs = [SimpleNamespace(pid=404, usedGpuMemory=2_048 * MIB)]
        self.mig(2).used_mib = 2_100
        # NVLink fabric (issue 36): the H100 as on an HGX board Fabric Manager has registered;
        # the A100 answers NOT_SUPPORTED (the fabric call is Hopper's).
        self.h100.fabric = (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS)

    # -- helpers for tests -------------------------------------------------------------------

    def mig(self, gi_id: int, gpu: str = A100_UUID) -> Dev:
        return self.instances[(gpu, gi_id)].cis[0].mig

    def called(self, name: str) -> list[tuple[Any, ...]]:
        return [args for called, args in self.calls if called == name]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, value in vars(pynvml).items():
            if name.startswith("nvml") and isinstance(value, types.FunctionType):
                if name in self.FUNCTIONS:
                    monkeypatch.setattr(pynvml, name, self._recorded(name, getattr(self, name)))
                elif name != "nvmlErrorString":  # NVMLError.__str__ uses it
                    monkeypatch.setattr(pynvml, name, self._trap(name))

    def _recorded(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            code = self.fail.pop(name, None)
            if code is not None:
                raise nvml_error(code)
            return method(*args)

        return call

    @staticmethod
    def _trap(name: str) -> Callable[..., Any]:
        def trap(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"NvmlBackend called pynvml.{name}, which the fake lacks")

        return trap

    def _live(self, dev: Dev) -> Dev:
        board = dev.parent or dev
        if board.uuid in self.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return dev

    @staticmethod
    def _board_only(dev: Dev) -> Dev:
        if dev.parent is not None:  # NVML answers these for whole GPUs only
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def _migs(self, parent: Dev) -> list[Dev]:
        instances = sorted(
            (gi for (uuid, _), gi in self.instances.items() if uuid == parent.uuid),
            key=lambda gi: gi.id,
        )
        return [ci.mig for gi in instances for ci in gi.cis.values()]

    def _make_instance(
        self, parent: Dev, profile_id: int, start: int, gi_id: int, cis: int = 1
    ) -> GpuInstance:
        """A GPU instance with ``cis`` compute instances (0: as `nvidia-smi mig -cgi` leaves it)."""
        gi = GpuInstance(parent, gi_id, profile_id, start, parent.profile(profile_id)[3])
        self.instances[(parent.uuid, gi_id)] = gi
        for ci_id in range(cis):
            self._add_compute_instance(gi, ci_id)
        return gi

    def _add_compute_instance(self, gi: GpuInstance, ci_id: int = 0, suffix: str = "") -> ComputeInstance:
        mig = Dev(
            f"MIG-{gi.parent.uuid[4:12]}-gi{gi.id}" + (f"-ci{ci_id}" if ci_id else "") + suffix,
            memory_mib=gi.parent.profile(gi.profile_id)[4],
            used_mib=13,
            mig_mode=None,
            parent=gi.parent,
            gi_id=gi.id,
            ci_id=ci_id,
        )
        ci = ComputeInstance(ci_id, mig)
        gi.cis[ci_id] = ci
        return ci

    def _gi(self, handle: Any) -> GpuInstance:
        """A GPU instance the backend holds: ours, or a ctypes handle nvmlDeviceGetGpuInstances
        filled in."""
        if isinstance(handle, GpuInstance):
            return handle
        return self._gi_handles[ctypes.addressof(handle.contents)]

    # -- the pynvml surface ------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Dev:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Dev:
        for dev in self.gpus + [m for g in self.gpus for m in self._migs(g)]:
            if dev.uuid == uuid:
                return dev
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, dev: Dev) -> str:
        return self._live(dev).uuid

    def nvmlDeviceGetName(self, dev: Dev) -> str:
        return self._live(dev).name

    def nvmlDeviceGetMemoryInfo(self, dev: Dev) -> SimpleNamespace:
        self._live(dev)
        total, used = dev.memory_mib * MIB, dev.used_mib * MIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetMigMode(self, dev: Dev) -> list[int]:
        mode = self._live(dev).mig_mode
        if mode is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, dev: Dev) -> int:
        return 7 if self._live(dev).mig_mode is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, dev: Dev, index: int) -> Dev:
        migs = self._migs(self._live(dev))
        if index >= len(migs):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return migs[index]

    def nvmlDeviceGetGpuInstanceId(self, mig: Dev) -> int:
        return self._live(mig).gi_id

    def nvmlDeviceGetComputeInstanceId(self, mig: Dev) -> int:
        return self._live(mig).ci_id

    def nvmlDeviceGetGpuInstanceById(self, dev: Dev, gi_id: int) -> GpuInstance:
        try:
            return self.instances[(self._live(dev).uuid, gi_id)]
        except KeyError:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND) from None

    def nvmlGpuInstanceGetInfo(self, handle: Any) -> SimpleNamespace:
        gi = self._gi(handle)
        placement = SimpleNamespace(start=gi.start, size=gi.size)
        return SimpleNamespace(device=gi.parent, id=gi.id, profileId=gi.profile_id, placement=placement)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, dev: Dev, enum: int) -> SimpleNamespace:
        self._live(dev)
        if enum > pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if enum not in dev.profiles:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        profile_id, name, slices, _size, memory = dev.profiles[enum]
        return SimpleNamespace(
            id=profile_id, name=name, sliceCount=slices, memorySizeMB=memory, instanceCount=7 // slices
        )

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, dev: Dev, profile_id: int, found: Any, count_ref: Any
    ) -> int:
        """nvidia-smi mig -lgipp: the same starts on every 8-slice GPU, by profile size."""
        size = self._live(dev).profile(profile_id)[3]
        slices = dev.profile(profile_id)[2]
        starts = {
            1: range(7),
            2: (0, 2, 4, 6) if slices == 1 else (0, 2, 4),
            4: (0, 4) if slices == 3 else (0,),
        }
        for i, start in enumerate(starts.get(size, (0,))):
            found[i] = pynvml.c_nvmlGpuInstancePlacement_t(start=start, size=size)
            count_ref._obj.value = i + 1
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstances(self, dev: Dev, profile_id: int, found: Any, count_ref: Any) -> int:
        self._live(dev)
        ours = sorted(
            (
                gi
                for (uuid, _), gi in self.instances.items()
                if uuid == dev.uuid and gi.profile_id == profile_id
            ),
            key=lambda gi: gi.id,
        )
        if len(ours) > len(found):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, gi in enumerate(ours):
            handle = pynvml.c_nvmlGpuInstance_t(pynvml.struct_c_nvmlGpuInstance_t())
            self._gi_keep.append(handle)
            self._gi_handles[ctypes.addressof(handle.contents)] = gi
            found[i] = handle
        count_ref._obj.value = len(ours)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig: Dev) -> Dev:
        assert mig.parent is not None
        return mig.parent

    def nvmlDeviceGetTemperature(self, dev: Dev, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._board_only(self._live(dev)).temp

    def nvmlDeviceGetUtilizationRates(self, dev: Dev) -> SimpleNamespace:
        self._board_only(self._live(dev))
        if dev.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=dev.util, memory=20)

    def nvmlDeviceGetPowerUsage(self, dev: Dev) -> int:
        return self._board_only(self._live(dev)).power_mw

    def nvmlDeviceGetClockInfo(self, dev: Dev, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._board_only(self._live(dev)).sm_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, dev: Dev) -> int:
        return self._board_only(self._live(dev)).reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, dev: Dev) -> int:
        return self._board_only(self._live(dev)).reasons

    def nvmlDeviceGetComputeRunningProcesses(self, dev: Dev) -> list[SimpleNamespace]:
        return self._live(dev).procs

    def nvmlDeviceGetMPSComputeRunningProcesses(self, dev: Dev) -> list[SimpleNamespace]:
        return self._live(dev).mps_procs

    # -- per-process utilization (issue 36) ---------------------------------------------------
    # As nvml.h says: one sample per process busy in a sample period, each with its CPU
    # timestamp; a read returns those newer than lastSeenTimeStamp, NOT_FOUND when there is
    # none; NOT_SUPPORTED on MIG devices and on GPUs in MIG mode.

    processes_util_info = True  # the driver has nvmlDeviceGetProcessesUtilizationInfo (R550+)

    def record_process_util(self, dev: Dev, sm_by_pid: dict[int, int]) -> int:
        """One sample period on ``dev``: each pid's SM %; idle ones (0) get no sample, as NVML
        lists only processes with non-zero utilization. Returns the period's timestamp."""
        every = [
            s.timeStamp
            for d in self.gpus + [m for g in self.gpus for m in self._migs(g)]
            for s in d.proc_util
        ]
        stamp = max(every, default=1_700_000_000_000_000) + 1_000_000
        for pid, sm in sm_by_pid.items():
            if sm:
                dev.proc_util.append(
                    SimpleNamespace(pid=pid, timeStamp=stamp, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
                )
        return stamp

    def _process_util(self, dev: Dev, last_seen: int) -> list[SimpleNamespace]:
        self._live(dev)
        if dev.parent is not None or dev.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        found = [s for s in dev.proc_util if s.timeStamp > last_seen]
        if not found:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return found

    def nvmlDeviceGetProcessUtilization(self, dev: Dev, last_seen: int) -> list[SimpleNamespace]:
        return self._process_util(dev, last_seen)

    def nvmlDeviceGetProcessesUtilizationInfo(self, dev: Dev, last_seen: int) -> list[SimpleNamespace]:
        if not self.processes_util_info:
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._process_util(dev, last_seen)

    # GPM: a sample records the utilization of its device when taken; two samples give the
    # second one's (the fake's "activity since the first").

    def nvmlGpmQueryDeviceSupport(self, dev: Dev) -> SimpleNamespace:
        return SimpleNamespace(version=1, isSupportedDevice=int(self._live(dev).gpm))

    def nvmlGpmSampleAlloc(self) -> Any:
        sample = pynvml.c_nvmlGpmSample_t(pynvml.struct_c_nvmlGpmSample_t())
        self._gpm_keep.append(sample)
        self.gpm_samples[ctypes.addressof(sample.contents)] = None
        return sample

    def nvmlGpmSampleGet(self, dev: Dev, sample: Any) -> Any:
        self._gpm_take(self._board_only(self._live(dev)), sample)
        return sample

    def nvmlGpmMigSampleGet(self, dev: Dev, gi_id: int, sample: Any) -> Any:
        gi = self.instances.get((self._board_only(self._live(dev)).uuid, gi_id))
        if gi is None or not gi.cis:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        self._gpm_take(gi.cis[min(gi.cis)].mig, sample)
        return sample

    def _gpm_take(self, dev: Dev, sample: Any) -> None:
        if not (dev.parent or dev).gpm:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.gpm_samples[ctypes.addressof(sample.contents)] = dev.util

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        assert request.version == pynvml.NVML_GPM_METRICS_GET_VERSION and request.numMetrics == 1
        first = self.gpm_samples[ctypes.addressof(request.sample1.contents)]
        second = self.gpm_samples[ctypes.addressof(request.sample2.contents)]
        assert first is not None and second is not None, "a GPM sample used before it was taken"
        metric = request.metrics[0]
        assert metric.metricId == pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
        metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, float(second)
        return request

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        del self.gpm_samples[ctypes.addressof(sample.contents)]

    def nvmlDeviceGetTotalEccErrors(self, dev: Dev, error_type: int, counter_type: int) -> int:
        assert counter_type == pynvml.NVML_VOLATILE_ECC
        ecc = self._board_only(self._live(dev)).ecc
        if ecc is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return ecc[error_type]

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, dev: Dev, profile_id: int, placement_ref: Any
    ) -> GpuInstance:
        placement = placement_ref._obj  # ctypes.byref(c_nvmlGpuInstancePlacement_t)
        assert isinstance(placement, pynvml.c_nvmlGpuInstancePlacement_t)
        if dev.profile(profile_id)[3] != placement.size:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        wanted = set(range(placement.start, placement.start + placement.size))
        for (uuid, _), gi in self.instances.items():
            if uuid == dev.uuid and wanted & set(range(gi.start, gi.start + gi.size)):
                raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = max((i for (u, i) in self.instances if u == dev.uuid), default=0) + 1
        gi = GpuInstance(dev, gi_id, profile_id, placement.start, placement.size)
        self.instances[(dev.uuid, gi_id)] = gi
        return gi

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi: GpuInstance, profile: int, engine: int
    ) -> SimpleNamespace:
        assert engine == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        return SimpleNamespace(id=profile + 100)  # a distinct id, to see it passed on

    def nvmlGpuInstanceCreateComputeInstance(self, gi: GpuInstance, profile_id: int) -> ComputeInstance:
        # A made compute instance has a new MIG uuid, as on a real GPU.
        self.made_cis += 1
        return self._add_compute_instance(self._gi(gi), suffix=f"-new{self.made_cis}")

    def nvmlGpuInstanceDestroy(self, handle: Any) -> None:
        gi = self._gi(handle)
        if gi.cis:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        del self.instances[(gi.parent.uuid, gi.id)]

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: GpuInstance, ci_id: int) -> ComputeInstance:
        return self._gi(gi).cis[ci_id]

    def nvmlComputeInstanceDestroy(self, ci: ComputeInstance) -> None:
        if ci.mig.procs:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        assert ci.mig.parent is not None
        gi = self.instances[(ci.mig.parent.uuid, ci.mig.gi_id)]
        del gi.cis[ci.id]

    def nvmlEventSetCreate(self) -> str:
        self.freed = False
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, dev: Dev) -> int:
        return self._live(dev).events_supported

    def nvmlDeviceRegisterEvents(self, dev: Dev, types_: int, event_set: str) -> None:
        assert event_set == "event-set"
        self.registered[dev.uuid] = types_

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert (event_set, timeout_ms) == ("event-set", 0)
        if self.wait_lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if not self.pending:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        return self.pending.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed = True

    # -- NVLink fabric and memory repairs (issue 36) -----------------------------------------
    # NVML answers these for whole GPUs: a MIG device handle gets NOT_SUPPORTED (ask the parent).

    FUNCTIONS = FUNCTIONS | {
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlDeviceGetGpuFabricInfo",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPagesPendingStatus",
    }

    def nvmlDeviceGetGpuFabricInfoV(self, dev: Dev, info_ref: Any) -> int:
        info = info_ref._obj  # ctypes.byref(c_nvmlGpuFabricInfoV_t())
        assert isinstance(info, pynvml.c_nvmlGpuFabricInfo_v2_t)
        assert info.version == pynvml.nvmlGpuFabricInfo_v2
        return self._fill_fabric(dev, info)

    def nvmlDeviceGetGpuFabricInfo(self, dev: Dev, info_ref: Any) -> int:
        info = info_ref._obj  # the deprecated call's structure: no version field
        assert isinstance(info, pynvml.c_nvmlGpuFabricInfo_t)
        return self._fill_fabric(dev, info)

    def _fill_fabric(self, dev: Dev, info: Any) -> int:
        fabric = self._board_only(self._live(dev)).fabric
        if fabric is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info.state, info.status = fabric
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetRemappedRows(self, dev: Dev) -> tuple[int, int, int, int]:
        rows = self._board_only(self._live(dev)).remapped_rows
        if rows is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return rows

    def nvmlDeviceGetRetiredPages(self, dev: Dev, cause: int) -> list[int]:
        pages = self._board_only(self._live(dev)).retired_pages
        if pages is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return list(pages.get(cause, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, dev: Dev) -> int:
        board = self._board_only(self._live(dev))
        if board.retired_pages is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED if board.retirement_pending else pynvml.NVML_FEATURE_DISABLED

    # -- compute mode (issue 36 item 1) --------------------------------------------------------
    # A MIG device handle keeps its own mode, independent of its parent's and its siblings'.
    # nvml.h (nvmlDeviceSetComputeMode): "If MIG is enabled on a GPU, device must be MIG device
    # handle": the fake refuses the parent of a GPU in MIG mode, so a test sees which was used.

    def nvmlDeviceGetComputeMode(self, dev: Dev) -> int:
        return self._live(dev).compute_mode

    def nvmlDeviceSetComputeMode(self, dev: Dev, mode: int) -> None:
        self._live(dev)
        if dev.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if dev.compute_mode_refused is not None:
            raise nvml_error(dev.compute_mode_refused)
        if dev.compute_mode_sticks:
            dev.compute_mode = mode

    # -- topology (issue 40 item 7): whole GPUs only, as NVML answers them ------------------------

    FUNCTIONS = FUNCTIONS | {
        "nvmlDeviceGetCpuAffinityWithinScope",
        "nvmlDeviceGetP2PStatus",
        "nvmlDeviceGetTopologyCommonAncestor",
    }

    def nvmlDeviceGetCpuAffinityWithinScope(self, dev: Dev, size: int, scope: int) -> Any:
        board = self._board_only(self._live(dev))
        if scope != pynvml.NVML_AFFINITY_SCOPE_NODE or board.numa_node is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        words = (ctypes.c_ulonglong * size)()  # a NUMA node mask, as pynvml returns it
        words[board.numa_node // 64] = 1 << (board.numa_node % 64)
        return words

    def nvmlDeviceGetP2PStatus(self, a: Dev, b: Dev, index: int) -> int:
        for dev in (a, b):
            self._board_only(self._live(dev))
        linked = frozenset({a.uuid, b.uuid}) in self.nvlink and index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        return pynvml.NVML_P2P_STATUS_OK if linked else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Dev, b: Dev) -> int:
        for dev in (a, b):
            self._board_only(self._live(dev))
        level = self.ancestors.get(frozenset({a.uuid, b.uuid}))
        if level is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return level


def event(dev: Dev, kind: int, data: int = 0, gi: int = NO_INSTANCE) -> SimpleNamespace:
    return SimpleNamespace(device=dev, eventType=kind, eventData=data, gpuInstanceId=gi, computeInstanceId=gi)


# -- issue 36, the MPS fault domain: an application XID on a device ----------------------------


def app_xid(fake: FakeNvml, dev: Dev, xid: int = 31) -> None:
    """Queue the event NVML gives for a tenant kernel's fault (13, 31, 43, ...) on ``dev``: a
    whole GPU, or a MIG device (then its GPU and GPU instance are named, as NVML does). Under
    MPS, the fault has ended every client of that device's server (tests/workers/
    mps_control_fake.py models the server's side)."""
    board = dev.parent or dev
    instance = dev.gi_id if dev.parent is not None else NO_INSTANCE
    fake.pending.append(event(board, pynvml.nvmlEventTypeXidCriticalError, xid, instance))
