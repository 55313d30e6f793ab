"""The whole loop with real processes: Celery control worker and host agent, Docker,
the Redis channel layer, the usage ledger and the billing API. The Docker loop is one
platform for its steps (a class marked ``steps``): a failure names the step."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client

from portal.accounts.models import ApiToken
from portal.asgi import application
from portal.billing.models import UsageRecord, cost_micros
from portal.sandboxes.models import Sandbox
from tests.e2e.platform import Platform, running_platform, wait_for
from tests.workers.engines import require_engine
from wire import uids

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow]


def state_of(pk: int) -> str:
    return Sandbox.objects.values_list("state", flat=True).get(pk=pk)


def ask(client: Client, data: dict[str, str]) -> int:
    response = client.post("/sandboxes/new/", data)
    assert response.status_code == 302, response.content.decode()[-2000:]
    return int(response["Location"].rstrip("/").split("/")[-1])


def receive_samples(session: str, sandbox_id: int, count: int) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        comm = WebsocketCommunicator(
            application,
            f"/ws/sandboxes/{sandbox_id}/",
            headers=[
                (b"host", b"localhost"),
                (b"origin", b"http://localhost"),
                (b"cookie", f"sessionid={session}".encode()),
            ],
        )
        connected, _ = await comm.connect()
        assert connected
        # The socket also pushes the sandbox's state changes: one sent as it started running
        # can reach a socket opened a moment later. Only the GPU samples are counted.
        samples: list[dict[str, Any]] = []
        for _ in range(count + 10):
            message = json.loads(await comm.receive_from(timeout=10))
            if "gpu" in message:
                samples.append(message)
            if len(samples) == count:
                break
        await comm.disconnect()
        return samples

    return asyncio.run(run())


@pytest.fixture(scope="class")
def platform(world: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    with running_platform(tmp_path_factory.mktemp("loop")) as platform:
        yield platform


@pytest.fixture(scope="class")
def web(world: dict[str, Any]) -> Client:
    web = Client()
    web.force_login(world["owner"])
    return web


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestRequestPlaceLaunchStreamStopBill:
    def test_01_a_dedicated_and_a_mig_request_are_accepted(
        self, world: dict[str, Any], platform: Platform, web: Client, state: dict[str, Any]
    ) -> None:
        common = {
            "project": str(world["project"].pk),
            "image": str(world["image"].pk),
            "isolation": "container",
            "duration_hours": "1",
        }
        state["dedicated"] = ask(web, {**common, "tier": str(world["dedicated"].pk), "gpu_count": "1"})
        state["mig"] = ask(web, {**common, "tier": str(world["mig"].pk), "mig_profile": "1g.10gb"})

    def test_02_both_reach_running(self, state: dict[str, Any]) -> None:
        dedicated, mig = state["dedicated"], state["mig"]
        wait_for(lambda: state_of(dedicated) == "running", 60, "the dedicated sandbox to run", every=0.05)
        state["running_seen"] = time.time()
        wait_for(lambda: state_of(mig) == "running", 60, "the MIG sandbox to run")

    def test_03_the_dedicated_one_went_through_every_state_to_a_gpu_of_the_host(
        self, platform: Platform, state: dict[str, Any]
    ) -> None:
        sandbox = Sandbox.objects.get(pk=state["dedicated"])
        [alloc] = sandbox.allocations.all()
        assert alloc.gpu.host.name == platform.host and alloc.device_uuid.startswith("GPU-")
        assert list(sandbox.events.values_list("to_state", flat=True)) == [
            "requested",
            "queued",
            "placing",
            "starting",
            "running",
        ]

    def test_04_its_container_has_our_labels_and_the_tiers_limits(
        self, world: dict[str, Any], platform: Platform, docker_client: Any, state: dict[str, Any]
    ) -> None:
        dedicated = state["dedicated"]
        sandbox = Sandbox.objects.get(pk=dedicated)
        alloc = sandbox.allocations.get()
        [container] = docker_client.containers.list(
            filters={"label": f"io.gpushare.allocation={sandbox.allocation_key}"}
        )
        attrs = container.attrs
        labels, host_config = attrs["Config"]["Labels"], attrs["HostConfig"]
        assert labels["io.gpushare.sandbox"] == str(dedicated)
        assert labels["io.gpushare.host"] == platform.host
        assert labels["io.gpushare.devices"] == alloc.device_uuid
        tier = world["dedicated"]
        assert host_config["Memory"] == tier.memory_limit_mib * 1024 * 1024
        assert host_config["NanoCpus"] == int(tier.cpu_limit * 1e9)
        assert host_config["PidsLimit"] == tier.pids_limit
        assert host_config["CapDrop"] == ["ALL"] and host_config["ReadonlyRootfs"] is True
        assert "no-new-privileges" in host_config["SecurityOpt"]
        assert host_config["NetworkMode"] == "none"
        assert f"NVIDIA_VISIBLE_DEVICES={alloc.device_uuid}" in attrs["Config"]["Env"]
        owner = Sandbox.objects.get(pk=dedicated).owner_id
        uid = uids.owner_uid(owner)  # its owner's, from the range no host account uses
        assert attrs["Config"]["User"] == f"{uid}:{uid}"

    def test_05_the_mig_one_runs_on_a_mig_instance(self, docker_client: Any, state: dict[str, Any]) -> None:
        mig = Sandbox.objects.get(pk=state["mig"])
        mig_alloc = mig.allocations.get()
        [mig_container] = docker_client.containers.list(
            filters={"label": f"io.gpushare.allocation={mig.allocation_key}"}
        )
        assert mig_alloc.device_uuid.startswith("MIG-")
        assert mig_container.attrs["Config"]["Labels"]["io.gpushare.devices"] == mig_alloc.device_uuid

    def test_06_live_samples_of_its_gpu_arrive_over_the_websocket(
        self, web: Client, state: dict[str, Any]
    ) -> None:
        """Through the real channel layer."""
        dedicated = state["dedicated"]
        device = Sandbox.objects.get(pk=dedicated).allocations.get().device_uuid
        samples = receive_samples(web.cookies["sessionid"].value, dedicated, 3)
        assert len(samples) == 3 and {s["gpu"] for s in samples} == {device}
        assert samples[-1]["t"] > samples[0]["t"] and all(s["simulated"] for s in samples)
        assert samples[-1]["sandboxes"][str(dedicated)]["mem_mib"] > 0

    def test_07_stopping_it_removes_its_container(
        self, web: Client, docker_client: Any, state: dict[str, Any]
    ) -> None:
        dedicated = state["dedicated"]
        time.sleep(1.5)  # let it run a little longer, so the duration is not trivially small
        assert web.post(f"/sandboxes/{dedicated}/stop/").status_code == 302
        wait_for(lambda: state_of(dedicated) == "stopped", 60, "the sandbox to stop", every=0.05)
        state["stopped_seen"] = time.time()
        sandbox = Sandbox.objects.get(pk=dedicated)
        assert (
            docker_client.containers.list(
                all=True, filters={"label": f"io.gpushare.allocation={sandbox.allocation_key}"}
            )
            == []
        )
        assert list(sandbox.events.values_list("to_state", flat=True))[-2:] == ["stopping", "stopped"]

    def test_08_the_mig_one_stops_too(self, web: Client, state: dict[str, Any]) -> None:
        mig = state["mig"]
        web.post(f"/sandboxes/{mig}/stop/")
        wait_for(lambda: state_of(mig) == "stopped", 60, "the MIG sandbox to stop")

    def test_09_its_usage_record_bills_the_time_it_ran(
        self, world: dict[str, Any], state: dict[str, Any]
    ) -> None:
        [usage] = UsageRecord.objects.filter(sandbox_id=state["dedicated"])
        assert usage.duration is not None and usage.cost_micros is not None
        wall = state["stopped_seen"] - state["running_seen"]
        assert abs(usage.duration.total_seconds() - wall) <= 1.0, (usage.duration, wall)
        duration_us = usage.duration // timedelta(microseconds=1)
        tier = world["dedicated"]
        assert usage.cost_micros == cost_micros(tier.price_per_gpu_hour_micros, 1000, duration_us)
        expected = tier.price_per_gpu_hour_micros * usage.duration.total_seconds() / 3600
        assert abs(usage.cost_micros - expected) <= 1

    def test_10_a_billing_client_with_a_token_reads_it_from_the_api(
        self, world: dict[str, Any], state: dict[str, Any]
    ) -> None:
        usage = UsageRecord.objects.get(sandbox_id=state["dedicated"])
        assert usage.duration is not None
        _, key = ApiToken.issue(world["owner"], "billing system", ["read:usage"])
        body = Client().get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}").json()
        record = next(r for r in body["results"] if r["sandbox"] == state["dedicated"])
        assert record["cost_micros"] == usage.cost_micros and record["currency"] == "EUR"
        assert record["duration_seconds"] == usage.duration.total_seconds()

    def test_11_the_agent_did_all_of_it_within_its_own_redis_user(self, platform: Platform) -> None:
        """Issue 38: the agent ran as its host's Redis user, and Redis refused it nothing."""
        if not platform.enrolled:
            pytest.skip("the test Redis has no ACL selectors (Redis 6): the agent used the suite's URL")
        assert platform.acl_denials() == []


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (the driver's handle is the wrapper around bubblewrap)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


@pytest.mark.bwrap
@pytest.mark.django_db(transaction=True)  # the platform's processes read what the test commits
def test_loop_with_the_process_driver(people: Any, catalog: Any, tmp_path: Path) -> None:
    """Without Docker the agent confines sandboxes with bubblewrap: same loop, same ledger."""
    from workers.drivers.process import bwrap_available

    require_engine(bwrap_available(), "bubblewrap")
    owner, project = people["owner"], people["project"]
    with running_platform(tmp_path, driver="process"):
        web = Client()
        web.force_login(owner)
        sandbox_id = ask(
            web,
            {
                "project": str(project.pk),
                "image": str(catalog["image"].pk),
                "isolation": "process",
                "duration_hours": "1",
                "tier": str(catalog["mig"].pk),
                "mig_profile": "1g.10gb",
            },
        )
        wait_for(lambda: state_of(sandbox_id) == "running", 60, "the process sandbox to run")
        sandbox = Sandbox.objects.get(pk=sandbox_id)
        assert sandbox.handle is not None and sandbox.handle["driver"] == "process"
        pid = int(sandbox.handle["ref"])
        device = sandbox.allocations.get().device_uuid
        environs = [Path(f"/proc/{p}/environ").read_bytes().split(b"\0") for p in descendants(pid)]
        assert any(f"NVIDIA_VISIBLE_DEVICES={device}".encode() in env for env in environs)
        samples = receive_samples(web.cookies["sessionid"].value, sandbox_id, 3)
        assert {s["gpu"] for s in samples} == {device}
        web.post(f"/sandboxes/{sandbox_id}/stop/")
        wait_for(lambda: state_of(sandbox_id) == "stopped", 60, "the process sandbox to stop")
        assert (
            not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
        )
    [usage] = UsageRecord.objects.filter(sandbox_id=sandbox_id)
    assert usage.cost_micros is not None and usage.milli_gpu == 142


@pytest.mark.bwrap
@pytest.mark.django_db(transaction=True)  # the platform's processes read what the test commits
def test_a_batch_run_ends_with_its_exit_code(people: Any, catalog: Any, tmp_path: Path) -> None:
    """A batch sandbox runs the user's command and ends when it exits, saying how."""
    from workers.drivers.process import bwrap_available

    require_engine(bwrap_available(), "bubblewrap")
    with running_platform(tmp_path, driver="process"):
        web = Client()
        web.force_login(people["owner"])
        sandbox_id = ask(
            web,
            {
                "project": str(people["project"].pk),
                "image": str(catalog["image"].pk),
                "isolation": "process",
                "duration_hours": "1",
                "tier": str(catalog["dedicated"].pk),
                "gpu_count": "1",
                "run": "batch",
                "command": "sh -c 'echo trained; exit 3'",
            },
        )
        wait_for(lambda: state_of(sandbox_id) == "stopped", 60, "the batch run to end")
    sandbox = Sandbox.objects.get(pk=sandbox_id)
    assert sandbox.batch and sandbox.command == ["sh", "-c", "echo trained; exit 3"]
    assert sandbox.events.filter(to_state="stopped", message="exited with code 3").exists()
    [usage] = UsageRecord.objects.filter(sandbox_id=sandbox_id)
    assert usage.ended_at is not None
