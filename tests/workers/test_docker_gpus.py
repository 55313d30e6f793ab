"""How the Docker driver asks for GPUs on the host it finds (review 3, #3 and §4).

The facts are injected (a temporary CDI spec directory, a temporary toolkit config.toml, a
hook found or not, what ``docker info`` says); the real engine here, which has no NVIDIA
pieces at all, is the "nothing" case.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.workers.engines import require_engine
from tests.workers.test_docker_driver import make_spec
from workers.drivers.base import DriverError
from workers.drivers.docker import DockerDriver, container_kwargs, docker_available
from workers.drivers.docker_gpus import GpuPaths, HostGpuFacts, toolkit_settings

HOOK_PATH = "/usr/bin/nvidia-container-runtime-hook"
GPU, MIG, NEW_MIG = "GPU-aaaa", "MIG-bbbb", "MIG-made-after-the-spec"
# What `nvidia-ctk cdi generate` writes (abridged): each device by index and by UUID.
NVIDIA_YAML = f"""---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits: {{deviceNodes: [{{path: /dev/nvidia0}}]}}
- name: {GPU}
  containerEdits: {{deviceNodes: [{{path: /dev/nvidia0}}]}}
- name: "1:0"
  containerEdits: {{deviceNodes: [{{path: /dev/nvidia1}}]}}
- name: {MIG}
  containerEdits: {{deviceNodes: [{{path: /dev/nvidia1}}]}}
- name: all
  containerEdits: {{deviceNodes: [{{path: /dev/nvidia0}}, {{path: /dev/nvidia1}}]}}
containerEdits:
  deviceNodes: [{{path: /dev/nvidiactl}}]
"""


def paths(
    tmp_path: Path,
    *,
    spec: str | None = NVIDIA_YAML,
    cdi_on: bool = True,
    mode: str | None = None,
    hook: bool = False,
    info: dict[str, Any] | None = None,
    config_extra: str = "",
) -> GpuPaths:
    """GpuPaths over injected facts: a CDI dir (with ``spec`` as nvidia.yaml), a config.toml
    (with ``mode``, absent when None), the hook found or not, ``docker info``."""
    cdi = tmp_path / "cdi"
    cdi.mkdir(parents=True, exist_ok=True)
    if spec is not None:
        (cdi / "nvidia.yaml").write_text(spec)
    config = tmp_path / "config.toml"
    if mode is not None or config_extra:
        body = f'[nvidia-container-runtime]\nmode = "{mode or "auto"}"\n{config_extra}'
        config.write_text(f"disable-require = false\n\n{body}")
    engine = {"CDISpecDirs": [str(cdi)] if cdi_on else None, "DefaultRuntime": "runc", **(info or {})}
    return GpuPaths(lambda: engine, toolkit_config=config, hook=lambda: HOOK_PATH if hook else None)


def test_devices_the_cdi_spec_names_by_uuid_are_asked_for_by_cdi_name(tmp_path: Path) -> None:
    facts = paths(tmp_path).facts()
    request = facts.device_request([GPU, MIG])
    assert request["Driver"] == "cdi"
    assert request["DeviceIDs"] == [f"nvidia.com/gpu={GPU}", f"nvidia.com/gpu={MIG}"]
    assert not request.get("Capabilities")
    assert facts.problem() is None and facts.cdi_gpus == [GPU, MIG]
    # In the create arguments, in place of the legacy request.
    spec = make_spec(device_uuids=(GPU, MIG), real_gpu=True)
    assert container_kwargs(spec, gpu_request=request)["device_requests"] == [request]


def test_a_json_spec_and_other_kinds_are_read_as_docker_reads_them(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    as_json = {"kind": "nvidia.com/gpu", "devices": [{"name": GPU, "containerEdits": {}}]}
    (cdi / "nvidia.json").write_text(json.dumps(as_json))
    (cdi / "mofed.yaml").write_text("kind: nvidia.com/mofed\ndevices: [{name: GPU-zzzz}]\n")
    (cdi / "broken.yaml").write_text("kind: [unclosed\n")
    facts = paths(tmp_path, spec=None).facts()
    assert facts.cdi_devices == {GPU: f"nvidia.com/gpu={GPU}"}


@pytest.mark.parametrize("mode", [None, "auto", "legacy"])
def test_the_hook_in_legacy_or_auto_mode_gets_the_legacy_request(tmp_path: Path, mode: str | None) -> None:
    """No CDI in Docker (an engine before 25, or CDI off), the toolkit's hook on PATH."""
    facts = paths(tmp_path, cdi_on=False, mode=mode, hook=True).facts()
    request = facts.device_request([GPU])
    assert request["DeviceIDs"] == [GPU] and request["Capabilities"] == [["gpu"]] and not request["Driver"]
    assert facts.problem() is None


