"""Reading what slurmrestd says (workers/slurm/model.py) and what a placement asks Slurm for
(workers/slurm/driver.py): Slurm's GRES strings, host lists and states, without a cluster."""

from __future__ import annotations

import pytest

from wire.spec import MemoryShare, MpsShare, SandboxSpec
from workers.drivers.base import DriverError
from workers.slurm.accounting import accounting_record
from workers.slurm.driver import gres_request, job_script
from workers.slurm.gpus import catalog_model, gpu_index, gpu_uuid
from workers.slurm.model import (
    GresHold,
    SlurmFormatError,
    SlurmJob,
    SlurmNode,
    expand_hostlist,
    parse_gres,
    parse_gres_detail,
)


def test_gres_strings_are_read_with_or_without_a_type() -> None:
    assert [(g.name, g.type, g.count) for g in parse_gres("gpu:h100:4(S:0-1),shard:h100:8,mps:400")] == [
        ("gpu", "h100", 4), ("shard", "h100", 8), ("mps", "", 400),
    ]  # fmt: skip
    assert parse_gres_detail("gpu:a100:2(IDX:0,2)") == GresHold("gpu", 2, (0, 2))
    assert parse_gres_detail("shard:2(IDX:1)") == GresHold("shard", 2, (1,))
    assert parse_gres_detail("gpu:h100:3(IDX:0-2)") == GresHold("gpu", 3, (0, 1, 2))
    with pytest.raises(SlurmFormatError, match="not Slurm's"):
        parse_gres_detail("gpu=2")


def test_host_lists_expand_as_slurm_writes_them() -> None:
    assert expand_hostlist("n[1-3,5],gpu07,a[08-10]") == [
        "n1",
        "n2",
        "n3",
        "n5",
        "gpu07",
        "a08",
        "a09",
        "a10",
    ]


def test_a_node_is_down_or_drained_by_its_state_and_flags() -> None:
    base = {"name": "n1", "state": "mixed", "state_flags": [], "gres": "gpu:h100:4,shard:h100:8", "cpus": 8}
    node = SlurmNode.from_rest(base)
    assert (node.gpus, node.gpu_model, node.shards, node.down, node.draining) == (4, "h100", 8, False, False)
    assert SlurmNode.from_rest({**base, "state": "down"}).down
    assert SlurmNode.from_rest({**base, "state_flags": ["NOT_RESPONDING"]}).down
    assert SlurmNode.from_rest({**base, "state": "idle", "state_flags": ["DRAIN"]}).draining


def test_a_job_says_which_gpus_of_which_node_it_holds_and_whose_it_is() -> None:
    job = SlurmJob.from_rest(
        {
            "job_id": 7, "name": "gpushare-abc", "job_state": "RUNNING", "user_name": "alice",
            "nodes": "n[1-2]",
            "job_resources": {"allocated_nodes": [{"nodename": "n1"}, {"nodename": "n2"}]},
            "gres_detail": ["gpu:h100:1(IDX:3),shard:2(IDX:0)", "gpu:h100:1(IDX:0)"],
        }
    )  # fmt: skip
    assert job.allocation_key == "abc" and job.active
    assert job.gpu_indices("n1") == (0, 3) and job.gpu_indices("n2") == (0,)
    outside = SlurmJob.from_rest({"job_id": 8, "name": "train", "job_state": "COMPLETED", "nodes": "n3"})
    assert outside.allocation_key is None and not outside.active and outside.nodes == ("n3",)


def spec(**more: object) -> SandboxSpec:
    values: dict[str, object] = {
        "allocation_key": "k", "sandbox_id": 1, "host": "slurm-n1", "project": "p", "owner": "o", "image": "",
        "command": ("python", "train.py", "--name", "it's"), "device_uuids": (gpu_uuid("slurm-n1", 2),),
        "real_gpu": True, "env": {"GPUSHARE_PROJECT": "p"},
    }  # fmt: skip
    return SandboxSpec(**{**values, **more})  # type: ignore[arg-type]


def test_a_placement_asks_for_whole_gpus_shards_or_an_mps_share() -> None:
    assert gres_request(spec(), "h100", 2) == "gpu:h100:1"
    assert gres_request(spec(memory_share=MemoryShare("timeslice", 1, replicas=2)), "h100", 4) == "shard:2"
    assert gres_request(spec(mps=MpsShare("", 30, 1000)), "h100", 0) == "mps:30"
    assert gres_request(spec(device_uuids=()), "h100", 2) == ""
    with pytest.raises(DriverError, match="no shard GRES"):
        gres_request(spec(memory_share=MemoryShare("timeslice", 1, replicas=2)), "h100", 0)


def test_the_job_script_execs_the_command_quoted() -> None:
    script = job_script(spec())
    assert "export GPUSHARE_PROJECT=p" in script
    assert script.rstrip().endswith("exec python train.py --name 'it'\"'\"'s'")


def test_a_gpu_is_named_by_its_host_and_index_and_a_model_by_the_catalog() -> None:
    assert gpu_index(gpu_uuid("slurm-n1", 3)) == 3
    with pytest.raises(ValueError, match="not a Slurm node's GPU"):
        gpu_index("GPU-1234")
    assert catalog_model("h200", {}) == "H200"
    assert catalog_model("a100", {}) == ""  # A100-80GB or A100-40GB: the operator says
    assert catalog_model("a100", {"a100": "A100-40GB"}) == "A100-40GB"


def test_slurmdbds_record_is_read_once_it_has_the_jobs_end() -> None:
    record = {
        "time": {"elapsed": 116, "start": 1796004435, "end": 1796004551},
        "tres": {
            "allocated": [
                {"type": "cpu", "name": None, "count": 1},
                {"type": "gres", "name": "gpu", "count": 2},
                {"type": "gres", "name": "shard", "count": 0},
            ]
        },
    }
    assert accounting_record(9, record) == {
        "job_id": 9, "start_s": 1796004435, "end_s": 1796004551, "elapsed_s": 116,
        "gres": {"gpu": 2, "shard": 0},
    }  # fmt: skip
    assert accounting_record(9, {**record, "time": {"start": 1796004435, "end": 0}}) is None  # still running
