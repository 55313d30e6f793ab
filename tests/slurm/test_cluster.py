"""The Slurm cluster the Slurm gateway's tests run against (issue 39, item 7): three nodes on
loopback with fake GPUs, REST and accounting. What this proves is what the gateway will rely
on: slurmrestd's inventory names each node's GPUs and sharing GRES, a job submitted over REST
with a GRES lands on a node that has it and runs, and slurmdbd accounts its GRES."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.slurm.cluster import REST_VERSION, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.e2e, pytest.mark.slow]


def submit(cluster: SlurmCluster, token: str, gres: str, name: str) -> int:
    job = {
        "name": name, "account": cluster.account, "partition": "gpu", "gres": gres,
        "current_working_directory": "/tmp", "environment": {"PATH": "/usr/bin:/bin"},
        "standard_output": "/dev/null", "time_limit": 5,
    }  # fmt: skip
    answer = cluster.rest(
        "POST",
        f"/slurm/{REST_VERSION}/job/submit",
        token,
        json={"job": job, "script": "#!/bin/sh\nsleep 30\n"},
    )
    assert answer.status_code == 200, answer.text
    return int(answer.json()["job_id"])


def job(cluster: SlurmCluster, token: str, job_id: int) -> dict[str, Any]:
    [found] = cluster.rest("GET", f"/slurm/{REST_VERSION}/job/{job_id}", token).json()["jobs"]
    return dict(found)


def test_the_inventory_names_each_nodes_gpus_and_sharing(cluster: SlurmCluster) -> None:
    nodes = cluster.rest("GET", f"/slurm/{REST_VERSION}/nodes", cluster.token()).json()["nodes"]
    assert {n["name"]: n["gres"] for n in nodes} == {
        "n1": "gpu:h100:4,shard:h100:8",
        "n2": "gpu:a100:4,shard:a100:8",
        "n3": "gpu:a100:4,mps:a100:400",
    }
    assert {n["state"] for n in nodes} == {"idle"}


def test_jobs_with_a_gres_run_where_it_is_and_are_accounted(cluster: SlurmCluster) -> None:
    token = cluster.token()
    wanted = {"gpu:h100:1": {"n1"}, "shard:2": {"n1", "n2"}, "mps:50": {"n3"}}
    ids = {gres: submit(cluster, token, gres, f"probe-{gres.replace(':', '-')}") for gres in wanted}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {gres: job(cluster, token, job_id) for gres, job_id in ids.items()}
        if all(j["job_state"] == "RUNNING" for j in states.values()):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"not all running: {states}\n{cluster.logs()}")
    for gres, found in states.items():
        assert found["nodes"] in wanted[gres], (gres, found["nodes"])
    cluster.run("scancel", *(str(job_id) for job_id in ids.values()))
    # slurmctld hands jobs to slurmdbd as it can: wait until the three are accounted.
    tres: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(tres.get(str(i)) for i in ids.values()):
        listed = cluster.run(
            "sacct", "-X", "-n", "-P", "-o", "JobID,AllocTRES", "-j", ",".join(map(str, ids.values()))
        )
        tres = dict(line.split("|", 1) for line in listed.splitlines())
        time.sleep(0.2)
    assert "gres/gpu=1" in tres[str(ids["gpu:h100:1"])]
    assert "gres/shard=2" in tres[str(ids["shard:2"])]
    assert "gres/mps=50" in tres[str(ids["mps:50"])]
