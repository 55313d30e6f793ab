"""Fixtures for the e2e tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import make_catalog, make_people
from tests.workers.engines import require_engine

IMAGE = "gpushare/sandbox-base:1"


# A scenario's shared fixtures (its steps are one class: tests/conftest.py's `steps`).
@pytest.fixture(scope="class")
def world(scenario_db: None) -> dict[str, Any]:
    """The people and catalog a scenario's platform serves, committed for the class."""
    return {**make_people(), **make_catalog()}


@pytest.fixture(scope="class")
def state() -> dict[str, Any]:
    """What a step found that a later one uses."""
    return {}


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
