"""Images from a registry an admin approved, pulled by the Docker driver when its host lacks
them (``DockerDriver.prepare``), with the progress the sandbox's page shows: against a real
registry (Debian's docker-registry, on loopback) and a real engine. Docker trusts a plain-HTTP
registry on 127.0.0.0/8 without being told."""

# ruff: noqa: F811 - the Docker driver's fixtures, imported from its tests, are parameters here

from __future__ import annotations

import contextlib
import io
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import docker
import docker.errors
import pytest

from tests.workers.engines import require_engine
from tests.workers.test_docker_driver import IMAGE, client, driver, host, make_spec  # noqa: F401 - fixtures, see above
from workers.drivers.base import DriverError
from workers.drivers.docker import DockerDriver
from workers.drivers.image_pull import PullProgress

pytestmark = pytest.mark.docker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry on loopback; its address, host:port."""
    binary = shutil.which("docker-registry")
    require_engine(binary is not None, "docker-registry (apt-get install docker-registry)")
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # type: ignore[list-item]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail(f"the registry did not listen: {proc.stderr.read() if proc.stderr else ''}")  # type: ignore[str-bytes-safe]
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def published(client: docker.DockerClient, registry: str) -> Iterator[str]:
    """An image of its own in the registry, absent here: the sandbox image and a layer no
    other image has (3 MB of random bytes), so that a pull downloads something."""
    reference = f"{registry}/lab/base:{uuid.uuid4().hex[:8]}"
    recipe = f"FROM {IMAGE}\nRUN head -c 3000000 /dev/urandom > /opt/blob\n".encode()
    client.images.build(fileobj=io.BytesIO(recipe), tag=reference, network_mode="none", rm=True)
    for event in client.api.push(reference, stream=True, decode=True):
        assert "error" not in event, event
    client.images.remove(reference)
    yield reference
    with contextlib.suppress(docker.errors.ImageNotFound):
        client.images.remove(reference, force=True)


def test_an_approved_image_is_pulled_with_progress_then_runs(
    driver: DockerDriver,
    client: docker.DockerClient,
    host: str,
    published: str,
) -> None:
    lines: list[str] = []
    spec = make_spec(host, image=published, pull=True, device_uuids=(), command=("sleep", "30"))
    driver.prepare(spec, lines.append)
    assert client.images.get(published)
    assert re.fullmatch(
        rf"pulling {re.escape(published)}: (\d+) of \1 layers, .* MiB of .* MiB", lines[-1]
    ), lines
    handle = driver.launch(spec)
    assert driver.status(handle).state == "running"
    driver.stop(handle, grace_s=0)


def test_an_image_not_approved_is_never_pulled(
    driver: DockerDriver,
    client: docker.DockerClient,
    host: str,
    published: str,
) -> None:
    lines: list[str] = []
    spec = make_spec(host, image=published, pull=False, device_uuids=())
    driver.prepare(spec, lines.append)
    assert lines == []
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(published)
    with pytest.raises(DriverError, match="is not on this host"):
        driver.launch(spec)


def test_a_missing_image_in_an_approved_registry_is_a_clear_failure(
    driver: DockerDriver,
    host: str,
    registry: str,
) -> None:
    spec = make_spec(host, image=f"{registry}/lab/nothing:1", pull=True, device_uuids=())
    with pytest.raises(
        DriverError, match=r"pull 127\.0\.0\.1:\d+/lab/nothing:1 for sandbox .*(not found|unknown)"
    ):
        driver.prepare(spec, lambda line: None)


def test_pull_progress_sums_the_layers() -> None:
    progress = PullProgress("r.example/a:1")
    events: list[dict[str, Any]] = [
        {"status": "Pulling from a", "id": "1"},
        {"status": "Pulling fs layer", "id": "l1"},
        {"status": "Pulling fs layer", "id": "l2"},
        {"status": "Downloading", "id": "l1", "progressDetail": {"current": 500_000, "total": 2_000_000}},
        {"status": "Downloading", "id": "l2", "progressDetail": {"current": 0, "total": 3_000_000}},
    ]
    for event in events:
        progress.update(event)
    assert progress.line() == "pulling r.example/a:1: 0 of 2 layers, 488 KiB of 4.8 MiB"
    progress.update({"status": "Pull complete", "id": "l1"})
    assert progress.line() == "pulling r.example/a:1: 1 of 2 layers, 1.9 MiB of 4.8 MiB"
    with pytest.raises(DriverError, match=r"pull of r\.example/a:1 failed: toomanyrequests"):
        progress.update({"error": "toomanyrequests", "errorDetail": {}})