def test_a_device_the_spec_does_not_name_yet_falls_back_to_the_hook_where_it_runs(tmp_path: Path) -> None:
    """A MIG instance made after the spec was generated: the whole request goes the legacy
    way (one request, one way)."""
    request = paths(tmp_path, hook=True).facts().device_request([GPU, NEW_MIG])
    assert request["DeviceIDs"] == [GPU, NEW_MIG] and request["Capabilities"] == [["gpu"]]


def test_cdi_mode_without_a_spec_for_the_device_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """mode = "cdi": the hook would refuse Docker's --gpus request at every start."""
    facts = paths(tmp_path, mode="cdi", hook=True).facts()
    with pytest.raises(DriverError, match=rf"does not name {NEW_MIG}.*nvidia-ctk cdi generate"):
        facts.device_request([NEW_MIG])
    assert facts.device_request([MIG])["Driver"] == "cdi"  # what the spec names still works


def test_cdi_mode_with_cdi_off_in_docker_is_a_host_that_cannot_hand_out_gpus(tmp_path: Path) -> None:
    facts = paths(tmp_path, cdi_on=False, mode="cdi", hook=True).facts()
    problem = facts.problem()
    assert problem is not None
    reason, remedy = problem
    assert "mode is 'cdi'" in reason and "refuses" in reason
    assert "nvidia-ctk cdi generate" in remedy and "--cdi.enabled" in remedy and 'mode = "auto"' in remedy
    with pytest.raises(DriverError, match="mode is 'cdi'"):
        facts.device_request([GPU])


def test_cdi_mode_works_with_the_hook_when_told_to_skip_mode_detection_or_nvidia_is_the_runtime(
    tmp_path: Path,
) -> None:
    skip = "\n[nvidia-container-runtime-hook]\nskip-mode-detection = true\n"
    assert paths(tmp_path, cdi_on=False, mode="cdi", hook=True, config_extra=skip).facts().legacy_works
    runtime = paths(
        tmp_path / "r", cdi_on=False, mode="jit-cdi", hook=True, info={"DefaultRuntime": "nvidia"}
    )
    assert runtime.facts().legacy_works


def test_nothing_at_all_names_the_toolkit_and_cdi_generation(tmp_path: Path) -> None:
    facts = paths(tmp_path, spec=None, cdi_on=False).facts()
    problem = facts.problem()
    assert problem is not None
    reason, remedy = problem
    assert "nvidia-container-runtime-hook is not installed" in reason
    assert "nvidia-container-toolkit" in remedy and "nvidia-ctk cdi generate" in remedy
    with pytest.raises(DriverError, match="no way to hand out NVIDIA GPUs"):
        facts.device_request([GPU])


def test_an_unreadable_toolkit_config_reads_as_its_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("mode = = broken")
    assert toolkit_settings(tmp_path / "config.toml") == ("auto", False)
    assert toolkit_settings(tmp_path / "absent.toml") == ("auto", False)


@pytest.mark.docker
def test_this_hosts_engine_is_the_nothing_case_and_a_gpu_launch_makes_no_container(tmp_path: Path) -> None:
    """The real engine here: no toolkit, no CDI spec. A GPU launch is refused before any
    container is made, saying what to install; the agent refuses to start on it."""
    require_engine(docker_available(), "Docker engine")
    if shutil.which("nvidia-container-runtime-hook") or Path("/etc/cdi").exists():
        pytest.skip("this host has NVIDIA container pieces")
    client = docker.from_env()
    try:
        host = f"test-gpus-{tmp_path.name[-8:]}"
        driver = DockerDriver(client, host=host, storage_dir=tmp_path / "s", apps_dir=tmp_path / "a")
        problem = driver.gpu_path_problem()
        assert problem is not None and "nvidia-container-toolkit" in problem[1]
        with pytest.raises(DriverError, match="no way to hand out NVIDIA GPUs"):
            driver.launch(make_spec(host, real_gpu=True, device_uuids=(GPU,)))
        assert driver.list_owned() == []
    finally:
        client.close()


def test_an_engine_that_cannot_be_asked_is_left_to_the_self_test() -> None:
    def down() -> dict[str, Any]:
        raise docker.errors.DockerException("connection refused")

    driver = DockerDriver(client=None, host="h", gpu_paths=GpuPaths(down))
    assert driver.gpu_path_problem() is None


def test_facts_describe_what_was_found(tmp_path: Path) -> None:
    facts: HostGpuFacts = paths(tmp_path, mode="legacy", hook=True).facts()
    assert facts.describe() == (
        f"CDI on ({tmp_path / 'cdi'}; 2 nvidia.com/gpu device(s) by UUID); "
        f"nvidia-container-runtime-hook at {HOOK_PATH}; toolkit mode 'legacy'"
    )
