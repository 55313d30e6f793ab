"""What a Slurm node's monitor (``workers.slurm.monitor``) hands the gateway each tick: its
GPUs' samples, each GPU's memory and utilization by Slurm job, the GPUs it lost and its
fault events, as one JSON value in Redis (``wire.telemetry.node_samples_key``).

The node writes it and the gateway reads it, so the gateway treats it as a hostile host's
words: ``decode`` checks every field's type and range and names the first bad one
(``NodeSamplesError``); a node can misreport its own GPUs, as any host can, but not another
node's (its Redis user writes its own key only, ``wire.broker_acl``) nor crash the gateway.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from workers.gpu.base import FaultEvent, GpuSample

MAX_GPUS = 64  # a node's GPUs one tick may name
MAX_JOBS = 1024  # jobs one GPU may name
MAX_FAULTS = 64  # fault events a node keeps for the gateway (the newest)
MAX_BYTES = 2**20


class NodeSamplesError(ValueError):
    """A node's samples that cannot be read; the message names the field."""


@dataclass(frozen=True)
class JobFigures:
    mem_mib: int
    util_pct: float | None  # None: the device cannot measure it per process


@dataclass(frozen=True)
class NodeGpuSample:
    """One GPU's sample, by its Slurm index (``IDX``), with its load by Slurm job id.
    ``sample``: the figures as the node's backend gave them, its owners moved to ``by_job``."""

    index: int
    sample: GpuSample
    by_job: dict[int, JobFigures] = field(default_factory=dict)
    per_job_util: bool = True  # False: per-process utilization unmeasured on this device

    def as_gpu_sample(self, uuid: str, owner_of: dict[int, str]) -> GpuSample:
        """The gateway's ``GpuSample`` for it: ``uuid`` its gpushare name; each job's figures
        under its sandbox's allocation key (``owner_of``), others' under ``job:<id>``."""
        mem = {owner_of.get(job, f"job:{job}"): f.mem_mib for job, f in self.by_job.items()}
        util = (
            {owner_of.get(job, f"job:{job}"): f.util_pct or 0.0 for job, f in self.by_job.items()}
            if self.per_job_util
            else None
        )
        return replace(self.sample, uuid=uuid, mem_by_owner=mem, util_by_owner=util)


@dataclass(frozen=True)
class NodeFault:
    seq: int  # numbered by the monitor from 1, so the gateway takes each once
    index: int
    kind: str
    detail: str
    t_ms: int
    xid: int | None = None

    def as_event(self, uuid: str) -> FaultEvent:
        return FaultEvent(uuid, self.kind, self.detail, self.t_ms, xid=self.xid)


@dataclass(frozen=True)
class NodeSamples:
    """One tick of one node. ``started_ms``: when its monitor started (its fault numbers
    start again with it)."""

    node: str
    t_ms: int
    started_ms: int
    simulated: bool
    gpus: dict[int, NodeGpuSample]
    lost: frozenset[int] = frozenset()
    faults: tuple[NodeFault, ...] = ()

    def encode(self) -> str:
        return json.dumps(
            {
                "node": self.node, "t_ms": self.t_ms, "started_ms": self.started_ms,
                "simulated": self.simulated,
                "gpus": [_gpu_json(g) for g in self.gpus.values()],
                "lost": sorted(self.lost), "faults": [asdict(f) for f in self.faults],
            }
        )  # fmt: skip


def _gpu_json(gpu: NodeGpuSample) -> dict[str, Any]:
    sample = asdict(gpu.sample)
    for owners in ("mem_by_owner", "util_by_owner"):
        del sample[owners]  # by job instead
    sample["throttle"] = list(gpu.sample.throttle)
    return {
        "index": gpu.index, "sample": sample, "per_job_util": gpu.per_job_util,
        "by_job": {str(job): asdict(f) for job, f in gpu.by_job.items()},
    }  # fmt: skip


