"""A Slurm node's monitor (workers/slurm/monitor.py), what it hands over
(workers/slurm/node_samples.py) and the gateway's reading of it (workers/slurm/feed.py and
SlurmGpus.sample): real processes and Redis, simulated GPUs, no Slurm daemon."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from django.conf import settings

from wire.telemetry import node_samples_key
from workers.gpu.base import GpuLost, GpuNotSampled
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.slurm.feed import MonitorFeed
from workers.slurm.gpus import SlurmGpus, gpu_uuid
from workers.slurm.model import SlurmJob, SlurmNode
from workers.slurm.monitor import NodeMonitor, parse_listpids
from workers.slurm.node_samples import NodeFault, NodeSamples, NodeSamplesError, decode

LISTPIDS = """PID      JOBID    STEPID   LOCALID GLOBALID
27574    2        batch    0       0
27575    2        batch    -       -
27572    1        batch    0       0
garbage line
"""


def test_listpids_table_is_read_as_pid_to_job() -> None:
    assert parse_listpids(LISTPIDS) == {27574: 2, 27575: 2, 27572: 1}
    assert parse_listpids("") == {}


@pytest.fixture
def job_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process as slurmd starts a whole-GPU job's: its node and GPU in its environment."""
    env = {
        "SLURMD_NODENAME": "n1",
        "GPU_DEVICE_ORDINAL": "1",
        "SLURM_JOB_GPUS": "1",
        "PATH": os.environ["PATH"],
    }
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    yield process
    process.kill()
    process.wait()


def backend() -> SimulatedBackend:
    return SimulatedBackend("slurm-n1", parse_sim_spec("H100-80GB:2"))


def test_a_jobs_process_is_its_load_on_the_gpu_slurm_gave_it(job_process: subprocess.Popen[bytes]) -> None:
    gpus = backend()
    elsewhere = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={"SLURMD_NODENAME": "n2", "GPU_DEVICE_ORDINAL": "0", "PATH": os.environ["PATH"]},
    )
    try:
        owners = {job_process.pid: 42, elsewhere.pid: 43}
        tick = NodeMonitor("n1", gpus, pids=lambda: owners).tick()
    finally:
        elsewhere.kill()
        elsewhere.wait()
    assert tick.node == "n1" and tick.simulated and set(tick.gpus) == {0, 1}
    assert tick.gpus[1].by_job[42].mem_mib == int(0.4 * gpus.list_gpus()[1].memory_mib)  # made up, whole GPU
    assert tick.gpus[0].by_job == {}  # n2's job: another slurmd's, on this test machine


def test_process_figures_are_folded_into_their_jobs_and_strangers_left_out() -> None:
    gpus = backend()
    uuid = gpus.list_gpus()[0].uuid
    gpus.note_load("pid:1001", [uuid], 1000, 20.0)
    gpus.note_load("pid:1002", [uuid], 500, 10.0)
    gpus.note_load("pid:9999", [uuid], 300, 5.0)  # not a Slurm job's: the node's own
    tick = NodeMonitor("n1", gpus, pids=lambda: {1001: 7, 1002: 7}).tick()
    assert tick.gpus[0].by_job[7].mem_mib == 1500
    assert tick.gpus[0].by_job[7].util_pct == pytest.approx(30.0, abs=3)
    assert set(tick.gpus[0].by_job) == {7}


def test_an_unknown_listing_still_hands_over_the_gpus() -> None:
    def failing() -> dict[int, int]:
        raise OSError("scontrol: slurmd not responding")

    tick = NodeMonitor("n1", backend(), pids=failing).tick()
    assert set(tick.gpus) == {0, 1} and all(g.by_job == {} for g in tick.gpus.values())


def test_a_lost_gpu_and_its_fault_are_handed_over_once() -> None:
    gpus = backend()
    monitor = NodeMonitor("n1", gpus, pids=dict)
    assert monitor.tick().lost == set()
    gpus.mark_lost(gpus.list_gpus()[1].uuid)
    first = monitor.tick()
    assert first.lost == {1} and set(first.gpus) == {0}
    assert [(f.seq, f.index, f.kind) for f in first.faults] == [(1, 1, "gpu_lost")]
    assert monitor.tick().lost == {1}  # from then on
    assert decode(first.encode()) == first


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.update(node=7), "node"),
        (lambda d: d["gpus"][0].update(index=-1), "gpus[0].index"),
        (lambda d: d["gpus"][0]["sample"].update(util_pct=250), "gpus[0].sample.util_pct"),
        (lambda d: d["gpus"][0]["sample"].update(mem_used_mib=True), "gpus[0].sample.mem_used_mib"),
        (lambda d: d["gpus"][0]["sample"].update(power_w=float("nan")), "gpus[0].sample.power_w"),
        (lambda d: d["gpus"][0]["by_job"].update({"x": {}}), "gpus[0].by_job"),
        (lambda d: d["gpus"][0]["by_job"].update({"²": {"mem_mib": 1}}), "gpus[0].by_job"),
        (lambda d: d["gpus"][0]["sample"].update(throttle=["a" * 100]), "gpus[0].sample.throttle"),
        (lambda d: d.update(lost=["0"]), "lost"),
        (lambda d: d.update(faults=[{"seq": 1}]), "faults[0]"),
    ],
)
def test_a_nodes_bad_samples_are_refused_naming_the_field(change: object, named: str) -> None:
    data = json.loads(NodeMonitor("n1", backend(), pids=dict).tick().encode())
    change(data)  # type: ignore[operator]
    with pytest.raises(NodeSamplesError, match=named.replace("[", r"\[").replace("]", r"\]")):
        decode(json.dumps(data))


