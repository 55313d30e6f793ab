"""Fixtures of the NVML backend tests: the fake pynvml (tests/workers/nvml_fake.py) and a
backend on it. A module that defines a fixture of the same name uses its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.workers.nvml_fake import FakeNvml
from workers.gpu.nvml import NvmlBackend


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    return nvml


@pytest.fixture
def backend(fake: FakeNvml) -> Iterator[NvmlBackend]:
    instance = NvmlBackend()
    yield instance
    instance.close()
