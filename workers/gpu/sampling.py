"""What a sampling loop needs from the backends' contract, ready for the agent to call.

Three rules of the GpuBackend seam (base.py) are easy to get wrong in a loop over GPUs:

- ``sample()`` raises ``GpuLost`` for a GPU that is gone. One lost GPU must not stop the
  tick for the others, nor the health report that says it is lost: ``sample_all``
  samples each device on its own and says which were lost and which failed otherwise.
- ``util_pct`` may be None (unmeasured: a MIG device without GPM). A utilization window
  must leave those samples out, not average them in as 0 (idle culling would stop a busy
  sandbox): ``UtilWindow``.
- An ``app_xid`` event is the tenant's own fault: it concerns the sandboxes on the device
  it names (one MIG instance, or the whole GPU and its instances), and them only:
  ``sandboxes_hit``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from workers.gpu.base import GpuBackend, GpuBackendError, GpuLost, GpuSample

log = logging.getLogger(__name__)


@dataclass
class Sampled:
    samples: dict[str, GpuSample] = field(default_factory=dict)  # device uuid -> sample
    lost: set[str] = field(default_factory=set)  # GPU uuids (a MIG device's parent) now gone
    failed: dict[str, str] = field(default_factory=dict)  # device uuid -> why, this tick only


def sample_all(
    backend: GpuBackend, uuids: Iterable[str], parent_of: Mapping[str, str] | None = None
) -> Sampled:
    """Sample each device once, on its own: a lost GPU goes to ``lost`` (drop it, and its
    MIG devices, until the next inventory; the backend has queued its gpu_lost event), any
    other failure to ``failed`` (skip the device this tick).

    ``parent_of`` (MIG uuid -> GPU uuid) lets a lost GPU's MIG devices go unasked, and
    drops one sampled before its GPU was found lost: its board is gone."""
    parent_of = parent_of or {}
    out = Sampled()
    for uuid in dict.fromkeys(uuids):
        if parent_of.get(uuid, uuid) in out.lost:
            continue
        try:
            out.samples[uuid] = backend.sample(uuid)
        except GpuLost as err:
            out.lost.add(err.uuid)
            log.error("GPU %s is lost (%s): no longer sampled", err.uuid, err)
        except GpuBackendError as err:
            out.failed[uuid] = str(err)
            log.warning("sampling %s failed: %s", uuid, err)
    for uuid in [u for u in out.samples if parent_of.get(u, u) in out.lost]:
        del out.samples[uuid]
    return out


@dataclass
class UtilWindow:
    """A sandbox's utilization over the last ``window_s`` seconds, from its device's
    samples; unmeasured samples (None) hold the window's time but not its mean."""

    window_s: float
    _points: deque[tuple[int, float | None]] = field(default_factory=deque)

    def add(self, t_ms: int, util_pct: float | None) -> None:
        self._points.append((t_ms, util_pct))
        while self._points and self._points[0][0] < t_ms - self.window_s * 1000:
            self._points.popleft()

    def mean(self) -> tuple[float | None, float] | None:
        """(mean %, seconds covered); the mean is None when no sample of the window was
        measured (culling must skip it, never read it as idle). None before any sample."""
        if not self._points:
            return None
        measured = [u for _, u in self._points if u is not None]
        seconds = (self._points[-1][0] - self._points[0][0]) / 1000
        return (round(sum(measured) / len(measured), 1) if measured else None), seconds


def sandboxes_hit(
    device_uuid: str, devices_of: Mapping[int, Iterable[str]], parent_of: Mapping[str, str]
) -> list[int]:
    """The sandboxes an event on ``device_uuid`` concerns: on a MIG device, those that
    hold it; on a GPU, those on it or on any of its MIG devices.

    ``devices_of`` is sandbox id -> its device uuids, ``parent_of`` MIG uuid -> GPU uuid."""
    hit = []
    for sandbox_id, devices in devices_of.items():
        if device_uuid in parent_of:  # a MIG device: only its own tenant
            if device_uuid in devices:
                hit.append(sandbox_id)
        elif any(parent_of.get(d, d) == device_uuid for d in devices):
            hit.append(sandbox_id)
    return sorted(hit)
