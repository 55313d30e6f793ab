"""Shipping batch sandboxes' output: live to their pages, and to the control plane to keep.

Each sampler tick the agent reads what every batch sandbox on this host printed since the
last tick (the driver keeps the last ``SANDBOX_OUTPUT_MAX_BYTES`` of it on disk), publishes
it to the sandbox's group for open pages (``sandbox.output``), and sends it to the control
worker (``sandbox_output``), which keeps the newest ``BATCH_OUTPUT_MAX_BYTES`` per sandbox in
the database. Before a sandbox is stopped its last output is read once more (``flush``): the
driver removes its files on stop.

Offsets count every byte the sandbox wrote; a chunk that starts past where the previous one
ended says the driver dropped the bytes in between (the tenant printed faster than a tick
could carry, or more than the host keeps).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable

from wire.messages import to_control
from wire.spec import SandboxHandle, SandboxSpec
from wire.telemetry import OutputMessage
from workers.drivers.base import DriverError, SandboxDriver
from workers.drivers.output import OutputChunk

log = logging.getLogger(__name__)

MESSAGE_BYTES = 256 * 1024  # one control task or live message at most
TICK_BYTES = 1024 * 1024  # one sandbox's share of a tick: a flood cannot stall the others


class OutputPump:
    def __init__(self, driver: SandboxDriver, find: Callable[[str], SandboxHandle | None]) -> None:
        self.driver = driver
        self.find = find
        self._offsets: dict[str, int] = {}  # allocation id -> bytes shipped
        self._lock = threading.Lock()

    def collect(self, running: dict[str, SandboxSpec]) -> list[OutputMessage]:
        """Read every running batch's new output, send it to control; the live messages."""
        messages: list[OutputMessage] = []
        batches = {key: spec for key, spec in running.items() if spec.batch}
        with self._lock:
            for gone in set(self._offsets) - set(batches):
                self._offsets.pop(gone, None)
        for key, spec in batches.items():
            handle = self.find(key)
            if handle is not None:
                messages += self._ship(spec.sandbox_id, key, handle, TICK_BYTES)
        return messages

    def flush(self, spec: SandboxSpec | None, handle: SandboxHandle) -> list[OutputMessage]:
        """Everything a batch printed that was not shipped yet (before its stop)."""
        if spec is None or not spec.batch:
            return []
        return self._ship(spec.sandbox_id, handle.allocation_key, handle, None)

    def _ship(
        self, sandbox_id: int, allocation_key: str, handle: SandboxHandle, budget: int | None
    ) -> list[OutputMessage]:
        messages: list[OutputMessage] = []
        with self._lock:
            offset = self._offsets.get(allocation_key, 0)
        while budget is None or budget > 0:
            try:
                chunk = self.driver.read_output(handle, offset, MESSAGE_BYTES)
            except (DriverError, OSError) as exc:
                log.warning("output of %s unreadable: %s", allocation_key, exc)
                break
            if not chunk.data and chunk.start <= offset:
                break
            messages.append(self._send(sandbox_id, allocation_key, offset, chunk))
            offset = max(offset, chunk.end)
            if budget is not None:
                budget -= max(1, len(chunk.data))
            if not chunk.data:
                break
        with self._lock:
            self._offsets[allocation_key] = offset
        return messages

    @staticmethod
    def _send(sandbox_id: int, allocation_key: str, offset: int, chunk: OutputChunk) -> OutputMessage:
        to_control.sandbox_output(
            allocation_key, chunk.start, base64.b64encode(chunk.data).decode(), chunk.total
        )
        return OutputMessage(
            type="sandbox.output",
            sandbox=sandbox_id,
            start=chunk.start,
            end=chunk.end,
            text=chunk.data.decode("utf-8", errors="replace"),
            dropped=max(0, chunk.start - offset),
        )
