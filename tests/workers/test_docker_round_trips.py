"""What the docker driver asks the engine for a launch and a stop (no engine: a recording
stand-in). In a burst the launches and the ended batches' stops of two agents queue at one
engine; each question less is one less wait (BENCHMARKS.md, "A burst of requests")."""

from __future__ import annotations

from typing import Any

import docker.errors
import pytest
import requests

from tests.workers.test_docker_driver import make_spec
from workers.drivers.docker import ALLOCATION_LABEL, DockerDriver


class Api:
    """The engine's low-level API, answering from ``containers``: id -> (name, state)."""

    api_version = "1.41"

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.containers: dict[str, tuple[str, str, dict[str, str]]] = {}

    def create_container(self, **kwargs: Any) -> dict[str, str]:
        self.asked.append("create")
        if any(name == kwargs["name"] for name, _, _ in self.containers.values()):
            raise docker.errors.APIError("conflict", response=answer(409))
        ref = f"c{len(self.containers)}"
        self.containers[ref] = (kwargs["name"], "created", kwargs["labels"])
        return {"Id": ref}

    def start(self, ref: str) -> None:
        self.asked.append("start")
        name, _, labels = self.containers[ref]
        self.containers[ref] = (name, "running", labels)

    def stop(self, ref: str, timeout: int) -> None:
        self.asked.append(f"stop {timeout}")
        if ref not in self.containers:
            raise docker.errors.NotFound("no such container")
        name, _, labels = self.containers[ref]
        self.containers[ref] = (name, "exited", labels)

    def logs(self, ref: str, **kwargs: Any) -> bytes:
        self.asked.append("logs")
        if ref not in self.containers:
            raise docker.errors.NotFound("no such container")
        return b"2026-11-29T16:00:00.000000001Z done\n"

    def remove_container(self, ref: str, force: bool) -> None:
        self.asked.append("remove")
        if self.containers.pop(ref, None) is None:
            raise docker.errors.NotFound("no such container")


def answer(code: int) -> requests.Response:
    response = requests.Response()
    response.status_code = code
    return response


class Containers:
    """The SDK's collection: only the engine's own (sparse) listing is allowed."""

    client: Any

    def __init__(self, api: Api) -> None:
        self.api = api

    def list(self, **kwargs: Any) -> list[docker.models.containers.Container]:
        assert kwargs.get("sparse") is True, "the full listing inspects each container it finds"
        self.api.asked.append("list")
        [wanted] = kwargs["filters"]["label"]
        return [
            docker.models.containers.Container(
                attrs={"Id": ref, "Labels": labels, "State": state}, client=self.client
            )
            for ref, (_, state, labels) in self.api.containers.items()
            if f"{ALLOCATION_LABEL}={labels[ALLOCATION_LABEL]}" == wanted
        ]

    def prepare_model(self, attrs: dict[str, Any]) -> docker.models.containers.Container:
        return docker.models.containers.Container(attrs=attrs, client=self.client)

    def get(self, ref: str) -> Any:
        raise AssertionError("an inspection: the driver knows what it needs without one")


class Client:
    def __init__(self) -> None:
        self.api = Api()
        self.containers = Containers(self.api)
        self.containers.client = self


@pytest.fixture
def client() -> Client:
    return Client()


def test_a_launch_lists_creates_and_starts_and_inspects_nothing(client: Client) -> None:
    spec = make_spec()
    handle = DockerDriver(client=client, host="h1").launch(spec)  # type: ignore[arg-type]
    assert client.api.asked == ["list", "create", "start"]
    assert (handle.allocation_key, handle.sandbox_id, handle.ref) == (spec.allocation_key, 42, "c0")
    assert client.api.containers["c0"][1] == "running"


def test_a_repeated_launch_returns_the_container_and_starts_one_left_created(client: Client) -> None:
    driver = DockerDriver(client=client, host="h1")  # type: ignore[arg-type]
    spec = make_spec()
    first = driver.launch(spec)
    assert driver.launch(spec) == first
    name, _, labels = client.api.containers[first.ref]
    client.api.containers[first.ref] = (name, "created", labels)  # died between create and start
    client.api.asked.clear()
    assert driver.launch(spec) == first
    assert client.api.asked == ["list", "start"] and client.api.containers[first.ref][1] == "running"


def test_a_stop_asks_no_state_first_and_is_idempotent(client: Client) -> None:
    driver = DockerDriver(client=client, host="h1")  # type: ignore[arg-type]
    handle = driver.launch(make_spec())
    client.api.asked.clear()
    driver.stop(handle, grace_s=3)
    assert client.api.asked == ["stop 3", "remove"] and not client.api.containers
    driver.stop(handle, grace_s=3)  # gone already
    assert client.api.asked == ["stop 3", "remove", "stop 3"]


def test_output_is_read_by_id_without_an_inspection(client: Client) -> None:
    driver = DockerDriver(client=client, host="h1")  # type: ignore[arg-type]
    handle = driver.launch(make_spec())
    client.api.asked.clear()
    chunk = driver.read_output(handle, 0, 1024)
    assert (chunk.start, chunk.data) == (0, b"done\n") and client.api.asked == ["logs"]
    driver.stop(handle, grace_s=0)
    assert driver.read_output(handle, 5, 1024).data == b""  # gone: nothing more, no error


def test_a_launch_meeting_a_concurrent_ones_unfinished_create_takes_its_container(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine lists a container whose create has not finished, and cannot start it yet
    (404): the launch that made it starts it; this one answers with the same container."""
    driver = DockerDriver(client=client, host="h1")  # type: ignore[arg-type]
    spec = make_spec()
    labels = spec.labels()
    client.api.containers["c0"] = (f"gpushare-{spec.allocation_key}", "created", labels)

    def not_yet(ref: str) -> None:
        raise docker.errors.NotFound("no such container")

    monkeypatch.setattr(client.api, "start", not_yet)
    named = docker.models.containers.Container(attrs={"Id": "c0", "Config": {"Labels": labels}})
    monkeypatch.setattr(client.containers, "get", lambda name: named)
    assert driver.launch(spec).ref == "c0"
