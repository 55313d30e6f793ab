"""One-minute rollups folded on the agent from its 1 Hz samples. No ORM here.

The agent sees every sample; the control worker sees one message per host per minute
(min, mean, max of each figure per GPU and per sandbox), which it upserts: a minute sent
twice (a redelivered task) is stored once, a minute lost with a dying agent is a gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wire.telemetry import GpuSampleMessage, SandboxFigures

# Clock reasons that mean the GPU is being held back, not merely idle or capped by choice.
THROTTLING = frozenset({"hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake"})


@dataclass
class _Stat:
    n: int = 0
    low: float = float("inf")
    total: float = 0.0
    high: float = float("-inf")

    def add(self, value: float) -> None:
        self.n += 1
        self.low = min(self.low, value)
        self.total += value
        self.high = max(self.high, value)

    def triple(self, digits: int = 1) -> list[float]:
        return [round(self.low, digits), round(self.total / self.n, digits), round(self.high, digits)]

    def add_measured(self, value: float | None) -> None:
        """A utilization: None (unmeasured) is left out, never counted as 0 (idle)."""
        if value is not None:
            self.add(value)

    def measured_triple(self) -> list[float] | None:
        """min, mean, max of the measured values; None when the minute measured none."""
        return self.triple() if self.n else None


@dataclass
class _GpuMinute:
    temp: _Stat = field(default_factory=_Stat)
    util: _Stat = field(default_factory=_Stat)
    mem: _Stat = field(default_factory=_Stat)
    power: _Stat = field(default_factory=_Stat)
    clock: _Stat = field(default_factory=_Stat)
    mem_total: int = 0
    throttled: int = 0


@dataclass
class _SandboxMinute:
    mem: _Stat = field(default_factory=_Stat)
    util: _Stat = field(default_factory=_Stat)
    temp: _Stat = field(default_factory=_Stat)
    power: _Stat = field(default_factory=_Stat)


class MinuteRollups:
    def __init__(self) -> None:
        self.minute_s: int | None = None
        self._gpus: dict[str, _GpuMinute] = {}
        self._sandboxes: dict[str, _SandboxMinute] = {}

    def roll(self, now_ms: int) -> dict[str, Any] | None:
        """Call before each tick's samples: when ``now_ms`` is in a later minute than the one
        being folded, that minute is closed and returned as the control message's payload."""
        minute_s = now_ms // 60_000 * 60
        closed = None
        if self.minute_s is not None and minute_s != self.minute_s and (self._gpus or self._sandboxes):
            closed = self._payload(self.minute_s)
            self._gpus, self._sandboxes = {}, {}
        self.minute_s = minute_s
        return closed

    def add_gpu(self, message: GpuSampleMessage) -> None:
        gpu = self._gpus.setdefault(message["gpu"], _GpuMinute())
        gpu.temp.add(message["temp_c"])
        gpu.util.add_measured(message["util_pct"])
        gpu.mem.add(message["mem_used_mib"])
        gpu.power.add(message["power_w"])
        gpu.clock.add(message["sm_clock_mhz"])
        gpu.mem_total = message["mem_total_mib"]
        gpu.throttled += bool(THROTTLING.intersection(message["throttle"]))

    def add_sandbox(self, sandbox_id: str, figures: SandboxFigures, device: GpuSampleMessage) -> None:
        """A sandbox's own figures plus the temperature and power of the device it runs on."""
        box = self._sandboxes.setdefault(sandbox_id, _SandboxMinute())
        box.mem.add(figures["mem_mib"])
        box.util.add_measured(figures["util_pct"])
        box.temp.add(device["temp_c"])
        box.power.add(device["power_w"])

    def _payload(self, minute_s: int) -> dict[str, Any]:
        gpus = {
            uuid: {
                "samples": g.temp.n,
                "temp_c": g.temp.triple(),
                "util_pct": g.util.measured_triple(),
                "mem_mib": [int(v) for v in g.mem.triple(0)],
                "mem_total_mib": g.mem_total,
                "power_w": g.power.triple(),
                "sm_clock_mean_mhz": int(g.clock.total / g.clock.n),
                "throttled": g.throttled,
            }
            for uuid, g in self._gpus.items()
        }
        sandboxes = {
            sid: {
                "samples": b.mem.n,
                "mem_mib": [int(v) for v in b.mem.triple(0)],
                "util_pct": b.util.measured_triple(),
                "temp_max_c": round(b.temp.high, 1),
                "power_mean_w": round(b.power.total / b.power.n, 1),
            }
            for sid, b in self._sandboxes.items()
        }
        return {"minute": minute_s, "gpus": gpus, "sandboxes": sandboxes}
