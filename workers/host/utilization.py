"""Each sandbox's GPU utilization over a window: what idle culling judges (via reconcile)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class UtilWindow:
    """A sandbox's utilization over the last ``window_s`` seconds, from its own figures
    (workers/host/sampler.py): its device's on a device of its own, its processes' own on a
    shared GPU; unmeasured samples (None: NVML has no utilization for a MIG device without
    GPM, nor per process on MIG or, unverified, under MPS) hold the window's time but not
    its mean."""

    window_s: float
    _points: deque[tuple[int, float | None]] = field(default_factory=deque)

    def add(self, t_ms: int, util_pct: float | None) -> None:
        self._points.append((t_ms, util_pct))
        while self._points and self._points[0][0] < t_ms - self.window_s * 1000:
            self._points.popleft()

    def mean(self) -> tuple[float | None, float] | None:
        """(mean %, seconds covered); the mean is None when no sample of the window was
        measured (culling must skip it, never read it as idle). None before any sample.
        On a shared GPU (MPS, time-slice) it is the sandbox's own processes' share of the
        GPU's time, not the whole GPU's: an idle tenant beside a busy one reads idle."""
        if not self._points:
            return None
        measured = [u for _, u in self._points if u is not None]
        seconds = (self._points[-1][0] - self._points[0][0]) / 1000
        return (round(sum(measured) / len(measured), 1) if measured else None), seconds


class UtilizationWindows:
    """One window per sandbox (allocation id)."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self._windows: dict[str, UtilWindow] = {}

    def note(self, allocation_key: str, t_ms: int, util_pct: float | None) -> None:
        self._windows.setdefault(allocation_key, UtilWindow(self.window_s)).add(t_ms, util_pct)

    def over_window(self, allocation_key: str) -> tuple[float | None, float] | None:
        window = self._windows.get(allocation_key)
        return window.mean() if window is not None else None

    def keep_only(self, allocation_keys: Iterable[str]) -> None:
        keep = set(allocation_keys)
        for gone in set(self._windows) - keep:
            self._windows.pop(gone, None)

    def forget(self, allocation_key: str) -> None:
        self._windows.pop(allocation_key, None)
