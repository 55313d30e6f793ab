"""The telemetry loop: every tick, sample each GPU and stream it, then each sandbox's device
to the sandbox's group; fold everything into the minute's rollups, run the alert rules and
the fault checks, keep the newest samples for /metrics, and ship batch output.

A sandbox's own figures (``SandboxFigures``): the memory its processes hold, and the
utilization of its device when the device is its own. On a shared GPU (an MPS share or a
time-slice replica: ``spec.mps`` or ``spec.memory_share`` set) the device's utilization is
everyone's, so its utilization is its own processes' (``HostReports.util_of``), or None
where the device cannot measure that (unmeasured, as for MIG: never its neighbours'
figure). Those figures go everywhere the sandbox is shown or judged: its group's samples
(its chart), the GPU's samples kept for /metrics, its rollups (the used/idle split of its
bill), its utilization window (idle culling) and its alerts; and, on a shared GPU, its
memory is watched against its share (``ShareWatch``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from wire import config
from wire.messages import MinuteRollup, OverShareReport, to_control
from wire.spec import SandboxSpec
from wire.telemetry import (
    AlertMessage,
    GpuSampleMessage,
    SandboxFigures,
    fleet_group,
    fleet_message,
    gpu_group,
    host_sandbox_group,
)
from workers.gpu.base import GpuBackend, GpuBackendError, GpuLost, GpuNotSampled, GpuSample
from workers.host.context import HostContext
from workers.host.faults import GpuFaults
from workers.host.lifecycle import now_ms
from workers.host.reports import HostReports
from workers.host.rollups import MinuteRollups
from workers.host.share_watch import ShareWatch
from workers.host.telemetry import make_layer, publish, sample_message, store_latest

log = logging.getLogger(__name__)
FLEET_EVERY = 5  # the fleet group gets one sample in five
ROLLUPS_PER_MESSAGE = 250  # a minute's rollups of every host of a pool, in a few messages


async def tick_forever(
    samplers: Sequence[Sampler],
    interval_s: float,
    stopping: threading.Event,
    beat: Callable[[], None] | None = None,
    heartbeat_s: float = 0.0,
) -> None:
    """The telemetry loop of one host's agent or of a pool of them: every ``interval_s``,
    close each host's minute of rollups and send those that ended (a pool's together, in
    messages of ``ROLLUPS_PER_MESSAGE``), then sample and publish each host. A one-host
    agent also ``beat``s from here every ``heartbeat_s``; a pool beats on its own thread,
    one round for all its hosts."""
    layer = make_layer(config.redis_url())
    latest = AsyncRedis.from_url(config.redis_url())
    tick = 0
    next_beat = 0.0
    while not stopping.is_set():
        started = time.monotonic()
        if beat is not None and started >= next_beat:
            next_beat = started + heartbeat_s
            try:
                await asyncio.to_thread(beat)
            except Exception:  # the broker refused it: the next beat tries again
                log.exception("heartbeat not sent")
        closed: list[tuple[str, MinuteRollup]] = []
        for sampler in samplers:
            try:
                minute = sampler.close_minute()
            except Exception:  # one host's bug must not stop the others' streams
                log.exception("closing the minute of %s failed", sampler.host)
                continue
            if minute is not None:
                closed.append((sampler.host, minute))
        try:
            for start in range(0, len(closed), ROLLUPS_PER_MESSAGE):
                rollups = closed[start : start + ROLLUPS_PER_MESSAGE]
                await asyncio.to_thread(to_control.telemetry_host_rollups, rollups)
        except Exception:  # the broker refused them: the live streams still go
            log.exception("rollups not sent")
        for sampler in samplers:
            try:
                await sampler.publish_all(layer, tick, latest)
            except Exception:  # a bug must not stop the stream for good, nor the others'
                log.exception("sampling %s failed", sampler.host)
        tick += 1
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


class Sampler:
    """One host's telemetry: its samples streamed, folded into rollups, judged by the alert
    rules and the fault checks each tick (``tick_forever`` drives it)."""

    def __init__(self, context: HostContext, reports: HostReports, faults: GpuFaults) -> None:
        self.context = context
        self.host = context.host
        self.reports = reports
        self.faults = faults
        self.rollups = MinuteRollups()
        self.share_watch = ShareWatch()
        self.stopping = threading.Event()

    async def sample_forever(self, interval_s: float, heartbeat_s: float) -> None:
        """This host alone, beating every ``heartbeat_s``."""
        await tick_forever([self], interval_s, self.stopping, self.reports.heartbeat, heartbeat_s)

    def close_minute(self) -> MinuteRollup | None:
        """Before each tick's samples: the minute of rollups that ended, if one did, for the
        caller to send (a process serving many hosts sends a round of them together)."""
        return self.rollups.roll(now_ms())

    async def publish_all(self, layer: Any, tick: int, latest: Any) -> None:
        running = self.context.sandboxes.specs()
        t_ms = now_ms()
        parent_of = self.context.inventory.parent_of()
        # Every GPU and every sandbox's device, each once (a dedicated sandbox's device is
        # its GPU), each on its own: a lost GPU stops neither the others nor the fault
        # report that says it is lost.
        samples = TickSamples(self.context.backend, parent_of)
        newest: list[GpuSampleMessage] = []
        changes: list[AlertMessage] = []
        for gpu in list(self.context.inventory.gpus):
            sample = samples.get(gpu.uuid)
            if sample is None:
                continue  # lost or failed this tick
            devices = {gpu.uuid} | {m.uuid for m in gpu.mig_devices}
            figures = {
                str(spec.sandbox_id): self._figures(sample, key, spec)
                for key, spec in running.items()
                if set(spec.device_uuids) & devices
            }
            message = sample_message(
                sample,
                self.host,
                self.context.backend.simulated,
                figures,
                self.faults.last_xid.get(gpu.uuid, 0),
            )
            await publish(layer, gpu_group(self.host, gpu.uuid), message)
            newest.append(message)
            self.rollups.add_gpu(message)
            changes += self.context.alerts.observe_gpu(message, t_ms)
        self._drop_lost(samples)
        if tick % FLEET_EVERY == 0 and newest:
            # The fleet gets the host's GPUs as one message: a burst of one per GPU would queue
            # behind each other in every fleet watcher's channel and age the GPU streams too.
            await publish(layer, fleet_group(self.host), fleet_message(self.host, t_ms, list(newest)))
        changes += await asyncio.to_thread(self.faults.report, running, changes, parent_of)
        changes += await self._publish_sandboxes(layer, running, samples, parent_of, newest, t_ms)
        self._drop_lost(samples)
        live = {f"gpu:{g.uuid}" for g in self.context.inventory.gpus} | {f"gpu:{u}" for u in self.faults.lost}
        live |= {f"sandbox:{s.sandbox_id}" for s in running.values()}
        changes += self.context.alerts.forget(live, t_ms)
        await store_latest(latest, self.host, newest)
        for piece in await asyncio.to_thread(self.context.output.collect, running):
            await publish(layer, host_sandbox_group(self.host, piece["sandbox"]), piece)
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
        over_share: list[OverShareReport] = []
        for device, holders in by_device.items():
            gpu_uuid = parent_of.get(device, device)
            device_sample = samples.get(device)
            if device_sample is None:
                continue  # its GPU is lost, or its sample failed this tick
            for key, spec in holders:
                own_figures = self._figures(device_sample, key, spec)
                self.context.utilization.note(key, t_ms, own_figures["util_pct"])
                own = sample_message(
                    device_sample,
                    self.host,
                    self.context.backend.simulated,
                    {str(spec.sandbox_id): own_figures},
                    self.faults.last_xid.get(gpu_uuid, 0),
                    parent_of.get(device, ""),
                )
                await publish(layer, host_sandbox_group(self.host, spec.sandbox_id), own)
                over_share += self.share_watch.observe(spec, device, own_figures["mem_mib"], t_ms)
                if device != spec.device_uuids[0]:
                    continue  # a multi-GPU sandbox is rolled up and judged by its first GPU
                self.rollups.add_sandbox(str(spec.sandbox_id), own_figures, own)
                judged = own.copy()
                judged["util_pct"] = own_figures["util_pct"]  # its utilization alert: its own figure
                changes += self.context.alerts.observe_sandbox(
                    spec.sandbox_id,
                    spec.tier,
                    gpu_uuid,
                    judged,
                    own_figures["mem_mib"],
                    _memory_limit(spec, device_sample),
                    t_ms,
                )
                if device in parent_of:
                    newest.append(own)  # a MIG device's own figures, for /metrics
        self.share_watch.forget(running)
        await self._send_over_share(over_share)
        return changes

    def _figures(self, sample: GpuSample, allocation_key: str, spec: SandboxSpec) -> SandboxFigures:
        """A sandbox's own figures on the device ``sample`` is of (see the module's docstring)."""
        util = self.reports.util_of(sample, allocation_key) if _shared(spec) else sample.util_pct
        return SandboxFigures(mem_mib=self.reports.memory_of(sample, allocation_key), util_pct=util)

    async def _send_over_share(self, reports: list[OverShareReport]) -> None:
        """Each to the control worker; one the broker refused is sent again on a later tick."""
        for report in reports:
            try:
                await asyncio.to_thread(to_control.sandbox_over_share, self.host, report)
            except Exception:
                log.exception("over-share report for sandbox %s not sent", report["sandbox_id"])
                self.share_watch.unsent(report)
            else:
                log.warning(
                    "sandbox %s on %s: %s (%d MiB of a %d MiB share)",
                    report["sandbox_id"],
                    report["gpu"],
                    report["action"],
                    report["mem_mib"],
                    report["share_mib"],
                )

    def _drop_lost(self, samples: TickSamples) -> None:
        for lost in sorted(samples.lost):
            self.faults.gpu_lost(lost)

    async def _publish_alerts(self, layer: Any, changes: list[AlertMessage]) -> None:
        """Live to the subject's groups and the fleet; stored by the control worker."""
        for change in changes:
            groups = {fleet_group(self.host), gpu_group(self.host, change["gpu"])}
            if change["sandbox"] is not None:
                groups.add(host_sandbox_group(self.host, change["sandbox"]))
            for group in groups:
                await publish(layer, group, change)
        log.warning("alerts on %s: %s", self.host, [(c["state"], c["message"]) for c in changes])
        await asyncio.to_thread(to_control.telemetry_alerts, self.host, changes)


def _shared(spec: SandboxSpec) -> bool:
    """Whether the sandbox shares its GPU with others (an MPS share, a time-slice replica)."""
    return spec.mps is not None or spec.memory_share is not None


def _memory_limit(spec: SandboxSpec, sample: GpuSample) -> int:
    """What the sandbox may hold on the device, for its memory alert: its share on a shared
    GPU (summed over its processes), its MPS limit, else the device's memory."""
    if spec.memory_share is not None and spec.memory_share.memory_mib > 0:
        return spec.memory_share.memory_mib
    return spec.mps.memory_mib if spec.mps else sample.mem_total_mib


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
            except GpuNotSampled as err:  # e.g. a Slurm node without its monitor: every tick
                self.failed[uuid] = str(err)
                return None
            except GpuBackendError as err:
                self.failed[uuid] = str(err)
                log.warning("sampling %s failed: %s", uuid, err)
                return None
        return self._taken[uuid]

    @property
    def samples(self) -> dict[str, GpuSample]:
        return {u: s for u, s in self._taken.items() if self.parent_of.get(u, u) not in self.lost}
