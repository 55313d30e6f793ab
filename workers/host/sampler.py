"""The telemetry loop: every tick, sample each GPU and stream it, then each sandbox's device
to the sandbox's group; fold everything into the minute's rollups, run the alert rules and
the fault checks, keep the newest samples for /metrics, and ship batch output."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, cast

from redis.asyncio import Redis as AsyncRedis

from wire import config
from wire.messages import MinuteRollup, to_control
from wire.spec import SandboxSpec
from wire.telemetry import (
    FLEET_GROUP,
    AlertMessage,
    GpuSampleMessage,
    SandboxFigures,
    fleet_message,
    gpu_group,
    sandbox_group,
)
from workers.alerts import AlertTracker
from workers.batch_output import OutputPump
from workers.gpu.base import GpuBackend, GpuBackendError, GpuLost, GpuSample
from workers.host.faults import GpuFaults
from workers.host.inventory import HostInventory
from workers.host.lifecycle import now_ms
from workers.host.reports import HostReports
from workers.host.sandboxes import HostSandboxes
from workers.host.utilization import UtilizationWindows
from workers.rollups import MinuteRollups
from workers.telemetry import make_layer, publish, sample_message, store_latest

log = logging.getLogger(__name__)
FLEET_EVERY = 5  # the fleet group gets one sample in five


class Sampler:
    def __init__(
        self,
        host: str,
        backend: GpuBackend,
        sandboxes: HostSandboxes,
        inventory: HostInventory,
        reports: HostReports,
        faults: GpuFaults,
        alerts: AlertTracker,
        utilization: UtilizationWindows,
        output: OutputPump,
    ) -> None:
        self.host = host
        self.backend = backend
        self.sandboxes = sandboxes
        self.inventory = inventory
        self.reports = reports
        self.faults = faults
        self.alerts = alerts
        self.utilization = utilization
        self.output = output
        self.rollups = MinuteRollups()
        self.stopping = threading.Event()

    async def sample_forever(self, interval_s: float, heartbeat_s: float) -> None:
        layer = make_layer(config.redis_url())
        latest = AsyncRedis.from_url(config.redis_url())
        tick = 0
        next_beat = 0.0
        while not self.stopping.is_set():
            started = time.monotonic()
            if started >= next_beat:
                next_beat = started + heartbeat_s
                try:
                    await asyncio.to_thread(self.reports.heartbeat)
                except Exception:  # the broker refused it: the next beat tries again
                    log.exception("heartbeat not sent")
            try:
                closed = self.close_minute()
                if closed is not None:
                    rollup = cast(MinuteRollup, closed)  # until workers/rollups.py returns one
                    await asyncio.to_thread(to_control.telemetry_host_rollups, [(self.host, rollup)])
                await self.publish_all(layer, tick, latest)
            except Exception:  # a bug must not stop the stream for good
                log.exception("sampling failed")
            tick += 1
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    def close_minute(self) -> dict[str, Any] | None:
        """Before each tick's samples: the minute of rollups that ended, if one did, for the
        caller to send (a process serving many hosts sends a round of them together)."""
        return self.rollups.roll(now_ms())

    async def publish_all(self, layer: Any, tick: int, latest: Any) -> None:
        running = self.sandboxes.specs()
        t_ms = now_ms()
        parent_of = self.inventory.parent_of()
        # Every GPU and every sandbox's device, each once (a dedicated sandbox's device is
        # its GPU), each on its own: a lost GPU stops neither the others nor the fault
        # report that says it is lost.
        samples = TickSamples(self.backend, parent_of)
        newest: list[GpuSampleMessage] = []
        changes: list[AlertMessage] = []
        for gpu in list(self.inventory.gpus):
            sample = samples.get(gpu.uuid)
            if sample is None:
                continue  # lost or failed this tick
            devices = {gpu.uuid} | {m.uuid for m in gpu.mig_devices}
            figures = {
                str(spec.sandbox_id): SandboxFigures(
                    mem_mib=self.reports.memory_of(sample, key), util_pct=sample.util_pct
                )
                for key, spec in running.items()
                if set(spec.device_uuids) & devices
            }
            message = sample_message(
                sample, self.host, self.backend.simulated, figures, self.faults.last_xid.get(gpu.uuid, 0)
            )
            await publish(layer, gpu_group(gpu.uuid), message)
            newest.append(message)
            self.rollups.add_gpu(message)
            changes += self.alerts.observe_gpu(message, t_ms)
        self._drop_lost(samples)
        if tick % FLEET_EVERY == 0 and newest:
            # The fleet gets the host's GPUs as one message: a burst of one per GPU would queue
            # behind each other in every fleet watcher's channel and age the GPU streams too.
            await publish(layer, FLEET_GROUP, fleet_message(self.host, t_ms, list(newest)))
        changes += await asyncio.to_thread(self.faults.report, running, changes, parent_of)
        changes += await self._publish_sandboxes(layer, running, samples, parent_of, newest, t_ms)
        self._drop_lost(samples)
        live = {f"gpu:{g.uuid}" for g in self.inventory.gpus} | {f"gpu:{u}" for u in self.faults.lost}
        live |= {f"sandbox:{s.sandbox_id}" for s in running.values()}
        changes += self.alerts.forget(live, t_ms)
        await store_latest(latest, self.host, newest)
        for piece in await asyncio.to_thread(self.output.collect, running):
            await publish(layer, sandbox_group(piece["sandbox"]), piece)
        if changes:
            await self._publish_alerts(layer, changes)

    async def _publish_sandboxes(
        self,
        layer: Any,
        running: dict[str, SandboxSpec],
        samples: TickSamples,
        parent_of: dict[str, str],
        newest: list[GpuSampleMessage],
        t_ms: int,
    ) -> list[AlertMessage]:
        """Each sandbox's device to its group; its utilization window, rollups and alerts."""
        by_device: dict[str, list[tuple[str, SandboxSpec]]] = {}
        for key, spec in running.items():
            for device in spec.device_uuids:
                by_device.setdefault(device, []).append((key, spec))
        changes: list[AlertMessage] = []
        for device, holders in by_device.items():
            gpu_uuid = parent_of.get(device, device)
            device_sample = samples.get(device)
            if device_sample is None:
                continue  # its GPU is lost, or its sample failed this tick
            for key, spec in holders:
                self.utilization.note(key, t_ms, device_sample.util_pct)
                own_figures = SandboxFigures(
                    mem_mib=self.reports.memory_of(device_sample, key), util_pct=device_sample.util_pct
                )
                own = sample_message(
                    device_sample,
                    self.host,
                    self.backend.simulated,
                    {str(spec.sandbox_id): own_figures},
                    self.faults.last_xid.get(gpu_uuid, 0),
                    parent_of.get(device, ""),
                )
                await publish(layer, sandbox_group(spec.sandbox_id), own)
                if device != spec.device_uuids[0]:
                    continue  # a multi-GPU sandbox is rolled up and judged by its first GPU
                self.rollups.add_sandbox(str(spec.sandbox_id), own_figures, own)
                limit = spec.mps.memory_mib if spec.mps else device_sample.mem_total_mib
                changes += self.alerts.observe_sandbox(
                    spec.sandbox_id, spec.tier, gpu_uuid, own, own_figures["mem_mib"], limit, t_ms
                )
                if device in parent_of:
                    newest.append(own)  # a MIG device's own figures, for /metrics
        return changes

    def _drop_lost(self, samples: TickSamples) -> None:
        for lost in sorted(samples.lost):
            self.faults.gpu_lost(lost)

    async def _publish_alerts(self, layer: Any, changes: list[AlertMessage]) -> None:
        """Live to the subject's groups and the fleet; stored by the control worker."""
        for change in changes:
            groups = {FLEET_GROUP, gpu_group(change["gpu"])}
            if change["sandbox"] is not None:
                groups.add(sandbox_group(change["sandbox"]))
            for group in groups:
                await publish(layer, group, change)
        log.warning("alerts on %s: %s", self.host, [(c["state"], c["message"]) for c in changes])
        await asyncio.to_thread(to_control.telemetry_alerts, self.host, changes)


