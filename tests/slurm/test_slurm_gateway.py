"""The Slurm gateway (workers/slurm/gateway.py) against the real daemons: every node becomes a
host with its GPUs, CPUs and memory; a job outside gpushare changes the node's inventory; a
node Slurm sets down stops beating (so the control plane loses it) and is announced again
once it is back. What it sends is captured (``sent_tasks``); its liveness goes to Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.slurm.cluster import TENANT, SlurmCluster
from workers.host.agent_settings import AgentSettings
from workers.slurm.gateway import SlurmGateway
from workers.slurm.settings import SlurmSettings

pytestmark = [pytest.mark.slurm, pytest.mark.e2e, pytest.mark.slow]
Sent = list[tuple[str, str, tuple[Any, ...]]]


@pytest.fixture
def gateway(cluster: SlurmCluster, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmGateway]:
    monkeypatch.setenv("SLURM_CONF", str(cluster.etc / "slurm.conf"))
    settings = SlurmSettings(
        url=cluster.rest_url, rest_user="root", jwt_key_file=cluster.jwt_key, run_as=TENANT,
        account=cluster.account, output_dir=cluster.root / "output", simulated_gpus=True,
        gpu_models=(("h100", "H100-80GB"), ("a100", "A100-80GB")),
    )  # fmt: skip
    made = SlurmGateway(settings, AgentSettings(host="gw", heartbeat_s=0.0), tmp_path, prefix="lab-")
    consumed: list[str] = []
    made.enrol(consumed.append)  # the test drives the rounds itself
    made.consumed = consumed  # type: ignore[attr-defined]
    yield made
    made.shutdown()


def inventories(sent: Sent) -> dict[str, dict[str, Any]]:
    return {r["host"]: r for _, task, args in sent if task == "agent_inventories" for r in args[0]}


def beaten(sent: Sent) -> set[str]:
    return {b["host"] for _, task, args in sent if task == "agent_heartbeats" for b in args[0]}


def test_every_node_is_a_host_with_its_gpus_cpus_and_memory(gateway: SlurmGateway, sent_tasks: Sent) -> None:
    assert sorted(gateway.agents) == ["lab-n1", "lab-n2", "lab-n3"]
    assert gateway.consumed == ["host.lab-n1", "host.lab-n2", "host.lab-n3"]  # type: ignore[attr-defined]
    sent_tasks.clear()
    gateway.poll_round()
    assert beaten(sent_tasks) == {"lab-n1", "lab-n2", "lab-n3"}
    assert not inventories(sent_tasks)  # nothing changed since they were announced
    inventory = gateway.agents["lab-n1"].context.inventory.current()
    assert inventory["driver"] == "slurm" and inventory["backend"] == "slurm-sim"  # fake GRES
    assert inventory["facts"] == {"cpu_cores": 4, "memory_mib": 4000}
    assert [(g["model"], g["simulated"], g["uuid"]) for g in inventory["gpus"]][:1] == [
        ("H100-80GB", True, "SLURM-lab-n1-GPU0")
    ]
    # n1 has shard GRES (8 over 4 GPUs), n3 mps: what each offers besides whole GPUs.
    first = {h: gateway.agents[h].context.inventory.current()["gpus"][0] for h in ("lab-n1", "lab-n3")}
    assert (first["lab-n1"]["engine_modes"], first["lab-n1"]["engine_replicas"]) == (
        ("dedicated", "timeslice"),
        2,
    )
    assert first["lab-n3"]["engine_modes"] == ("dedicated", "mps")


def test_an_outside_job_is_sent_as_held_gpus_and_a_down_node_stops_beating(
    cluster: SlurmCluster, gateway: SlurmGateway, sent_tasks: Sent
) -> None:
    job_id = cluster.run(
        "sbatch", "--parsable", "-w", "n3", "--gres=gpu:a100:1", "-o", "/dev/null", "--wrap", "sleep 300"
    )
    down = False
    try:
        deadline = time.monotonic() + 10
        while not inventories(sent_tasks) and time.monotonic() < deadline:
            gateway.poll_round()
        [held] = [g for g in inventories(sent_tasks)["lab-n3"]["gpus"] if g["not_ready"]]
        assert f"held by Slurm job {job_id.strip()} (root)" in held["not_ready"]

        cluster.run("scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=test")
        down = True
        sent_tasks.clear()
        gateway.poll_round()
        assert beaten(sent_tasks) == {"lab-n1", "lab-n3"}
        cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")
        down = False
        sent_tasks.clear()
        deadline = time.monotonic() + 20
        while "lab-n2" not in inventories(sent_tasks) and time.monotonic() < deadline:
            time.sleep(0.2)
            gateway.poll_round()
        assert inventories(sent_tasks)["lab-n2"]["started"] is True  # announced as an agent that starts
    finally:
        cluster.run("scancel", job_id.strip())
        if down:
            cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")
