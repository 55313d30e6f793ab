"""The CUDA-ready Python image (images/cuda-python, scripts/build-python-image.sh): built
locally from PyPI, it runs as a sandbox does (the Docker driver's confinement: its owner's
uid, a read-only root, no network) and compiles a kernel written in Python to PTX with NVVM.
Where a GPU is visible it also runs it: ``gpushare-cuda-check`` says which it did."""

# ruff: noqa: F811 - the Docker driver's fixtures, imported from its tests, are parameters here

from __future__ import annotations

import subprocess
import time

import docker
import pytest

from tests.workers.engines import require_engine
from tests.workers.test_docker_driver import REPO, client, driver, host, make_spec  # noqa: F401 - fixtures, see above
from workers.drivers.docker import DockerDriver

pytestmark = [pytest.mark.docker, pytest.mark.slow]
IMAGE = "gpushare/cuda-python:1"


@pytest.fixture(scope="module")
def built(client: docker.DockerClient) -> str:
    made = subprocess.run(
        [REPO / "scripts" / "build-python-image.sh", "cuda-python"],
        capture_output=True,
        text=True,
        check=False,
    )
    require_engine(made.returncode == 0, f"the CUDA Python image ({made.stderr[-800:]})")
    return IMAGE


def test_a_sandbox_of_the_cuda_image_compiles_a_python_kernel_to_ptx(
    driver: DockerDriver, host: str, built: str
) -> None:
    spec = make_spec(host, image=built, command=("gpushare-cuda-check",), device_uuids=(), batch=True)
    handle = driver.launch(spec)
    deadline = time.monotonic() + 120
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        time.sleep(0.5)
    status = driver.status(handle)
    output = driver.read_output(handle, 0, 1 << 20).data.decode()
    driver.stop(handle, grace_s=0)
    assert status.state == "exited" and status.exit_code == 0, output
    assert "compiled vadd for sm_90:" in output and "bytes of PTX" in output
    assert "no CUDA device visible here: compile only" in output  # a CPU-only sandbox sees none


@pytest.mark.django_db
def test_the_demo_lists_the_image_once_it_is_built_here(built: str) -> None:
    from django.core.management import call_command

    from portal.catalog.models import SandboxImage

    call_command("seed_demo", verbosity=0)
    listed = SandboxImage.objects.get(name="CUDA Python")
    assert listed.reference == built and listed.active and not listed.app
