"""An agent whose real GPUs its driver cannot hand out refuses to start (review 3, #3 (b)).

Its self-test launches a CPU-only sandbox, which passes on a Docker host without the NVIDIA
Container Toolkit; every GPU launch placed there would then fail. The GPUs are the fake
NVML's; the driver is the Docker driver over injected facts (nothing installed, a CDI spec).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import workers.agent
from wire import signing
from workers.agent import EXIT_CANNOT_LAUNCH, _self_test, refuse_gpus_the_driver_cannot_hand_out
from workers.drivers import DriverUnavailable
from workers.drivers.docker import DockerDriver
from workers.drivers.docker_gpus import GpuPaths
from workers.gpu.nvml import NvmlBackend
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host import selftest

CDI_SPEC = "kind: nvidia.com/gpu\ndevices:\n- name: GPU-11111111-1111-1111-1111-111111111111\n"


def docker_on(tmp_path: Path, *, cdi_spec: str | None = None) -> DockerDriver:
    """A Docker driver on a host without the toolkit's hook or its config, with Docker's CDI
    on and ``cdi_spec`` in its spec directory (none: an empty one)."""
    cdi = tmp_path / "cdi"
    cdi.mkdir(exist_ok=True)
    if cdi_spec is not None:
        (cdi / "nvidia.yaml").write_text(cdi_spec)
    paths = GpuPaths(
        lambda: {"CDISpecDirs": [str(cdi)]}, toolkit_config=tmp_path / "none.toml", hook=lambda: None
    )
    return DockerDriver(client=None, host="h", storage_dir=tmp_path, apps_dir=tmp_path, gpu_paths=paths)


def test_real_gpus_and_docker_without_any_gpu_path_refuse_naming_what_to_install(
    tmp_path: Path, backend: NvmlBackend
) -> None:
    with pytest.raises(DriverUnavailable) as refused:
        refuse_gpus_the_driver_cannot_hand_out(backend, docker_on(tmp_path))
    assert "GPUs cannot be given to sandboxes" in refused.value.reason
    assert "nvidia-container-runtime-hook is not installed" in refused.value.reason
    assert "nvidia-container-toolkit" in refused.value.remedy
    assert "nvidia-ctk cdi generate" in refused.value.remedy


def test_a_cdi_spec_naming_the_gpus_is_a_path(tmp_path: Path, backend: NvmlBackend) -> None:
    refuse_gpus_the_driver_cannot_hand_out(backend, docker_on(tmp_path, cdi_spec=CDI_SPEC))


def test_simulated_hosts_are_unaffected(tmp_path: Path) -> None:
    simulated = SimulatedBackend("h", parse_sim_spec("H100-80GB:2"))
    refuse_gpus_the_driver_cannot_hand_out(simulated, docker_on(tmp_path))


def test_the_agent_exits_78_at_start_instead_of_passing_a_cpu_only_self_test(
    tmp_path: Path, backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What systemd sees: exit 78 (RestartPreventExitStatus, no restart loop), the journal
    saying what is missing and how to fix it; no sandbox was launched."""
    monkeypatch.setenv("GPUSHARE_HOST", "gpu-host")
    monkeypatch.setenv("SANDBOX_DRIVER", "docker")
    monkeypatch.setenv("GPU_BACKEND", "nvml")
    monkeypatch.setenv("GPUSHARE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.delenv("GPUSHARE_HOSTS_FILE", raising=False)
    monkeypatch.setenv(
        "GPUSHARE_CONTROL_PUBLIC_KEY", signing.public_text(signing.private_key(signing.new_private_key()))
    )
    monkeypatch.setattr(signing, "_verifier", None)  # load_keys installs the agent's
    monkeypatch.setattr(workers.agent, "_agent", None)
    monkeypatch.setattr(workers.agent, "make_backend", lambda *_: backend)
    monkeypatch.setattr(workers.agent, "make_driver", lambda *_: docker_on(tmp_path))

    def no_launch(*_: Any) -> Any:
        raise AssertionError("the CPU-only self-test must not decide this host")

    monkeypatch.setattr(selftest, "try_driver", no_launch)
    with caplog.at_level(logging.ERROR, logger="workers.agent"), pytest.raises(SystemExit) as exited:
        _self_test()
    assert exited.value.code == EXIT_CANNOT_LAUNCH
    assert "nvidia-container-toolkit" in caplog.text and "to fix:" in caplog.text
    assert workers.agent._agent is None