def decode(raw: bytes | str) -> NodeSamples:
    """A node's tick from its JSON; NodeSamplesError naming the first field that is wrong."""
    if len(raw) > MAX_BYTES:
        raise NodeSamplesError(f"{len(raw)} bytes, more than {MAX_BYTES}")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise NodeSamplesError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise NodeSamplesError("not an object")
    gpus_json = _typed(data, "gpus", list)
    faults_json = _typed(data, "faults", list)
    if len(gpus_json) > MAX_GPUS or len(faults_json) > MAX_FAULTS:
        raise NodeSamplesError(f"more than {MAX_GPUS} GPUs or {MAX_FAULTS} faults")
    gpus = {}
    for i, gpu in enumerate(gpus_json):
        sample = _gpu(gpu, f"gpus[{i}]")
        gpus[sample.index] = sample
    lost = _typed(data, "lost", list)
    if not all(isinstance(x, int) and 0 <= x < MAX_GPUS for x in lost):
        raise NodeSamplesError("lost: not a list of GPU indices")
    return NodeSamples(
        node=_typed(data, "node", str),
        t_ms=_count(data, "t_ms"),
        started_ms=_count(data, "started_ms"),
        simulated=_typed(data, "simulated", bool),
        gpus=gpus,
        lost=frozenset(lost),
        faults=tuple(_fault(f, f"faults[{i}]") for i, f in enumerate(faults_json)),
    )


def _gpu(data: Any, where: str) -> NodeGpuSample:
    if not isinstance(data, dict):
        raise NodeSamplesError(f"{where}: not an object")
    by_job_json = _typed(data, "by_job", dict, where)
    if len(by_job_json) > MAX_JOBS:
        raise NodeSamplesError(f"{where}.by_job: more than {MAX_JOBS} jobs")
    by_job = {}
    for job, figures in by_job_json.items():
        if not (job.isascii() and job.isdigit() and len(job) <= 12) or not isinstance(figures, dict):
            raise NodeSamplesError(f"{where}.by_job: {job!r} is not a job id with figures")
        by_job[int(job)] = JobFigures(
            _count(figures, "mem_mib", where), _pct(figures.get("util_pct"), f"{where}.by_job.{job}")
        )
    index = _count(data, "index", where)
    if index >= MAX_GPUS:
        raise NodeSamplesError(f"{where}.index: {index} is not a GPU index")
    return NodeGpuSample(
        index=index, sample=_sample(_typed(data, "sample", dict, where), f"{where}.sample"), by_job=by_job,
        per_job_util=_typed(data, "per_job_util", bool, where),
    )  # fmt: skip


def _sample(data: dict[str, Any], where: str) -> GpuSample:
    throttle = _typed(data, "throttle", list, where)
    if not all(isinstance(t, str) and len(t) <= 40 for t in throttle) or len(throttle) > 16:
        raise NodeSamplesError(f"{where}.throttle: not a list of reasons")
    return GpuSample(
        uuid=_typed(data, "uuid", str, where)[:100], t_ms=_count(data, "t_ms", where),
        temp_c=_number(data, "temp_c", where), util_pct=_pct(data.get("util_pct"), f"{where}.util_pct"),
        mem_used_mib=_count(data, "mem_used_mib", where), mem_total_mib=_count(data, "mem_total_mib", where),
        power_w=_number(data, "power_w", where), sm_clock_mhz=_count(data, "sm_clock_mhz", where),
        throttle=tuple(throttle), ecc_corrected=_count(data, "ecc_corrected", where),
        ecc_uncorrected=_count(data, "ecc_uncorrected", where),
    )  # fmt: skip


def _fault(data: Any, where: str) -> NodeFault:
    if not isinstance(data, dict):
        raise NodeSamplesError(f"{where}: not an object")
    xid = data.get("xid")
    if xid is not None and not isinstance(xid, int):
        raise NodeSamplesError(f"{where}.xid: not a number")
    return NodeFault(
        seq=_count(data, "seq", where), index=_count(data, "index", where),
        kind=_typed(data, "kind", str, where)[:40], detail=_typed(data, "detail", str, where)[:300],
        t_ms=_count(data, "t_ms", where), xid=xid,
    )  # fmt: skip


def _typed(data: dict[str, Any], name: str, kind: type, where: str = "") -> Any:
    value = data.get(name)
    # bool is an int to Python: a count that is True is no count.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise NodeSamplesError(f"{where + '.' if where else ''}{name}: not a {kind.__name__}")
    return value


def _count(data: dict[str, Any], name: str, where: str = "") -> int:
    value = _typed(data, name, int, where)
    if value < 0:
        raise NodeSamplesError(f"{where + '.' if where else ''}{name}: negative")
    return int(value)


def _number(data: dict[str, Any], name: str, where: str) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NodeSamplesError(f"{where}.{name}: not a number")
    return float(value)


def _pct(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 100:
        raise NodeSamplesError(f"{where}: not a percentage")
    return float(value)