def test_samples_too_big_or_not_json_are_refused() -> None:
    with pytest.raises(NodeSamplesError, match="bytes"):
        decode("x" * (2**20 + 1))
    with pytest.raises(NodeSamplesError, match="not JSON"):
        decode("{")


class _View:
    """ClusterView's two answers SlurmGpus.sample needs."""

    def __init__(self, jobs: list[SlurmJob]) -> None:
        self.jobs = jobs

    def jobs_on(self, node: str) -> list[SlurmJob]:
        return [j for j in self.jobs if node in j.nodes]

    def allocation_keys(self) -> dict[int, str]:
        return {j.job_id: j.allocation_key for j in self.jobs if j.allocation_key is not None}

    def node(self, name: str) -> SlurmNode | None:
        return None


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    found = redis.Redis.from_url(settings.REDIS_URL)
    yield found
    found.delete(node_samples_key("slurm-n1"))


def job(job_id: int, name: str) -> SlurmJob:
    return SlurmJob(job_id=job_id, name=name, state="RUNNING", user="nobody", account="lab", nodes=("n1",))


def test_the_gateway_reads_a_nodes_tick_as_its_sandboxes_figures(client: redis.Redis) -> None:
    gpus = backend()
    uuid = gpus.list_gpus()[0].uuid
    gpus.note_load("pid:1001", [uuid], 1000, 20.0)
    gpus.note_load("pid:2002", [uuid], 700, 10.0)
    tick = NodeMonitor("n1", gpus, pids=lambda: {1001: 5, 2002: 6}).tick()
    client.set(node_samples_key("slurm-n1"), tick.encode(), ex=5)
    feed = MonitorFeed(client, max_age_s=0)
    view = _View([job(5, "gpushare-alloc-5"), job(6, "outside")])
    node_gpus = SlurmGpus("slurm-n1", "n1", view, True, {}, feed)  # type: ignore[arg-type]
    with pytest.raises(GpuNotSampled):  # not watched yet: no node of the gateway's
        node_gpus.sample(gpu_uuid("slurm-n1", 0))
    feed.watch("slurm-n1", "n1")
    sample = node_gpus.sample(gpu_uuid("slurm-n1", 0))
    assert sample.uuid == gpu_uuid("slurm-n1", 0)
    assert sample.mem_by_owner == {"alloc-5": 1000, "job:6": 700}
    with pytest.raises(GpuNotSampled, match="no sample of it"):
        node_gpus.sample(gpu_uuid("slurm-n1", 7))


def test_a_lost_gpu_is_lost_at_the_gateway_with_its_event_once(client: redis.Redis) -> None:
    gpus = backend()
    monitor = NodeMonitor("n1", gpus, pids=dict)
    monitor.tick()
    gpus.mark_lost(gpus.list_gpus()[1].uuid)
    client.set(node_samples_key("slurm-n1"), monitor.tick().encode(), ex=5)
    feed = MonitorFeed(client, max_age_s=0)
    feed.watch("slurm-n1", "n1")
    node_gpus = SlurmGpus("slurm-n1", "n1", _View([]), True, {}, feed)  # type: ignore[arg-type]
    with pytest.raises(GpuLost):
        node_gpus.sample(gpu_uuid("slurm-n1", 1))
    assert [(e.uuid, e.kind) for e in node_gpus.fault_events()] == [(gpu_uuid("slurm-n1", 1), "gpu_lost")]
    assert node_gpus.fault_events() == []  # taken once
    restarted = dataclasses.replace(
        monitor.tick(), started_ms=monitor.started_ms + 1, faults=(NodeFault(1, 0, "xid", "XID 79", 5, 79),)
    )
    client.set(node_samples_key("slurm-n1"), restarted.encode(), ex=5)
    assert [(e.kind, e.xid) for e in node_gpus.fault_events()] == [("xid", 79)]  # numbered anew


def test_a_tick_naming_another_node_or_unreadable_is_no_sample(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    feed = MonitorFeed(client, max_age_s=0)
    feed.watch("slurm-n1", "n1")
    other = NodeMonitor("n2", backend(), pids=dict).tick()
    client.set(node_samples_key("slurm-n1"), other.encode(), ex=5)
    with caplog.at_level(logging.ERROR):
        assert feed.latest("slurm-n1") is None
        assert feed.latest("slurm-n1") is None
    assert [r.message for r in caplog.records].count(
        "the monitor of slurm-n1 wrote samples that cannot be read: node: 'n2', not 'n1'"
    ) == 1  # once, not every round
    client.set(node_samples_key("slurm-n1"), "{", ex=5)
    assert feed.latest("slurm-n1") is None
    client.delete(node_samples_key("slurm-n1"))  # the monitor stopped: its key expired
    assert feed.latest("slurm-n1") is None


def test_round_trip_keeps_every_field() -> None:
    gpus = backend()
    gpus.note_load("pid:1", [gpus.list_gpus()[0].uuid], 10, 1.0)
    tick: NodeSamples = NodeMonitor("n1", gpus, pids=lambda: {1: 3}).tick()
    assert decode(tick.encode()) == tick
