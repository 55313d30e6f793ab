"""Fixtures for the e2e tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.engines import require_engine

IMAGE = "gpushare/sandbox-base:1"


@pytest.fixture
def docker_client() -> Any:
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    import docker

    client = docker.from_env()
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        require_engine(False, f"the image {IMAGE} (scripts/build-sandbox-image.sh)")
    return client
