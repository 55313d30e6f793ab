"""What NvmlBackend reads of a board's fitness for work, against the pynvml fake: the NVLink
fabric registration Fabric Manager makes on Hopper + NVSwitch (issue 36, review 3 new #4),
and the row-remapping and page-retirement state a board keeps across driver loads (new #9).

The fake's H100 is an HGX board Fabric Manager has registered (COMPLETED, SUCCESS); its A100
answers NOT_SUPPORTED to the fabric call (no fabric to wait for). Both remap rows, with
nothing remapped; neither retires pages (Ampere and later remap rows instead).
"""

from __future__ import annotations

import pynvml
import pytest

from tests.workers.nvml_fake import A100_UUID, H100_UUID, FakeNvml
from workers.gpu.base import GpuLost, MemoryRepairs
from workers.gpu.nvml import NvmlBackend

IN_PROGRESS = pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
COMPLETED = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED


def not_ready(backend: NvmlBackend) -> dict[str, str]:
    return {g.uuid: g.not_ready for g in backend.list_gpus()}


# -- fabric ----------------------------------------------------------------------------------


def test_a_registered_hgx_gpu_and_a_gpu_without_fabric_are_both_offered(fake: FakeNvml) -> None:
    backend = NvmlBackend()
    assert not_ready(backend) == {H100_UUID: "", A100_UUID: ""}
    # the versioned call, on each whole GPU
    assert {args[0].uuid for args in fake.called("nvmlDeviceGetGpuFabricInfoV")} == {H100_UUID, A100_UUID}


def test_a_gpu_fabric_manager_is_still_registering_is_not_ready_with_the_reason(fake: FakeNvml) -> None:
    fake.h100.fabric = (IN_PROGRESS, pynvml.NVML_ERROR_UNKNOWN)  # status means nothing yet
    backend = NvmlBackend()
    reason = not_ready(backend)[H100_UUID]
    assert reason.startswith(
        "NVLink fabric not ready: Fabric Manager has not registered this GPU (state in progress)"
    )
    assert "802" in reason and "nvidia-fabricmanager" in reason
    assert not_ready(backend)[A100_UUID] == ""
    assert backend.fabric_problem(H100_UUID) == reason


def test_a_gpu_not_started_in_the_fabric_is_not_ready(fake: FakeNvml) -> None:
    fake.h100.fabric = (pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, pynvml.NVML_SUCCESS)
    assert "(state not started)" in NvmlBackend().fabric_problem(H100_UUID)


def test_a_completed_registration_that_failed_is_not_ready_with_nvmls_error(fake: FakeNvml) -> None:
    fake.h100.fabric = (COMPLETED, pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    reason = NvmlBackend().fabric_problem(H100_UUID)
    assert reason.startswith("NVLink fabric not ready: Fabric Manager failed to register this GPU")
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)) in reason


def test_the_fabric_state_is_read_again_when_asked_so_a_gpu_comes_back_once_registered(
    fake: FakeNvml,
) -> None:
    fake.h100.fabric = (IN_PROGRESS, pynvml.NVML_SUCCESS)
    backend = NvmlBackend()
    assert backend.fabric_problem(H100_UUID)
    fake.h100.fabric = (COMPLETED, pynvml.NVML_SUCCESS)
    assert backend.fabric_problem(H100_UUID) == ""
    assert not_ready(backend)[H100_UUID] == ""


