"""Each sandbox on a shared GPU against its memory share, summed over all its processes.

MPS limits bind one client process each (a sandbox with four CUDA processes holds four
times its grant) and time-slicing limits nothing, so the agent adds up what each sandbox
holds on each device (``HostReports.memory_of``: pid -> cgroup -> sandbox) and compares it
with its ``wire.spec.MemoryShare`` every tick. The portal acts on what this sends
(``to_control.sandbox_over_share``): it warns the owner on "warn" and stops the sandbox on
"stop".

One episode per (sandbox, device), from the first tick over the share:

    within --over--> OVER: "warn" at once
    OVER --still over grace_s after it began, under over_share "stop"--> "stop" (once)
    OVER --within its share for CLEAR_HOLD_S--> within: "clear"

A dip under the share shorter than CLEAR_HOLD_S neither clears the episode nor restarts its
grace: a sandbox hovering at its share sends one warning, not one per dip, and cannot dodge
the stop by freeing a little memory now and then. Under "warn" nothing is ever stopped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from wire.messages import OverShareReport
from wire.spec import OVER_SHARE_STOP, SandboxSpec

CLEAR_HOLD_S = 10  # as the alert rules' default hold (workers/host/alerts.py)


@dataclass
class _Episode:
    since_ms: int  # when it went over
    stop_sent: bool = False
    within_since_ms: int | None = None  # back within its share since (not yet cleared)


class ShareWatch:
    """The over-share episodes of one host's sandboxes, driven by its sampler each tick."""

    def __init__(self, clear_hold_s: float = CLEAR_HOLD_S) -> None:
        self.clear_hold_ms = int(clear_hold_s * 1000)
        self._open: dict[tuple[str, str], _Episode] = {}  # (allocation id, device) -> episode

    def observe(self, spec: SandboxSpec, device: str, mem_mib: int, t_ms: int) -> list[OverShareReport]:
        """What to send about ``spec`` holding ``mem_mib`` on ``device`` at ``t_ms``."""
        share = spec.memory_share
        if share is None or share.memory_mib <= 0:
            return []
        key = (spec.allocation_key, device)
        episode = self._open.get(key)
        out: list[OverShareReport] = []
        if mem_mib > share.memory_mib:
            if episode is None:
                episode = self._open[key] = _Episode(t_ms)
                out.append(self._report(spec, device, mem_mib, episode, "warn"))
            episode.within_since_ms = None
            stops = share.over_share == OVER_SHARE_STOP
            if stops and not episode.stop_sent and t_ms - episode.since_ms >= share.grace_s * 1000:
                episode.stop_sent = True
                out.append(self._report(spec, device, mem_mib, episode, "stop"))
            return out
        if episode is None:
            return out
        if episode.within_since_ms is None:
            episode.within_since_ms = t_ms
        if t_ms - episode.within_since_ms >= self.clear_hold_ms:
            del self._open[key]
            out.append(self._report(spec, device, mem_mib, episode, "clear"))
        return out

    def unsent(self, report: OverShareReport) -> None:
        """``report`` could not be sent: a warning or a stop is sent again on a later tick
        (the episode restarts, or its stop is due again); an unsent clear is not repeated."""
        key = (report["allocation_key"], report["gpu"])
        episode = self._open.get(key)
        if episode is None:
            return
        if report["action"] == "warn":
            del self._open[key]
        elif report["action"] == "stop":
            episode.stop_sent = False

    def forget(self, running: Iterable[str]) -> None:
        """Drop the episodes of sandboxes no longer running here (allocation ids)."""
        keep = set(running)
        for key in [k for k in self._open if k[0] not in keep]:
            del self._open[key]

    def over(self) -> set[tuple[str, str]]:
        """(allocation id, device) of every open episode."""
        return set(self._open)

    @staticmethod
    def _report(
        spec: SandboxSpec, device: str, mem_mib: int, episode: _Episode, action: str
    ) -> OverShareReport:
        return OverShareReport(
            sandbox_id=spec.sandbox_id,
            allocation_key=spec.allocation_key,
            gpu=device,
            mem_mib=mem_mib,
            share_mib=spec.memory_share.memory_mib if spec.memory_share else 0,
            since_ms=episode.since_ms,
            action=action,
        )
