"""The short NVML session every one-off NVML question goes through (workers/gpu/nvml_session.py).

pynvml's init and shutdown are replaced by counters; no GPU is needed.
"""

from __future__ import annotations

import pynvml
import pytest

from workers.gpu.nvml_session import NvmlDidNotStart, nvml_session


class Counted:
    """nvmlInit/nvmlShutdown that count, and fail on demand with an NVML error code."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = 0
        self.init_fails: int | None = None
        self.shutdown_fails: int | None = None
        monkeypatch.setattr(pynvml, "nvmlInit", self.init)
        monkeypatch.setattr(pynvml, "nvmlShutdown", self.shutdown)

    def init(self) -> None:
        if self.init_fails is not None:
            raise pynvml.NVMLError(self.init_fails)
        self.open += 1

    def shutdown(self) -> None:
        self.open -= 1
        if self.shutdown_fails is not None:
            raise pynvml.NVMLError(self.shutdown_fails)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Counted:
    return Counted(monkeypatch)


def test_the_session_shuts_down_after_an_answer_and_after_an_error(nvml: Counted) -> None:
    with nvml_session():
        assert nvml.open == 1
    with pytest.raises(pynvml.NVMLError), nvml_session():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
    assert nvml.open == 0


def test_a_failing_init_says_so_and_shuts_nothing_down(nvml: Counted) -> None:
    nvml.init_fails = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NvmlDidNotStart, match="NVML did not initialise: Driver Not Loaded"), nvml_session():
        pytest.fail("the block runs without NVML")
    assert nvml.open == 0


def test_a_failing_shutdown_hides_neither_the_answer_nor_the_error(nvml: Counted) -> None:
    nvml.shutdown_fails = pynvml.NVML_ERROR_UNINITIALIZED
    with nvml_session():
        answer = 42
    assert answer == 42
    with pytest.raises(pynvml.NVMLError, match="Not Found"), nvml_session():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