class TickSamples:
    """One tick's samples, each device's taken when first asked, so a GPU's message leaves as
    soon as its sample is taken (sampling every device first aged each stream by the rest's
    sampling: 16 ms p50 on 64 GPUs instead of 1), and each on its own: a lost GPU goes to
    ``lost`` (drop it, and its MIG devices, until the next inventory; the backend has queued
    its gpu_lost event), any other failure to ``failed`` (skip the device this tick).

    ``parent_of`` (MIG uuid -> GPU uuid) lets a lost GPU's MIG devices go unasked, and drops
    one sampled before its GPU was found lost: its board is gone."""

    def __init__(self, backend: GpuBackend, parent_of: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.parent_of = parent_of or {}
        self._taken: dict[str, GpuSample] = {}
        self.lost: set[str] = set()  # GPU uuids (a MIG device's parent) now gone
        self.failed: dict[str, str] = {}  # device uuid -> why, this tick only

    def get(self, uuid: str) -> GpuSample | None:
        if self.parent_of.get(uuid, uuid) in self.lost or uuid in self.failed:
            return None
        if uuid not in self._taken:
            try:
                self._taken[uuid] = self.backend.sample(uuid)
            except GpuLost as err:
                self.lost.add(err.uuid)
                log.error("GPU %s is lost (%s): no longer sampled", err.uuid, err)
                return None
            except GpuBackendError as err:
                self.failed[uuid] = str(err)
                log.warning("sampling %s failed: %s", uuid, err)
                return None
        return self._taken[uuid]

    @property
    def samples(self) -> dict[str, GpuSample]:
        return {u: s for u, s in self._taken.items() if self.parent_of.get(u, u) not in self.lost}