def test_a_driver_without_the_versioned_call_is_asked_the_older_one(fake: FakeNvml) -> None:
    fake.h100.fabric = (IN_PROGRESS, pynvml.NVML_SUCCESS)
    backend = NvmlBackend()
    fake.fail["nvmlDeviceGetGpuFabricInfoV"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert "(state in progress)" in backend.fabric_problem(H100_UUID)
    assert len(fake.called("nvmlDeviceGetGpuFabricInfo")) == 1


def test_a_driver_with_neither_call_has_no_fabric_to_wait_for(fake: FakeNvml) -> None:
    fake.h100.fabric = (IN_PROGRESS, pynvml.NVML_SUCCESS)
    backend = NvmlBackend()
    fake.fail["nvmlDeviceGetGpuFabricInfoV"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    fake.fail["nvmlDeviceGetGpuFabricInfo"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert backend.fabric_problem(H100_UUID) == ""


def test_an_unreadable_fabric_state_keeps_the_gpu_out_and_does_not_break_the_inventory(
    fake: FakeNvml,
) -> None:
    fake.fail["nvmlDeviceGetGpuFabricInfoV"] = pynvml.NVML_ERROR_UNKNOWN
    reason = not_ready(NvmlBackend())[H100_UUID]
    assert reason.startswith("NVLink fabric state unreadable (Unknown Error)")


def test_the_state_byte_is_read_without_the_padding_pynvml_reads_with_it(fake: FakeNvml) -> None:
    # nvml.h: nvmlGpuFabricState_t is an unsigned char; pynvml's c_uint spans its padding
    fake.h100.fabric = (0x7F000000 | COMPLETED, pynvml.NVML_SUCCESS)
    assert NvmlBackend().fabric_problem(H100_UUID) == ""


def test_a_mig_device_is_judged_by_its_board(fake: FakeNvml) -> None:
    fake.a100.fabric = (IN_PROGRESS, pynvml.NVML_SUCCESS)
    backend = NvmlBackend()
    mig = backend.list_gpus()[1].mig_devices[0].uuid
    assert "(state in progress)" in backend.fabric_problem(mig)


# -- memory repairs --------------------------------------------------------------------------


def test_a_clean_board_reports_no_memory_fault(fake: FakeNvml) -> None:
    repairs = NvmlBackend().memory_repairs(H100_UUID)
    assert repairs == MemoryRepairs(remapped_uncorrectable=0, remapped_correctable=0)
    assert repairs.faults() == []


def test_a_failed_row_remap_says_the_gpu_needs_replacement(fake: FakeNvml) -> None:
    fake.h100.remapped_rows = (2, 7, 0, 1)  # corrected, uncorrected, pending, failure
    repairs = NvmlBackend().memory_repairs(H100_UUID)
    assert (repairs.remapped_correctable, repairs.remapped_uncorrectable, repairs.remap_failed) == (
        2,
        7,
        True,
    )
    [(kind, detail)] = repairs.faults()
    assert kind == "remap_failed"
    assert "needs replacement (RMA)" in detail and "7 rows remapped for uncorrectable errors" in detail


def test_a_pending_row_remap_asks_for_a_reset(fake: FakeNvml) -> None:
    fake.a100.remapped_rows = (0, 1, 1, 0)
    [(kind, detail)] = NvmlBackend().memory_repairs(A100_UUID).faults()
    assert kind == "remap_pending" and detail.startswith("reset the GPU when idle")


def test_a_board_that_retires_pages_reports_pages_pending_retirement(fake: FakeNvml) -> None:
    # a board before Ampere: no row remapping, dynamic page retirement instead
    fake.a100.remapped_rows = None
    fake.a100.retired_pages = {pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x1000, 0x2000]}
    fake.a100.retirement_pending = True
    repairs = NvmlBackend().memory_repairs(A100_UUID)
    assert repairs.remapped_uncorrectable is None and repairs.retired_pages_dbe == 2
    [(kind, detail)] = repairs.faults()
    assert kind == "retirement_pending" and "2 pages retired for double-bit ECC errors" in detail


def test_retired_pages_without_one_pending_are_no_fault(fake: FakeNvml) -> None:
    fake.a100.remapped_rows = None
    fake.a100.retired_pages = {pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x1000]}
    assert NvmlBackend().memory_repairs(A100_UUID).faults() == []


def test_memory_repairs_of_a_mig_device_are_its_boards(fake: FakeNvml) -> None:
    fake.a100.remapped_rows = (0, 0, 0, 1)
    backend = NvmlBackend()
    mig = backend.list_gpus()[1].mig_devices[0].uuid
    assert backend.memory_repairs(mig).remap_failed


def test_memory_repairs_of_a_lost_gpu_raise_gpu_lost(fake: FakeNvml) -> None:
    backend = NvmlBackend()
    fake.lost.add(H100_UUID)
    with pytest.raises(GpuLost):
        backend.memory_repairs(H100_UUID)
