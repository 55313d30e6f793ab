"""What slurmrestd says about nodes and jobs, read into plain values (issue 39).

Slurm names generic resources (GRES) in strings: a node's ``gres`` is
``gpu:h100:4,shard:h100:8`` (name, optional type, count), a job's ``gres_detail`` is one
string per node, ``gpu:h100:2(IDX:0-1)`` or ``shard:2(IDX:0)``, where ``IDX`` lists the
indices of the node's GPUs the job holds (a shard or an MPS share names the GPU it is cut
from). These are parsed here, once, and nothing else in the gateway reads Slurm's strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# A job gpushare made carries this prefix and its allocation key in its name; the rest of the
# platform finds its sandboxes by that key (``list_owned``, reconcile).
JOB_NAME_PREFIX = "gpushare-"
# ... and its comment starts "gpushare <node>": the node whose gpushare host holds the
# sandbox (a job across several nodes is listed by that host alone).
COMMENT_PREFIX = "gpushare"

# Job states (squeue(1), "JOB STATE CODES"): a job in one of these holds or is about to hold
# its node's resources.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
    }
)
# Node states and flags under which Slurm starts nothing there (sinfo(1), "NODE STATE CODES").
DOWN_STATES = frozenset({"down", "future", "unknown"})
DOWN_FLAGS = frozenset({"NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "REBOOT_ISSUED"})
DRAIN_FLAGS = frozenset({"DRAIN", "DRAINING", "DRAINED", "MAINTENANCE", "RESERVED"})
_GRES_DETAIL = re.compile(
    r"^(?P<name>[^:(]+)(?::(?P<type>[^:(]+))?(?::(?P<count>\d+))?\(IDX:(?P<idx>[^)]*)\)$"
)


class SlurmFormatError(ValueError):
    """slurmrestd answered something this reader cannot understand (another API version)."""


def index_list(text: str) -> tuple[int, ...]:
    """``0-1,3`` -> (0, 1, 3); ``N/A`` or empty -> ()."""
    if text in ("", "N/A"):
        return ()
    found: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        try:
            found.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise SlurmFormatError(f"GRES index list {text!r} is not Slurm's 0-1,3 form") from None
    return tuple(found)


@dataclass(frozen=True)
class Gres:
    """One generic resource of a node: ``gpu`` (with its type, the model), ``shard`` or ``mps``."""

    name: str
    type: str
    count: int


def parse_gres(text: str | None) -> tuple[Gres, ...]:
    """A node's ``gres``: ``gpu:h100:4,shard:h100:8,mps:400`` (the type is optional; a count
    may carry a socket suffix ``(S:0-1)``)."""
    found = []
    for item in (text or "").split(","):
        item = re.sub(r"\(S:[^)]*\)$", "", item.strip())
        if not item or item == "(null)":
            continue
        parts = item.split(":")
        try:
            count = int(parts[-1])
        except ValueError:
            raise SlurmFormatError(f"GRES {item!r} has no count") from None
        found.append(Gres(parts[0], parts[1] if len(parts) == 3 else "", count))
    return tuple(found)


@dataclass(frozen=True)
class GresHold:
    """What one job holds on one node of one GRES: ``count`` units on the GPUs ``indices``."""

    name: str  # gpu | shard | mps
    count: int
    indices: tuple[int, ...]


def parse_gres_detail(text: str) -> GresHold:
    """One ``gres_detail`` entry: ``gpu:h100:2(IDX:0-1)``, ``shard:2(IDX:0)``, ``mps:50(IDX:1)``."""
    found = _GRES_DETAIL.match(text.strip())
    if found is None:
        raise SlurmFormatError(f"GRES detail {text!r} is not Slurm's name[:type]:count(IDX:…) form")
    indices = index_list(found["idx"])
    count_text = found["count"] or (found["type"] if (found["type"] or "").isdigit() else None)
    return GresHold(found["name"], int(count_text) if count_text else len(indices), indices)


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # Slurm's base state, lower case: idle, mixed, allocated, down, drained, ...
    flags: frozenset[str]  # DRAIN, NOT_RESPONDING, ...
    reason: str
    cpus: int
    memory_mib: int
    gpu_model: str  # the gpu GRES's type ("" when untyped)
    gpus: int
    shards: int  # Slurm's shard GRES: time-slice replicas over the node's GPUs
    mps: int  # Slurm's mps GRES: 100 per GPU

    @classmethod
    def from_rest(cls, data: dict[str, Any]) -> SlurmNode:
        try:
            gres = parse_gres(data.get("gres"))
            gpus = [g for g in gres if g.name == "gpu"]
            return cls(
                name=str(data["name"]),
                state=str(data.get("state") or "unknown").lower(),
                flags=frozenset(str(f).upper() for f in data.get("state_flags") or ()),
                reason=str(data.get("reason") or ""),
                cpus=int(data.get("cpus") or 0),
                memory_mib=int(data.get("real_memory") or 0),
                gpu_model=gpus[0].type if gpus else "",
                gpus=sum(g.count for g in gpus),
                shards=sum(g.count for g in gres if g.name == "shard"),
                mps=sum(g.count for g in gres if g.name == "mps"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SlurmFormatError(f"node {data.get('name')!r}: {exc}") from exc

    @property
    def down(self) -> bool:
        """Slurm starts nothing here and its daemon may be gone: lost in gpushare."""
        return self.state in DOWN_STATES or bool(self.flags & DOWN_FLAGS)

    @property
    def draining(self) -> bool:
        """Slurm starts nothing new here, what runs goes on: drained in gpushare."""
        return self.state in ("drained", "draining") or bool(self.flags & DRAIN_FLAGS)


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    name: str
    state: str  # RUNNING, PENDING, COMPLETED, ...
    user: str
    account: str
    nodes: tuple[str, ...]  # in the order of ``holds``
    holds: dict[str, tuple[GresHold, ...]] = field(default_factory=dict)  # node -> its GRES
    start_s: int = 0  # epoch seconds, 0 until it starts
    end_s: int = 0
    exit_code: int | None = None
    reason: str = ""  # why it is pending or how it ended (state_reason)
    standard_output: str = ""
    comment: str = ""

    @property
    def lead_node(self) -> str:
        """The node whose gpushare host holds this gpushare job ("" for another's job)."""
        words = self.comment.split()
        if self.allocation_key is None or len(words) < 2 or words[0] != COMMENT_PREFIX:
            return ""
        return words[1]

    @property
    def allocation_key(self) -> str | None:
        """The allocation key of a sandbox gpushare submitted; None for anybody else's job."""
        return self.name.removeprefix(JOB_NAME_PREFIX) if self.name.startswith(JOB_NAME_PREFIX) else None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def gpu_indices(self, node: str) -> tuple[int, ...]:
        """The node's GPUs this job holds any part of (a whole GPU, shards of it, an MPS share)."""
        return tuple(sorted({i for hold in self.holds.get(node, ()) for i in hold.indices}))

    @classmethod
    def from_rest(cls, data: dict[str, Any]) -> SlurmJob:
        try:
            # The allocated nodes, in the order of gres_detail's entries (one per node, each
            # with one item per GRES: "gpu:h100:1(IDX:0),shard:2(IDX:1)").
            allocated = (data.get("job_resources") or {}).get("allocated_nodes") or ()
            nodes = tuple(str(n["nodename"]) for n in allocated) or tuple(
                expand_hostlist(str(data.get("nodes") or ""))
            )
            details = [
                tuple(parse_gres_detail(item) for item in re.split(r"(?<=\)),", entry) if item)
                for entry in data.get("gres_detail") or ()
            ]
            holds = {node: details[i] for i, node in enumerate(nodes) if i < len(details)}
            exit_code = data.get("exit_code")
            return cls(
                job_id=int(data["job_id"]),
                name=str(data.get("name") or ""),
                state=str(data.get("job_state") or "").upper(),
                user=str(data.get("user_name") or ""),
                account=str(data.get("account") or ""),
                nodes=nodes,
                holds=holds,
                start_s=int(data.get("start_time") or 0),
                end_s=int(data.get("end_time") or 0),
                exit_code=int(exit_code) if isinstance(exit_code, int) else None,
                reason=str(data.get("state_reason") or ""),
                standard_output=str(data.get("standard_output") or ""),
                comment=str(data.get("comment") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SlurmFormatError(f"job {data.get('job_id')!r}: {exc}") from exc


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list form, ``n[1-3,5],gpu07`` -> n1 n2 n3 n5 gpu07 (zero padding kept)."""
    names: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]*)\]|([^,\[\]]+)", text):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            names.extend(f"{prefix}{i:0{width}d}" for i in range(int(first), int(last or first) + 1))
    return names
