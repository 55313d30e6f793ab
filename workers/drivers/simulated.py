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

What a simulated sandbox puts on its simulated GPU (``simulated_load``) is a steady load by
default; its command can choose one instead, so a scenario can have a busy and an idle
tenant on one shared GPU, or a tenant over its memory share (a batch's command, typed in the
request form): ``gpushare-sim-load util=<0..100> mem_mib=<MiB per device>``, either word
optional. Nothing runs it: the word is read here, and only here.
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
SIM_LOAD_COMMAND = "gpushare-sim-load"


def chosen_load(command: tuple[str, ...]) -> tuple[int | None, float | None]:
    """(memory MiB per device, utilization %) a ``gpushare-sim-load`` command asks for; None
    for what it leaves to the default, both None for any other command. Raises DriverError
    naming the bad word."""
    if not command or command[0].rsplit("/", 1)[-1] != SIM_LOAD_COMMAND:
        return None, None
    mem: int | None = None
    util: float | None = None
    usage = f"{SIM_LOAD_COMMAND} util=<0..100> mem_mib=<MiB per device>"
    for word in command[1:]:
        name, _, value = word.partition("=")
        try:
            if name == "util" and 0 <= float(value) <= 100:
                util = float(value)
                continue
            if name == "mem_mib" and int(value) >= 0:
                mem = int(value)
                continue
        except ValueError:
            pass
        raise DriverError(f"{SIM_LOAD_COMMAND}: cannot read {word!r}; say {usage}")
    return mem, util


def simulated_load(spec: SandboxSpec, device_memory_mib: int) -> tuple[int, float]:
    """(memory MiB per device, utilization %) a sandbox puts on a simulated GPU: what its
    command chose (``chosen_load``), else a busy sandbox holding most of what it may hold:
    its memory share (a time-slice replica, an MPS share), its MPS limit, or 40 % of its
    device, so that by default no share is exceeded and no memory alert is raised."""
    mem, util = chosen_load(spec.command)
    if spec.memory_share is not None:
        default_mem = int(spec.memory_share.memory_mib * 0.8)
    elif spec.mps is not None:
        default_mem = int(spec.mps.memory_mib * 0.8)
    else:
        default_mem = int(device_memory_mib * 0.4)
    # An MPS share runs on its share of the threads.
    default_util = float(spec.mps.thread_pct) * 0.9 if spec.mps is not None else 85.0
    return (default_mem if mem is None else mem), (default_util if util is None else util)


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
        """Idempotent, keyed by the allocation: a repeated launch returns the same handle. A
        ``gpushare-sim-load`` command it cannot read is refused, saying why."""
        chosen_load(spec.command)
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

    def open_ssh(self, handle: SandboxHandle, authorized_keys: list[str]) -> Terminal:
        raise DriverError(f"sandbox {handle.sandbox_id} is simulated: no SSH server runs in it")

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
