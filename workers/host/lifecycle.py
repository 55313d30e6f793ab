"""Launching and stopping sandboxes from self-contained specs, and what each reports."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from wire.messages import to_control
from wire.spec import DRIVER_ISOLATION, SandboxHandle, SandboxSpec
from workers.drivers.base import DriverError, KeepsEndTimes
from workers.drivers.simulated import simulated_load
from workers.host.checkpoint import run_checkpoint_hook
from workers.host.context import HostContext
from workers.host.storage_meter import StorageMeter

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


class SandboxLifecycle:
    """Launches and stops the sandboxes of one host; after a stop, its storage meter
    reports what the sandbox's volumes hold."""

    def __init__(self, context: HostContext, meter: StorageMeter) -> None:
        self.context = context
        self.meter = meter

    def launch(self, spec: SandboxSpec) -> None:
        box = self.context.sandboxes
        with box.lock:
            if spec.allocation_key in box.stopped:
                log.info("launch of %s ignored: it was stopped already", spec.allocation_key)
                return
        gives = DRIVER_ISOLATION.get(self.context.driver.name)
        if spec.isolation and gives and spec.isolation != gives:
            # The scheduler places by isolation level; a mismatch means a stale or forged
            # message, and running it anyway would give weaker isolation than was asked for.
            self._failed(spec, f"host {self.context.host} runs {gives} sandboxes, not {spec.isolation}")
            return
        # A share on a device whose MPS server recovers from a fault waits for it: started now,
        # its CUDA would fail with 807 (workers.gpu.mps_recovery).
        refusal = self._wait_for_mps(spec)
        if refusal:
            self._failed(spec, refusal)
            return
        # Before the driver: its GPU's MPS daemon up for a share, down for anything else. A
        # repeated launch of what runs or is being launched claims nothing (``claim.new``), so
        # its failure leaves the first copy's claim alone.
        claim = self.context.mps_daemons.claim(spec)
        if claim.refusal:
            self._failed(spec, claim.refusal)
            return
        if spec.mps is not None and not spec.mps.pipe_dir and spec.device_uuids:
            pipe = self.context.mps_daemons.control.pipe_dir(spec.device_uuids[0])
            spec = dataclasses.replace(spec, mps=dataclasses.replace(spec.mps, pipe_dir=str(pipe)))
        with box.lock:
            box.launching[spec.allocation_key] = spec.sandbox_id
        try:
            self.context.driver.prepare(
                spec, lambda line: to_control.launch_progress(spec.allocation_key, line)
            )
            handle = self.context.driver.launch(spec)
        except BaseException as exc:  # a refusal (reported) or a bug (the task fails)
            with box.lock:
                box.launching.pop(spec.allocation_key, None)
            if claim.new:
                self.context.mps_daemons.release(spec.allocation_key)
            if not isinstance(exc, DriverError):
                raise
            self._failed(spec, str(exc))
            return
        started = self.context.driver.status(handle).started_at_ms or now_ms()
        with box.lock:
            box.launching.pop(spec.allocation_key, None)  # the driver lists it from now on
            stopped_meanwhile = spec.allocation_key in box.stopped
            if not stopped_meanwhile:
                box.running[spec.allocation_key] = spec
                box.handles[spec.allocation_key] = handle
        if stopped_meanwhile:  # the stop overtook this launch: undo it, report nothing
            self.context.driver.stop(handle, grace_s=0)
            self.context.mps_daemons.release(spec.allocation_key)
            return
        if spec.device_uuids:  # a CPU-only sandbox loads no GPU
            mem, util = self._simulated_load(spec)
            self.context.backend.note_load(spec.allocation_key, list(spec.device_uuids), mem, util)
        to_control.sandbox_launched(spec.allocation_key, handle.to_json(), started)

    def stop(self, allocation_key: str, handle_json: Mapping[str, Any] | None) -> None:
        handle = SandboxHandle.from_json(handle_json) if handle_json else self.find(allocation_key)
        spec = self.stop_quietly(allocation_key, handle)
        driver = self.context.driver
        ended = driver.ended_at_ms(handle) if handle and isinstance(driver, KeepsEndTimes) else None
        to_control.sandbox_stopped(allocation_key, ended or now_ms())
        if spec is not None:  # what its volumes hold now: after the stop's report, never delaying it
            self.meter.report(spec)

    def warn(self, allocation_key: str, handle_json: Mapping[str, Any] | None, stop_at: float) -> None:
        """A preemption's warning, before the stop the control worker sends at ``stop_at``
        (epoch seconds): the checkpoint hook first, while the job is whole, given at most half
        the time left so the job still has the rest after its SIGTERM; then the driver's
        warning (SIGTERM). Reports what was done."""
        handle = SandboxHandle.from_json(handle_json) if handle_json else self.find(allocation_key)
        if handle is None:
            to_control.sandbox_warned(allocation_key, "no such sandbox on the host")
            return
        left = max(0.0, stop_at - time.time())
        timeout = max(1.0, min(float(self.context.settings.checkpoint_timeout_s), left / 2))
        why = {
            "GPUSHARE_CHECKPOINT_REASON": "preemption",
            "GPUSHARE_STOP_AT": str(int(stop_at)),
            "GPUSHARE_STOP_IN_S": str(int(left)),
        }
        hook = run_checkpoint_hook(handle, self.context.settings.checkpoint_hook, timeout, why)
        try:
            signalled = self.context.driver.warn(handle)
        except DriverError as exc:
            signalled = f"could not signal it: {exc}"
        said = "no checkpoint hook" if hook is None else hook[1]
        to_control.sandbox_warned(allocation_key, f"{said}; {signalled}")

    def stop_quietly(self, allocation_key: str, handle: SandboxHandle | None) -> SandboxSpec | None:
        """Stop a sandbox and forget it, reporting nothing: ``stop`` reports the stop, a fleet
        plan's report says it stopped (and the control plane relaunches it elsewhere). Returns
        its spec, when this agent launched it."""
        box = self.context.sandboxes
        with box.lock:
            box.stopped.add(allocation_key)  # a late launch must not revive it
            spec = box.running.get(allocation_key)
        if handle is not None:
            self.context.output.flush(spec, handle)  # a batch's last lines, before its files go
            self.context.driver.stop(handle, grace_s=self.context.settings.stop_grace_s)
        # Its processes are gone: the last share on a GPU that follows demand stops its daemon.
        self.context.mps_daemons.release(allocation_key)
        self.context.backend.forget_load(allocation_key)
        with box.lock:
            box.running.pop(allocation_key, None)
            box.handles.pop(allocation_key, None)
        self.context.utilization.forget(allocation_key)
        return spec

    def find(self, allocation_key: str) -> SandboxHandle | None:
        return next((h for h in self.context.driver.list_owned() if h.allocation_key == allocation_key), None)

    def _wait_for_mps(self, spec: SandboxSpec) -> str:
        """Hold an MPS share while its device's server recovers from a fault (bounded); why it
        cannot start, or "". Meanwhile its heartbeat lists it as being launched, so the control
        plane waits rather than resends it."""
        recovery = self.context.mps_recovery
        if spec.mps is None or not spec.device_uuids or not recovery.holds(spec.device_uuids[0]):
            return ""  # the common case: nothing to wait for, and nothing registered early
        device, key = spec.device_uuids[0], spec.allocation_key
        box = self.context.sandboxes
        with box.lock:
            box.launching[key] = spec.sandbox_id
        try:
            return recovery.wait_until_accepting(device, lambda line: to_control.launch_progress(key, line))
        finally:
            with box.lock:
                box.launching.pop(key, None)  # set again just before the driver, as for every launch

    def _failed(self, spec: SandboxSpec, message: str) -> None:
        to_control.sandbox_launch_failed(spec.sandbox_id, spec.allocation_key, message)

    def _simulated_load(self, spec: SandboxSpec) -> tuple[int, float]:
        """What a sandbox puts on a simulated GPU (``workers.drivers.simulated.simulated_load``:
        its command may choose it); real backends measure it instead."""
        device_mib = self.context.inventory.device_memory_mib(spec.device_uuids[0])
        try:
            return simulated_load(spec, device_mib)
        except DriverError:  # an unreadable choice, on a driver that did not refuse it: the default
            return simulated_load(dataclasses.replace(spec, command=()), device_mib)
