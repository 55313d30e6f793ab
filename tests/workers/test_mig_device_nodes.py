"""A MIG re-layout makes the device nodes of the instances it creates (review 3, new #5).

A new instance's capability nodes (/dev/nvidia-caps/nvidia-cap<N>) do not exist until
something asks for them; a process sandbox has no nvidia-modprobe to call, so without this
its launch into the new instance fails until the agent restarts. Exercised on the fake NVML
(an A100 in MIG mode with a 2g.20gb@0 and a 3g.40gb@4) and fake /proc and /dev trees.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scheduler.defrag import CREATE, MigMove, MigPlan
from tests.workers.nvml_fake import A100_UUID, FakeNvml
from tests.workers.test_agent import RecordingDriver
from workers.drivers.gpu_nodes import GpuNodes
from workers.gpu.nvml import NvmlBackend
from workers.gpu.nvml_session import DeviceIds
from workers.host.agent import Agent
from workers.host.agent_settings import AgentSettings

A100_MINOR = 1


class RecordingNodes(GpuNodes):
    """GpuNodes over fake trees that records the nvidia-modprobe it would run, and makes the
    node as the real one would."""

    def __init__(self, proc: Path, dev: Path, fake: FakeNvml) -> None:
        def lookup(uuid: str) -> DeviceIds:
            handle = fake.nvmlDeviceGetHandleByUUID(uuid)
            if handle.parent is None:
                return DeviceIds(minor=fake.gpus.index(handle))
            return DeviceIds(minor=fake.gpus.index(handle.parent), gi=handle.gi_id, ci=handle.ci_id)

        super().__init__(proc_root=proc, dev_root=dev, nvml=lookup)
        self.ran: list[list[str]] = []

    def create_missing(self, uuids: Any, run: Callable[[list[str]], object] | None = None) -> list[list[str]]:
        return super().create_missing(uuids, self.ran.append)


def fake_trees(tmp_path: Path, fake: FakeNvml) -> tuple[Path, Path]:
    """/proc/driver/nvidia with a capability minor for every GPU instance the fake may hold
    (gi 1..7, ci 0), and a /dev with the control nodes and both GPUs but no caps node."""
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    for gi in range(1, 8):
        gi_dir = proc / "capabilities" / f"gpu{A100_MINOR}" / "mig" / f"gi{gi}"
        (gi_dir / "ci0").mkdir(parents=True)
        (gi_dir / "access").write_text(f"DeviceFileMinor: {100 + gi}\nDeviceFileMode: 292\n")
        (gi_dir / "ci0" / "access").write_text(f"DeviceFileMinor: {200 + gi}\nDeviceFileMode: 292\n")
    (dev / "nvidia-caps").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"):
        (dev / name).touch()
    return proc, dev


@pytest.fixture
def mig_agent(
    tmp_path: Path, fake: FakeNvml, backend: NvmlBackend, sent_tasks: Any
) -> tuple[Agent, RecordingNodes]:
    settings = AgentSettings(host="h", mps_dir=str(tmp_path / "mps"))
    agent = Agent("h", backend, RecordingDriver(), tmp_path, settings)  # type: ignore[arg-type]
    agent.context.inventory.refresh()
    nodes = RecordingNodes(*fake_trees(tmp_path, fake), fake)
    # The agent hands its own GpuNodes to the plans: the one it makes nodes with at start.
    assert agent.plans.device_nodes is agent.device_nodes is not None
    agent.device_nodes = agent.plans.device_nodes = nodes
    return agent, nodes


def create_plan(profile: str, start: int) -> dict[str, Any]:
    move = MigMove(kind=CREATE, gpu=A100_UUID, profile=profile, start=start, sandbox="sb-9")
    return MigPlan(profile=profile, gpu=A100_UUID, start=start, moves=(move,), disturbed=()).to_json()


def gi_of(fake: FakeNvml, mig_uuid: str) -> int:
    return next(
        gi
        for (gpu, gi), inst in fake.instances.items()
        if any(c.mig.uuid == mig_uuid for c in inst.cis.values())
    )


def test_a_re_layout_makes_the_capability_nodes_of_the_instance_it_created(
    mig_agent: tuple[Agent, RecordingNodes], fake: FakeNvml, sent_tasks: Any
) -> None:
    agent, nodes = mig_agent
    agent.execute_plan(1, [], create_plan("1g.10gb", 2), {})
    [report] = [args for _, task, args in sent_tasks if task == "plan_executed"]
    [created] = [s for s in report[3] if s["action"] == "create"]
    gi_dir = (
        nodes.proc_root
        / "capabilities"
        / f"gpu{A100_MINOR}"
        / "mig"
        / f"gi{gi_of(fake, created['mig_uuid'])}"
    )
    # Its GPU instance's and compute instance's caps nodes, each made once, as at start.
    assert nodes.ran == [
        ["nvidia-modprobe", "-f", str(gi_dir / "access")],
        ["nvidia-modprobe", "-f", str(gi_dir / "ci0" / "access")],
    ]


def test_a_re_layout_whose_nodes_cannot_be_made_still_reports_its_steps(
    mig_agent: tuple[Agent, RecordingNodes], sent_tasks: Any
) -> None:
    """No capability minor to read (the driver's /proc says nothing of the instance): the
    plan's report still goes out, and the launch into it will name the node and its command."""
    agent, nodes = mig_agent
    for access in nodes.proc_root.glob("capabilities/**/access"):
        access.unlink()
    agent.execute_plan(2, [], create_plan("1g.10gb", 2), {})
    [report] = [args for _, task, args in sent_tasks if task == "plan_executed"]
    assert [s["action"] for s in report[3]] == ["create"] and report[4] == ""
    assert nodes.ran == []


def test_a_simulated_host_makes_no_device_nodes(tmp_path: Path) -> None:
    from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    agent = Agent("h", backend, RecordingDriver(), tmp_path, AgentSettings(host="h"))  # type: ignore[arg-type]
    assert agent.plans.device_nodes is None
