"""What a trace replay produced, whichever engine ran it (``replay.py``'s offline one with
the paper's baselines, ``live_replay.py``'s through ``run_cycle``): its own module so
both engines build it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.research.trace import Workload


@dataclass
class ReplayResult:
    workload: Workload
    node: list[int] = field(default_factory=list)  # per pod: node index, -1 when it failed
    gpus: list[tuple[int, ...]] = field(default_factory=list)
    arrived_milli: list[int] = field(default_factory=list)  # cumulative GPU milli requested
    used_milli: list[int] = field(default_factory=list)  # GPU milli allocated after the pod
    frag_milli: list[float] = field(default_factory=list)  # sum of F(n) after the pod
    decision_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def failed(self) -> int:
        return self.node.count(-1)

    def pct(self, milli: float) -> float:
        """As the paper's analysis computes it: milli / #GPUs / 10, i.e. % of capacity."""
        return milli / self.workload.total_gpus / 10
