"""A sandbox driver that keeps state only: simulated hosts at a real cluster's size.

A launch records the sandbox and returns; nothing runs. The openb cluster twin serves 1,213
simulated hosts from one machine, where a container or a bubblewrap process per sandbox
would not fit, and its simulated GPUs have nothing for a program to run on anyway. Every
other part of the platform (placement, reconcile, billing, telemetry, pages) sees these
sandboxes as it sees real ones; the pages badge them "simulated sandboxes" as they badge
simulated GPUs (``Host.simulated_sandboxes``).

The record survives an agent's restart in one small JSON file per host, rewritten at each
change, as a Docker container outlives its agent: a restarted agent still reports what it
runs, so reconcile does not fail its sandboxes as vanished.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from wire.relay import Terminal
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers.base import DriverError, SandboxStatus
from workers.drivers.output import OutputChunk

STATE_FILE = "simulated-sandboxes.json"


class SimulatedDriver:
    name = "simulated"
    storage_dir = None  # runs nothing, so mounts nothing

    def __init__(self, state_dir: Path, host: str = "") -> None:
        self.host = host
        state_dir.mkdir(parents=True, exist_ok=True)
        self._path = state_dir / STATE_FILE
        self._lock = threading.Lock()
        # allocation id -> (its handle, when it was launched in ms)
        self._sandboxes: dict[str, tuple[SandboxHandle, int]] = {}
        self._load()

    def prepare(self, spec: SandboxSpec, report: Callable[[str], None]) -> None:
        """Nothing to fetch: a simulated sandbox runs no image."""

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        """Idempotent, keyed by the allocation: a repeated launch returns the same handle."""
        with self._lock:
            known = self._sandboxes.get(spec.allocation_key)
            if known is not None:
                return known[0]
            ref = f"sim-{spec.allocation_key}"
            handle = SandboxHandle(self.name, spec.allocation_key, spec.sandbox_id, ref)
            self._sandboxes[spec.allocation_key] = (handle, int(time.time() * 1000))
            self._save()
            return handle

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        with self._lock:
            if self._sandboxes.pop(handle.allocation_key, None) is not None:
                self._save()

    def warn(self, handle: SandboxHandle) -> str:
        return "simulated: it keeps its state only, no process to signal"

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        with self._lock:
            known = self._sandboxes.get(handle.allocation_key)
        if known is None:
            return SandboxStatus(state="missing")
        return SandboxStatus(state="running", started_at_ms=known[1])

    def list_owned(self) -> list[SandboxHandle]:
        with self._lock:
            return [handle for handle, _ in self._sandboxes.values()]

    def open_app(self, handle: SandboxHandle) -> Terminal:
        raise DriverError(f"sandbox {handle.sandbox_id} is simulated: no app runs in it")

    def exec_terminal(self, handle: SandboxHandle) -> Terminal:
        raise DriverError(
            f"sandbox {handle.sandbox_id} is simulated (host {self.host or '?'} keeps its state only): "
            "nothing runs in it to open a terminal into"
        )

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        return OutputChunk(start=offset, data=b"", total=offset)  # nothing runs, nothing is written

    def _load(self) -> None:
        try:
            records = json.loads(self._path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise DriverError(f"unreadable simulated sandbox state {self._path}: {exc}") from exc
        for record in records:
            handle = SandboxHandle.from_json(record["handle"])
            self._sandboxes[handle.allocation_key] = (handle, int(record["started_at_ms"]))

    def _save(self) -> None:
        records = [
            {"handle": handle.to_json(), "started_at_ms": started}
            for handle, started in self._sandboxes.values()
        ]
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.replace(self._path)  # atomic: a crash never leaves half a state file
