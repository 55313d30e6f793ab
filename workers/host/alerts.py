"""Alert rules with hysteresis, evaluated on the agent at every sample. No ORM here.

The agent sees each sample as it is taken, so an alert is raised within its hold time of
the condition, not a rollup later. The thresholds come from the control worker
(``set_policy``; the heartbeat carries the version the agent holds, and control sends a
new one when it differs): the fleet's for every GPU, a tier's for that tier's sandboxes.

A rule raises once its value has stayed over the high mark for the raise hold and clears
once it has stayed under the clear mark for the clear hold; in between nothing changes,
so a value hovering at the threshold does not flap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wire.telemetry import AlertMessage, GpuSampleMessage
from workers.host.rollups import THROTTLING

XID_QUIET_S = 600  # an XID alert clears after this long without another XID
DEFAULT_RULES: dict[str, Any] = {
    "enabled": True,
    "temp_high_c": 85,
    "temp_clear_c": 80,
    "util_high_pct": 95,
    "util_clear_pct": 90,
    "util_s": 900,
    "mem_high_pct": 95,
    "mem_clear_pct": 90,
    "throttle_s": 30,
    "xid": True,
    "hold_s": 10,
}


@dataclass
class _State:
    raised_key: str | None = None
    over_since_ms: int | None = None
    under_since_ms: int | None = None
    last_xid_ms: int = 0


@dataclass(frozen=True)
class _Reading:
    kind: str
    value: float
    over: bool  # past the raise mark
    under: bool  # past the clear mark
    raise_hold_s: float
    clear_hold_s: float
    threshold: float
    text: str  # what is wrong, for the message


class AlertTracker:
    def __init__(self, host: str) -> None:
        self.host = host
        self.version = ""
        self.fleet: dict[str, Any] = dict(DEFAULT_RULES)
        self.tiers: dict[str, dict[str, Any]] = {}
        self._states: dict[tuple[str, str], _State] = {}  # (subject, kind) -> state
        self._gpu_of: dict[str, str] = {}  # subject -> its GPU, for clearing messages
        self._rules_of: dict[int, dict[str, Any]] = {}  # sandbox id -> its tier's rules, once seen

    def set_policy(self, policy: dict[str, Any]) -> None:
        self.version = str(policy.get("version", ""))
        self.fleet = {**DEFAULT_RULES, **policy.get("fleet", {})}
        self.tiers = {slug: {**DEFAULT_RULES, **rules} for slug, rules in policy.get("tiers", {}).items()}

    # --- observations -------------------------------------------------------------------

    def observe_gpu(self, sample: GpuSampleMessage, now_ms: int) -> list[AlertMessage]:
        mem_pct = 100 * sample["mem_used_mib"] / max(1, sample["mem_total_mib"])
        return self._observe(f"gpu:{sample['gpu']}", sample["gpu"], None, self.fleet, sample, mem_pct, now_ms)

    def observe_sandbox(
        self,
        sandbox_id: int,
        tier: str,
        gpu_uuid: str,
        device: GpuSampleMessage,
        mem_mib: int,
        mem_limit_mib: int,
        now_ms: int,
    ) -> list[AlertMessage]:
        """A sandbox's alerts under its tier's rules (the fleet's when its tier has none):
        its device's temperature, throttling and XIDs, its utilization (its own on a shared
        GPU: the sampler passes ``device`` with the sandbox's figure), and its own memory,
        summed over its processes, against what it may hold (its memory share on a shared
        GPU, its MPS limit, or its device's memory)."""
        rules = self._rules_of[sandbox_id] = self.tiers.get(tier, self.fleet)
        mem_pct = 100 * mem_mib / max(1, mem_limit_mib)
        return self._observe(f"sandbox:{sandbox_id}", gpu_uuid, sandbox_id, rules, device, mem_pct, now_ms)

    def note_fault(
        self,
        gpu_uuid: str,
        kind: str,
        value: float,
        text: str,
        t_ms: int,
        sandbox_ids: list[int] | None = None,
    ) -> list[AlertMessage]:
        """A GPU fault (``xid``, ``ecc``, ``gpu_lost``), raised once while open: for the GPU
        (``sandbox_ids`` None: a device fault, the GPU is drained), or for the sandboxes on
        the device that faulted (an application XID: their owners' own bug, no drain). An
        XID alert clears after XID_QUIET_S without another; the others stay open until an
        admin undrains the GPU (the control plane closes them then)."""
        out = []
        subjects: list[tuple[str, int | None]] = (
            [(f"gpu:{gpu_uuid}", None)] if sandbox_ids is None else [(f"sandbox:{s}", s) for s in sandbox_ids]
        )
        for subject, sandbox_id in subjects:
            rules = self.fleet if sandbox_id is None else self._rules_of.get(sandbox_id, self.fleet)
            state = self._states.setdefault((subject, kind), _State())
            state.last_xid_ms = t_ms
            if rules["enabled"] and (kind != "xid" or rules["xid"]) and state.raised_key is None:
                reading = _Reading(kind, value, True, False, 0, XID_QUIET_S, 0, text)
                out.append(self._raise(subject, gpu_uuid, sandbox_id, reading, state, t_ms))
        return out

    def forget(self, live_subjects: set[str], now_ms: int) -> list[AlertMessage]:
        """Clear the alerts of subjects no longer here (a sandbox that ended, a GPU gone)."""
        out = []
        for (subject, kind), state in list(self._states.items()):
            if subject in live_subjects:
                continue
            if state.raised_key is not None:
                out.append(self._clear(subject, kind, state, 0, 0, now_ms, "its sandbox or GPU is gone"))
            del self._states[(subject, kind)]
            if subject.startswith("sandbox:"):
                self._rules_of.pop(int(subject.split(":", 1)[1]), None)
        return out

    # --- the rule engine --------------------------------------------------------------

    def _readings(self, rules: dict[str, Any], sample: GpuSampleMessage, mem_pct: float) -> list[_Reading]:
        """The rules' readings of a sample; none for utilization when it is unmeasured (None:
        a MIG device without GPM), which is neither high nor back to normal."""
        temp, util = sample["temp_c"], sample["util_pct"]
        throttled = sorted(THROTTLING.intersection(sample["throttle"]))
        hold = rules["hold_s"]
        readings = [
            _Reading(
                "temperature", temp, temp > rules["temp_high_c"], temp < rules["temp_clear_c"],
                hold, hold, rules["temp_high_c"], f"{temp:.0f} °C, over {rules['temp_high_c']} °C",
            ),
            _Reading(
                "memory", mem_pct, mem_pct > rules["mem_high_pct"], mem_pct < rules["mem_clear_pct"],
                hold, hold, rules["mem_high_pct"],
                f"memory {mem_pct:.0f} % full, over {rules['mem_high_pct']} %",
            ),
            _Reading(
                "throttle", len(throttled), bool(throttled), not throttled,
                rules["throttle_s"], rules["throttle_s"], 0,
                f"clocks held down ({', '.join(throttled)}) for {rules['throttle_s']} s",
            ),
        ]  # fmt: skip
        if util is not None:
            readings.insert(1, _Reading(
                "utilization", util, util > rules["util_high_pct"], util < rules["util_clear_pct"],
                rules["util_s"], hold, rules["util_high_pct"],
                f"utilization {util:.0f} % held over {rules['util_high_pct']} % for "
                f"{rules['util_s'] // 60} min",
            ))  # fmt: skip
        return readings

    def _observe(
        self,
        subject: str,
        gpu_uuid: str,
        sandbox_id: int | None,
        rules: dict[str, Any],
        sample: GpuSampleMessage,
        mem_pct: float,
        now_ms: int,
    ) -> list[AlertMessage]:
        self._gpu_of[subject] = gpu_uuid
        out: list[AlertMessage] = []
        for reading in self._readings(rules, sample, mem_pct):
            state = self._states.setdefault((subject, reading.kind), _State())
            if not rules["enabled"]:
                if state.raised_key is not None:
                    out.append(
                        self._clear(subject, reading.kind, state, reading.value, 0, now_ms, "alerts off")
                    )
                continue
            changed = self._step(subject, gpu_uuid, sandbox_id, reading, state, now_ms)
            if changed is not None:
                out.append(changed)
        xid = self._states.get((subject, "xid"))
        if xid is not None and xid.raised_key is not None and now_ms - xid.last_xid_ms >= XID_QUIET_S * 1000:
            out.append(self._clear(subject, "xid", xid, 0, 0, now_ms, f"no XID for {XID_QUIET_S // 60} min"))
        return out

    def _step(
        self,
        subject: str,
        gpu_uuid: str,
        sandbox_id: int | None,
        reading: _Reading,
        state: _State,
        now_ms: int,
    ) -> AlertMessage | None:
        if state.raised_key is None:
            state.under_since_ms = None
            if not reading.over:
                state.over_since_ms = None
                return None
            if state.over_since_ms is None:
                state.over_since_ms = now_ms
            if now_ms - state.over_since_ms >= reading.raise_hold_s * 1000:
                return self._raise(subject, gpu_uuid, sandbox_id, reading, state, now_ms)
            return None
        state.over_since_ms = None
        if not reading.under:
            state.under_since_ms = None
            return None
        if state.under_since_ms is None:
            state.under_since_ms = now_ms
        if now_ms - state.under_since_ms >= reading.clear_hold_s * 1000:
            return self._clear(
                subject, reading.kind, state, reading.value, reading.threshold, now_ms, "back to normal"
            )
        return None

    def _raise(
        self,
        subject: str,
        gpu_uuid: str,
        sandbox_id: int | None,
        reading: _Reading,
        state: _State,
        now_ms: int,
    ) -> AlertMessage:
        state.raised_key = f"{self.host}:{subject}:{reading.kind}:{now_ms}"
        state.over_since_ms = None
        self._gpu_of[subject] = gpu_uuid
        who = f"sandbox {sandbox_id}" if sandbox_id is not None else f"GPU {gpu_uuid}"
        return self._message(
            state.raised_key, "raised", reading.kind, subject, sandbox_id, reading.value, reading.threshold,
            f"{who} on {self.host}: {reading.text}", now_ms,
        )  # fmt: skip

    def _clear(
        self, subject: str, kind: str, state: _State, value: float, threshold: float, now_ms: int, why: str
    ) -> AlertMessage:
        key, state.raised_key = state.raised_key or "", None
        state.under_since_ms = None
        sandbox_id = int(subject.split(":", 1)[1]) if subject.startswith("sandbox:") else None
        return self._message(
            key, "cleared", kind, subject, sandbox_id, value, threshold, f"cleared: {why}", now_ms
        )

    def _message(
        self,
        key: str,
        state: str,
        kind: str,
        subject: str,
        sandbox_id: int | None,
        value: float,
        threshold: float,
        text: str,
        now_ms: int,
    ) -> AlertMessage:
        return AlertMessage(
            type="alert.changed",
            key=key,
            state=state,
            kind=kind,
            host=self.host,
            gpu=self._gpu_of.get(subject, ""),
            sandbox=sandbox_id,
            value=round(float(value), 1),
            threshold=float(threshold),
            message=text[:300],
            t=now_ms,
        )
