"""The whole loop with real processes: Celery control worker and host agent, Docker,
the Redis channel layer, the usage ledger and the billing API."""

from __future__ import annotations

import asyncio
import json
import time
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
from tests.e2e.platform import running_platform, wait_for
from tests.workers.engines import require_engine
from workers.drivers import uids

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


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
        samples = [json.loads(await comm.receive_from(timeout=10)) for _ in range(count)]
        await comm.disconnect()
        return samples

    return asyncio.run(run())


def test_request_place_launch_stream_stop_bill(
    people: Any, catalog: Any, docker_client: Any, tmp_path: Path
) -> None:
    owner, project = people["owner"], people["project"]
    with running_platform(tmp_path) as platform:
        web = Client()
        web.force_login(owner)
        common = {
            "project": str(project.pk),
            "image": str(catalog["image"].pk),
            "isolation": "container",
            "duration_hours": "1",
        }
        dedicated = ask(web, {**common, "tier": str(catalog["dedicated"].pk), "gpu_count": "1"})
        mig = ask(web, {**common, "tier": str(catalog["mig"].pk), "mig_profile": "1g.10gb"})

        wait_for(lambda: state_of(dedicated) == "running", 60, "the dedicated sandbox to run", every=0.05)
        running_seen = time.time()
        wait_for(lambda: state_of(mig) == "running", 60, "the MIG sandbox to run")

        sandbox = Sandbox.objects.get(pk=dedicated)
        [alloc] = sandbox.allocations.all()
        assert alloc.gpu.host.name == platform.host and alloc.device_uuid.startswith("GPU-")
        assert list(sandbox.events.values_list("to_state", flat=True)) == [
            "requested",
            "queued",
            "placing",
            "starting",
            "running",
        ]

        # The container exists with our labels and the tier's limits.
        [container] = docker_client.containers.list(
            filters={"label": f"io.gpushare.allocation={sandbox.allocation_key}"}
        )
        attrs = container.attrs
        labels, host_config = attrs["Config"]["Labels"], attrs["HostConfig"]
        assert labels["io.gpushare.sandbox"] == str(dedicated)
        assert labels["io.gpushare.host"] == platform.host
        assert labels["io.gpushare.devices"] == alloc.device_uuid
        tier = catalog["dedicated"]
        assert host_config["Memory"] == tier.memory_limit_mib * 1024 * 1024
        assert host_config["NanoCpus"] == int(tier.cpu_limit * 1e9)
        assert host_config["PidsLimit"] == tier.pids_limit
        assert host_config["CapDrop"] == ["ALL"] and host_config["ReadonlyRootfs"] is True
        assert "no-new-privileges" in host_config["SecurityOpt"]
        assert host_config["NetworkMode"] == "none"
        assert f"NVIDIA_VISIBLE_DEVICES={alloc.device_uuid}" in attrs["Config"]["Env"]
        uid = uids.sandbox_uid(dedicated)  # its own, from the range no host account uses
        assert attrs["Config"]["User"] == f"{uid}:{uid}"
        mig_alloc = Sandbox.objects.get(pk=mig).allocations.get()
        mig_key = Sandbox.objects.get(pk=mig).allocation_key
        [mig_container] = docker_client.containers.list(
            filters={"label": f"io.gpushare.allocation={mig_key}"}
        )
        assert mig_alloc.device_uuid.startswith("MIG-")
        assert mig_container.attrs["Config"]["Labels"]["io.gpushare.devices"] == mig_alloc.device_uuid

        # Live samples of its GPU arrive over the WebSocket, through the real channel layer.
        samples = receive_samples(web.cookies["sessionid"].value, dedicated, 3)
        assert len(samples) == 3 and {s["gpu"] for s in samples} == {alloc.device_uuid}
        assert samples[-1]["t"] > samples[0]["t"] and all(s["simulated"] for s in samples)
        assert samples[-1]["sandboxes"][str(dedicated)]["mem_mib"] > 0

        time.sleep(1.5)  # let it run a little longer, so the duration is not trivially small
        assert web.post(f"/sandboxes/{dedicated}/stop/").status_code == 302
        wait_for(lambda: state_of(dedicated) == "stopped", 60, "the sandbox to stop", every=0.05)
        stopped_seen = time.time()
        web.post(f"/sandboxes/{mig}/stop/")
        wait_for(lambda: state_of(mig) == "stopped", 60, "the MIG sandbox to stop")

        assert (
            docker_client.containers.list(
                all=True, filters={"label": f"io.gpushare.allocation={sandbox.allocation_key}"}
            )
            == []
        )
        assert list(Sandbox.objects.get(pk=dedicated).events.values_list("to_state", flat=True))[-2:] == [
            "stopping",
            "stopped",
        ]

    [usage] = UsageRecord.objects.filter(sandbox_id=dedicated)
    assert usage.duration is not None and usage.cost_micros is not None
    wall = stopped_seen - running_seen
    assert abs(usage.duration.total_seconds() - wall) <= 1.0, (usage.duration, wall)
    duration_us = usage.duration // timedelta(microseconds=1)
    assert usage.cost_micros == cost_micros(tier.price_per_gpu_hour_micros, 1000, duration_us)
    expected = tier.price_per_gpu_hour_micros * usage.duration.total_seconds() / 3600
    assert abs(usage.cost_micros - expected) <= 1

    # A billing client with a token gets it from the API.
    _, key = ApiToken.issue(owner, "billing system", ["read:usage"])
    body = Client().get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}").json()
    record = next(r for r in body["results"] if r["sandbox"] == dedicated)
    assert record["cost_micros"] == usage.cost_micros and record["currency"] == "EUR"
    assert record["duration_seconds"] == usage.duration.total_seconds()


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
