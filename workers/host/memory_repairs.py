"""Each GPU's memory repair state (row remapping, page retirement), read at start and every
``GPU_MEMORY_CHECK_S``, as fault events that drain the GPU.

NVML raises an event when a memory error happens, not for what the board already holds: a
row remap that failed or waits for a reset since before the agent started (or while it was
down) is seen only by reading it (``MemoryRepairs``). A failed remap drains the GPU for
replacement; a pending remap or page retirement drains it until an operator resets it when
idle (nothing running is stopped). Each condition is reported when first seen by this agent
process, at its first read or when it appears: an admin who puts the GPU back in service is
not overruled every period, while an agent restart reads and reports it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from workers.gpu.base import FaultEvent, GpuBackendError, GpuLost
from workers.host.context import HostContext

log = logging.getLogger(__name__)


class MemoryRepairWatch:
    def __init__(self, context: HostContext, clock: Callable[[], float] = time.monotonic) -> None:
        self.context = context
        self._clock = clock
        self._due = 0.0  # the first call reads: at start
        self._seen: dict[str, set[str]] = {}  # GPU uuid -> the fault kinds it shows now

    def due_faults(self) -> list[FaultEvent]:
        """The fault events of conditions that appeared since the last read, when a read is
        due (at the first call and every ``memory_check_s``); [] otherwise."""
        now = self._clock()
        if now < self._due:
            return []
        self._due = now + self.context.settings.memory_check_s
        return self.read()

    def read(self) -> list[FaultEvent]:
        """Read every GPU now; the conditions not reported before, as fault events."""
        events = []
        t_ms = int(time.time() * 1000)
        for gpu in list(self.context.inventory.gpus):
            try:
                repairs = self.context.backend.memory_repairs(gpu.uuid)
            except GpuLost:
                continue  # the backend queued its gpu_lost event
            except GpuBackendError as err:
                log.warning("memory repair state of GPU %s not read: %s", gpu.uuid, err)
                continue
            faults = repairs.faults()
            before = self._seen.get(gpu.uuid, set())
            self._seen[gpu.uuid] = {kind for kind, _ in faults}
            for kind, detail in faults:
                if kind not in before:
                    log.error("GPU %s on %s: %s: %s", gpu.uuid, self.context.host, kind, detail)
                    events.append(FaultEvent(gpu.uuid, kind, detail, t_ms))
        return events
