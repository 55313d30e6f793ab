"""Each sandbox's GPU utilization over a window: what idle culling judges (via reconcile)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class UtilizationWindows:
    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        # allocation id -> (t_ms, utilization %) samples of its devices, oldest first
        self._windows: dict[str, deque[tuple[int, float]]] = {}

    def note(self, allocation_id: str, t_ms: int, util_pct: float | None) -> None:
        """One sample of the sandbox's device. ``None`` is unmeasured (NVML has no
        utilization for a MIG device without GPM): it adds nothing, so a sandbox whose
        device is never measured has no figure and is never culled as idle on a made-up 0."""
        window = self._windows.setdefault(allocation_id, deque())
        if util_pct is not None:
            window.append((t_ms, util_pct))
        while window and window[0][0] < t_ms - self.window_s * 1000:
            window.popleft()

    def over_window(self, allocation_id: str) -> tuple[float, float] | None:
        """(mean GPU utilization %, seconds covered) over the window; None before the first
        measured sample. On a shared GPU (MPS, time-slice) it is the whole GPU's
        utilization: idle means idle for everyone."""
        window = self._windows.get(allocation_id)
        if not window:
            return None
        mean = sum(u for _, u in window) / len(window)
        return round(mean, 1), (window[-1][0] - window[0][0]) / 1000

    def keep_only(self, allocation_ids: Iterable[str]) -> None:
        keep = set(allocation_ids)
        for gone in set(self._windows) - keep:
            self._windows.pop(gone, None)

    def forget(self, allocation_id: str) -> None:
        self._windows.pop(allocation_id, None)
