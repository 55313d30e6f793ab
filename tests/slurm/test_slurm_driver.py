"""A sandbox as a Slurm job (workers/slurm/driver.py) and a node's GPUs as Slurm holds them
(workers/slurm/gpus.py), against the real daemons of tests/slurm/cluster.py."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.slurm.cluster import TENANT, SlurmCluster
from wire.spec import MemoryShare, MpsShare, SandboxHandle, SandboxSpec
from workers.drivers.base import DriverError
from workers.slurm.driver import SlurmDriver
from workers.slurm.gpus import SlurmGpus, gpu_uuid
from workers.slurm.settings import SlurmSettings
from workers.slurm.view import ClusterView

pytestmark = [pytest.mark.slurm, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def settings(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmSettings]:
    monkeypatch.setenv("SLURM_CONF", str(cluster.etc / "slurm.conf"))  # what sbatch and srun read
    output = cluster.root / "output"  # under the cluster's folder (0755): the tenant's jobs reach it
    yield SlurmSettings(
        url=cluster.rest_url, rest_user="root", jwt_key_file=cluster.jwt_key, run_as=TENANT,
        account=cluster.account, output_dir=output, start_wait_s=20, simulated_gpus=True,
    )  # fmt: skip
    shutil.rmtree(output, ignore_errors=True)


@pytest.fixture
def view(settings: SlurmSettings) -> ClusterView:
    found = ClusterView(settings.client())
    found.refresh()
    return found


@pytest.fixture
def drivers(settings: SlurmSettings, view: ClusterView) -> Iterator[dict[str, SlurmDriver]]:
    made = {n: SlurmDriver(f"slurm-{n}", n, settings, view.rest, view) for n in ("n1", "n2", "n3")}
    yield made
    view.refresh()
    for node, driver in made.items():  # what a test left running
        for handle in driver.list_owned():
            driver.stop(handle, grace_s=0)
        assert not [j for j in view.active_jobs_on(node) if j.allocation_key], "a test left a job"


def spec(key: str, node: str, devices: int = 1, command: tuple[str, ...] = (), **more: Any) -> SandboxSpec:
    return SandboxSpec(
        allocation_key=key, sandbox_id=1, host=f"slurm-{node}", project="vision", owner="alice", image="",
        command=command or ("sh", "-c", "echo CUDA=$CUDA_VISIBLE_DEVICES; exec sleep 300"),
        device_uuids=tuple(gpu_uuid(f"slurm-{node}", i) for i in range(devices)), real_gpu=True,
        batch=True, **more,
    )  # fmt: skip


def output_of(driver: SlurmDriver, handle: SandboxHandle, wanted: bytes) -> bytes:
    deadline = time.monotonic() + 10
    while True:
        data = driver.read_output(handle, 0, 65536).data
        if wanted in data or time.monotonic() > deadline:
            return data
        time.sleep(0.1)


def test_a_whole_gpu_runs_as_a_job_on_the_chosen_node_as_the_tenant(
    drivers: dict[str, SlurmDriver], view: ClusterView
) -> None:
    driver = drivers["n2"]
    handle = driver.launch(spec("whole-1", "n2", devices=2))
    job = view.rest.job(int(handle.ref))
    assert job is not None and job.state == "RUNNING" and job.nodes == ("n2",)
    assert job.user == TENANT and job.account == "lab-vision" and job.name == "gpushare-whole-1"
    assert [h.name for h in job.holds["n2"]] == ["gpu"] and len(job.gpu_indices("n2")) == 2
    assert handle.devices == tuple(gpu_uuid("slurm-n2", i) for i in job.gpu_indices("n2"))  # what Slurm bound
    assert b"CUDA=" in output_of(driver, handle, b"CUDA=")
    assert driver.status(handle).state == "running"
    view.refresh()
    assert [h.ref for h in driver.list_owned()] == [handle.ref]
    assert driver.launch(spec("whole-1", "n2", devices=2)).ref == handle.ref  # idempotent
    driver.stop(handle, grace_s=0)
    assert driver.status(handle).state == "exited"


@pytest.mark.parametrize(
    ("node", "extra", "gres"),
    [
        ("n1", {"memory_share": MemoryShare("timeslice", 40_000, replicas=2)}, "shard"),
        ("n3", {"mps": MpsShare(pipe_dir="", thread_pct=50, memory_mib=20_000)}, "mps"),
    ],
)
def test_a_share_asks_slurm_for_its_sharing_gres(
    drivers: dict[str, SlurmDriver], node: str, extra: dict[str, Any], gres: str
) -> None:
    driver = drivers[node]
    handle = driver.launch(spec(f"share-{gres}", node, **extra))
    job = driver.rest.job(int(handle.ref))
    assert job is not None and job.state == "RUNNING"
    [hold] = job.holds[node]
    assert hold.name == gres and hold.count == (
        1 if gres == "shard" else 50
    )  # 2 shards a GPU, over 2 replicas
    driver.stop(handle, grace_s=0)


def test_the_warning_is_a_sigterm_the_job_can_catch(drivers: dict[str, SlurmDriver]) -> None:
    driver = drivers["n1"]
    trap = ("sh", "-c", "trap 'echo got TERM; exit 0' TERM; echo ready; while :; do sleep 0.1; done")
    handle = driver.launch(spec("warned", "n1", devices=0, command=trap))
    output_of(driver, handle, b"ready")
    assert "SIGTERM" in driver.warn(handle)
    assert b"got TERM" in output_of(driver, handle, b"got TERM")
    driver.stop(handle, grace_s=0)


def test_the_terminal_is_a_shell_in_the_job_as_its_user(drivers: dict[str, SlurmDriver]) -> None:
    driver = drivers["n3"]
    handle = driver.launch(spec("shell", "n3"))
    terminal = driver.exec_terminal(handle)
    try:
        terminal.write(b"echo hi-$(id -un)-$SLURM_JOB_ID; exit\n")
        seen = b""
        deadline = time.monotonic() + 15
        while f"hi-{TENANT}-{handle.ref}".encode() not in seen and time.monotonic() < deadline:
            try:
                seen += terminal.read(0.2)
            except EOFError:
                break
    finally:
        terminal.close()
    assert f"hi-{TENANT}-{handle.ref}".encode() in seen
    driver.stop(handle, grace_s=0)


def test_the_output_file_is_never_followed_through_a_link(
    drivers: dict[str, SlurmDriver], settings: SlurmSettings
) -> None:
    driver = drivers["n1"]
    handle = driver.launch(spec("linked", "n1", devices=0, command=("sh", "-c", "echo mine; sleep 300")))
    path = settings.output_dir / "linked.out"
    assert path.stat().st_uid != 0 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(settings.output_dir.stat().st_mode & 0o777) == "0o755"  # the tenant cannot swap its file
    driver.stop(handle, grace_s=0)
    path.unlink()
    path.symlink_to("/etc/shadow")
    with pytest.raises(DriverError, match="cannot read the job's output"):
        driver.read_output(handle, 0, 1024)


def test_a_job_outside_gpushare_holds_its_gpus_and_a_drained_node_all(
    cluster: SlurmCluster, settings: SlurmSettings, view: ClusterView
) -> None:
    gpus = SlurmGpus("slurm-n2", "n2", view, simulated=True, models={})
    assert [g.not_ready for g in gpus.list_gpus()] == [""] * 4
    assert {g.model for g in gpus.list_gpus()} == {""}  # "a100": two catalog models, none chosen
    assert {g.model for g in SlurmGpus("slurm-n2", "n2", view, True, {"a100": "A100-80GB"}).list_gpus()} == {
        "A100-80GB"
    }
    job_id = cluster.run(
        "sbatch", "--parsable", "-w", "n2", "--gres=gpu:a100:2", "-o", "/dev/null", "--wrap", "sleep 300"
    ).strip()  # fmt: skip
    drained = False
    try:
        deadline = time.monotonic() + 10
        while view.rest.job(int(job_id)).state != "RUNNING" and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        view.refresh()
        held = [g.index for g in gpus.list_gpus() if f"held by Slurm job {job_id} (root)" in g.not_ready]
        assert len(held) == 2
        cluster.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=bad fan")
        drained = True
        view.refresh()
        assert {g.not_ready for g in gpus.list_gpus()} == {"node n2 is drained in Slurm: bad fan"}
        assert gpus.host_facts() == (4, 4000)
    finally:
        cluster.run("scancel", job_id)
        if drained:
            cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")


def test_a_gang_runs_as_one_job_across_its_nodes_with_ranks_and_a_rendezvous(
    drivers: dict[str, SlurmDriver], view: ClusterView
) -> None:
    driver = drivers["n2"]
    say = ("sh", "-c", "echo rank=$RANK node_rank=$NODE_RANK world=$WORLD_SIZE at=$MASTER_ADDR:$MASTER_PORT")
    gang = spec("gang", "n2", devices=1, command=say)
    gang = SandboxSpec(
        **{**gang.__dict__, "device_uuids": (gpu_uuid("slurm-n2", 0), gpu_uuid("slurm-n3", 0))}
    )
    handle = driver.launch(gang)
    job = view.rest.job(int(handle.ref))
    assert job is not None and sorted(job.nodes) == ["n2", "n3"] and job.lead_node == "n2"
    output_of(driver, handle, b"1: rank=1")
    out = output_of(driver, handle, b"0: rank=0").decode()  # the ranks' lines come in any order
    assert "0: rank=0 node_rank=0 world=2" in out and "1: rank=1 node_rank=1 world=2" in out, out
    [master] = {line.split("at=")[1] for line in out.splitlines() if "at=" in line}
    assert master.split(":")[0] == "n2" and master.split(":")[1].isdigit()
    view.refresh()
    assert handle.ref in [h.ref for h in driver.list_owned()]  # n2's host lists it
    assert handle.ref not in [h.ref for h in drivers["n3"].list_owned()]  # n3's does not: it is n2's
    driver.stop(handle, grace_s=0)
