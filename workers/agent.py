"""The host agent: tasks on ``host.<name>``, a sampler and a heartbeat. No ORM here.

It launches and stops sandboxes from self-contained specs, streams GPU samples to the
channel layer and reports everything else to the control queue. Run it with
``GPUSHARE_ROLE=agent GPUSHARE_HOST=<name> celery -A workers worker -Q host.<name> -P threads``
(threads: the tasks and the sampler share one backend and one picture of the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from celery import signals
from redis.asyncio import Redis as AsyncRedis

from portal.billing.pricing import cost_micros
from portal.env import env_bool, env_int, env_str
from workers import config, dispatch, liveness, moves, selftest, terminal_relay
from workers.alerts import AlertTracker
from workers.batch_output import OutputPump
from workers.celery import app
from workers.drivers import DRIVER_ISOLATION, DriverUnavailable, make_driver
from workers.drivers.base import DriverError, SandboxDriver, SandboxHandle, SandboxSpec
from workers.gpu import make_backend
from workers.gpu.base import GpuBackend, GpuInfo, GpuSample
from workers.gpu.mig import MigManager
from workers.gpu.mps import MpsManager, SimulatedMps, mps_root
from workers.gpu.mps_daemons import MpsDaemons
from workers.rollups import MinuteRollups
from workers.telemetry import (
    FLEET_GROUP,
    AlertMessage,
    GpuSampleMessage,
    SandboxFigures,
    fleet_message,
    gpu_group,
    make_layer,
    publish,
    sample_message,
    sandbox_group,
    store_latest,
)

log = logging.getLogger(__name__)
FLEET_EVERY = 5  # the fleet group gets one sample in five


def _now_ms() -> int:
    return int(time.time() * 1000)


class Agent:
    def __init__(self, host: str, backend: GpuBackend, driver: SandboxDriver, var_dir: Path) -> None:
        self.host = host
        self.backend = backend
        self.driver = driver
        self.var_dir = var_dir
        self.lock = threading.Lock()
        self._redis: redis.Redis | None = None  # liveness key, written with each heartbeat
        self.running: dict[str, SandboxSpec] = {}  # allocation id -> spec
        self.handles: dict[str, SandboxHandle] = {}  # allocation id -> what the driver made
        self.started_ms: dict[str, int] = {}
        self.stopped: set[str] = set()  # allocation ids stopped: a late launch must not revive them
        # Allocation id -> sandbox id of launches under way: a driver lists a sandbox only once
        # it is set up, and a report taken meanwhile must still say it is coming.
        self.launching: dict[str, int] = {}
        self._stop = threading.Event()
        self._gpus: list[GpuInfo] = []
        root = mps_root(host, var_dir)
        # Each GPU's MPS daemon up exactly while MPS shares (or an admin's MPS pin) hold it.
        self.mps_daemons = MpsDaemons(SimulatedMps(root) if backend.simulated else MpsManager(root))
        self.mig = MigManager(backend)
        self._pid_owner: dict[str, str] = {}  # "pid:<host pid>" -> allocation id
        self._reporter = ThreadPoolExecutor(1, thread_name_prefix="agent-report")
        self._report_job: Future[None] | None = None
        self._report_ready: tuple[list[dict[str, Any]], int] | None = None
        self.temp_limit_c = float(env_int("GPU_TEMP_LIMIT_C", 90, minimum=40))
        self.util_window_s = env_int("UTIL_WINDOW_S", 600, minimum=10)
        # allocation id -> (t_ms, utilization %) samples of its devices, oldest first
        self._util: dict[str, deque[tuple[int, float]]] = {}
        self._overheating: set[str] = set()
        self.rollups = MinuteRollups()
        self.alerts = AlertTracker(host)
        self._last_xid: dict[str, int] = {}  # GPU uuid -> the last XID it reported
        self.output = OutputPump(driver, self.handles.get)

    # --- inventory and liveness ------------------------------------------------------------

    def inventory(self) -> list[dict[str, Any]]:
        self._gpus = self.backend.list_gpus()
        return [g.to_json() for g in self._gpus]

    def host_facts(self) -> dict[str, int]:
        """CPU and memory this host offers sandboxes. A simulated host reports the size
        GPUSHARE_SIM_HOST gives it (default 64 cores, 512 GiB), not the machine's own."""
        if self.backend.simulated:
            spec = dict(
                item.split("=", 1)
                for item in env_str("GPUSHARE_SIM_HOST", "cpus=64,memory_gib=512").split(",")
            )
            return {"cpu_cores": int(spec["cpus"]), "memory_mib": int(spec["memory_gib"]) * 1024}
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return {"cpu_cores": os.cpu_count() or 1, "memory_mib": pages // 2**20}

    def report_inventory(self) -> None:
        dispatch.to_control(
            "agent_inventory",
            self.host,
            self.backend.name,
            self.driver.name,
            self.inventory(),
            self.host_facts(),
        )

    def heartbeat(self) -> None:
        """Beat, with the newest finished report of what this host runs.

        The report is built on its own thread: listing sandboxes can block behind a slow
        driver call (libvirt serialises a connection while it defines a domain, ~40 s on a
        host with a root-only /dev/kvm), and a beat held up by it would get a healthy host
        marked lost. A report goes out once, with the time its listing began.
        """
        with self.lock:
            if self._report_job is None or self._report_job.done():
                self._report_job = self._reporter.submit(self._build_report)
            ready, self._report_ready = self._report_ready, None
        owned, owned_ms = ready if ready is not None else (None, None)
        now_ms = _now_ms()
        try:
            liveness.note_alive(self._liveness_redis(), self.host, now_ms)
        except redis.RedisError as exc:  # the beat below still goes (or fails) on its own
            log.warning("liveness not written: %s", exc)
        dispatch.to_control(
            "agent_heartbeat",
            self.host,
            now_ms,
            self.backend.name,
            self.driver.name,
            owned,
            owned_ms,
            self.alerts.version,
        )

    def _liveness_redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(config.redis_url(), socket_timeout=2)
        return self._redis

    def _build_report(self) -> None:
        taken_ms = _now_ms()
        with self.lock:  # before listing: a launch leaves this only once the driver lists it
            launching = dict(self.launching)
        try:
            handles = self.driver.list_owned()  # listed once, for all uses
            self.refresh_pid_owners(handles)
            owned = self.owned_report(handles, launching)
        except DriverError as exc:  # the engine is down: beat anyway, reconcile next time
            log.warning("cannot list sandboxes for the report: %s", exc)
            return
        if all(entry.get("tracked") for entry in owned):
            # Everything that runs here is registered with the daemons (none left to adopt
            # after a restart): a daemon no share holds was left up, and goes.
            self.mps_daemons.sweep(g.uuid for g in self._gpus)
        with self.lock:
            self._report_ready = (owned, taken_ms)

    def refresh_pid_owners(self, handles: list[SandboxHandle]) -> None:
        """Which sandbox each host pid belongs to, for backends (NVML) that report GPU memory
        by process. Drivers without ``pids`` (or failing) leave the memory unattributed."""
        pids_of = getattr(self.driver, "pids", None)
        if pids_of is None or self.backend.simulated:
            return
        owners: dict[str, str] = {}
        with self.lock:
            running = list(self.running)
        for handle in handles:
            if handle.allocation_id in running:
                with contextlib.suppress(DriverError):
                    owners.update({f"pid:{pid}": handle.allocation_id for pid in pids_of(handle)})
        self._pid_owner = owners

    def memory_of(self, sample: GpuSample, allocation_id: str) -> int:
        """MiB of GPU memory a sandbox holds: the backend's figure for it (simulated), or the
        sum over its processes (NVML reports memory by pid)."""
        if allocation_id in sample.mem_by_owner:
            return sample.mem_by_owner[allocation_id]
        return sum(m for k, m in sample.mem_by_owner.items() if self._pid_owner.get(k) == allocation_id)

    def owned_report(
        self, handles: list[SandboxHandle], launching: dict[str, int] | None = None
    ) -> list[dict[str, Any]]:
        """Every sandbox the driver owns on this host (``handles``, found by labels or names,
        so they survive a restart of this agent), with its state and whether this agent
        tracks it; and those still being launched (``launching``), as ``created``: without
        them a report taken during a launch and read once the sandbox runs would call it
        vanished (the driver's start time precedes the report, its listing does not)."""
        with self.lock:
            tracked = set(self.running)
        for gone in set(self._util) - tracked:
            self._util.pop(gone, None)
        report = []
        for handle in handles:
            status = self.driver.status(handle)
            if status.state == "missing":
                continue
            report.append(
                {
                    "allocation_id": handle.allocation_id,
                    "sandbox_id": handle.sandbox_id,
                    "state": status.state,
                    "exit_code": status.exit_code,
                    "reason": status.reason,
                    "started_at_ms": status.started_at_ms,
                    "handle": handle.to_json(),
                    "tracked": handle.allocation_id in tracked,
                    "util": self.util_over_window(handle.allocation_id),
                }
            )
        listed = {entry["allocation_id"] for entry in report}
        for allocation_id, sandbox_id in (launching or {}).items():
            if allocation_id not in listed:
                report.append(
                    {
                        "allocation_id": allocation_id,
                        "sandbox_id": sandbox_id,
                        "state": "created",
                        "tracked": True,
                    }
                )
        return report

    # --- sandboxes ---------------------------------------------------------------------------

    def launch(self, spec: SandboxSpec) -> None:
        with self.lock:
            if spec.allocation_id in self.stopped:
                log.info("launch of %s ignored: it was stopped already", spec.allocation_id)
                return
        gives = DRIVER_ISOLATION.get(self.driver.name)
        if spec.isolation and gives and spec.isolation != gives:
            # The scheduler places by isolation level; a mismatch means a stale or forged
            # message, and running it anyway would give weaker isolation than was asked for.
            message = f"host {self.host} runs {gives} sandboxes, not {spec.isolation}"
            dispatch.to_control("sandbox_launch_failed", spec.sandbox_id, spec.allocation_id, message)
            return
        # Before the driver: its GPU's MPS daemon up for a share, down for anything else. A
        # repeated launch of what runs or is being launched claims nothing (``claim.new``), so
        # its failure leaves the first copy's claim alone.
        claim = self.mps_daemons.claim(spec)
        if claim.refusal:
            dispatch.to_control("sandbox_launch_failed", spec.sandbox_id, spec.allocation_id, claim.refusal)
            return
        if spec.mps is not None and not spec.mps.pipe_dir and spec.device_uuids:
            pipe = self.mps_daemons.control.pipe_dir(spec.device_uuids[0])
            spec = dataclasses.replace(spec, mps=dataclasses.replace(spec.mps, pipe_dir=str(pipe)))
        with self.lock:
            self.launching[spec.allocation_id] = spec.sandbox_id
        try:
            handle = self.driver.launch(spec)
        except DriverError as exc:
            with self.lock:
                self.launching.pop(spec.allocation_id, None)
            if claim.new:
                self.mps_daemons.release(spec.allocation_id)
            dispatch.to_control("sandbox_launch_failed", spec.sandbox_id, spec.allocation_id, str(exc))
            return
        except BaseException:  # a bug, not a refusal: the task fails, the entry must not stay
            with self.lock:
                self.launching.pop(spec.allocation_id, None)
            if claim.new:
                self.mps_daemons.release(spec.allocation_id)
            raise
        started = self.driver.status(handle).started_at_ms or _now_ms()
        with self.lock:
            self.launching.pop(spec.allocation_id, None)  # the driver lists it from now on
            stopped_meanwhile = spec.allocation_id in self.stopped
            if not stopped_meanwhile:
                self.running[spec.allocation_id] = spec
                self.handles[spec.allocation_id] = handle
                self.started_ms[spec.allocation_id] = started
        if stopped_meanwhile:  # the stop overtook this launch: undo it, report nothing
            self.driver.stop(handle, grace_s=0)
            self.mps_daemons.release(spec.allocation_id)
            return
        if spec.device_uuids:  # a CPU-only sandbox loads no GPU
            mem, util = self._simulated_load(spec)
            self.backend.note_load(spec.allocation_id, list(spec.device_uuids), mem, util)
        dispatch.to_control("sandbox_launched", spec.allocation_id, handle.to_json(), started)

    def stop(self, allocation_id: str, sandbox_id: int, handle_json: dict[str, Any] | None) -> None:
        handle = SandboxHandle.from_json(handle_json) if handle_json else self.find(allocation_id)
        self.stop_quietly(allocation_id, handle)
        dispatch.to_control("sandbox_stopped", allocation_id, _now_ms())

    def stop_quietly(self, allocation_id: str, handle: SandboxHandle | None) -> None:
        """Stop a sandbox and forget it, reporting nothing: ``stop`` reports the stop, a fleet
        plan's report says it stopped (and the control plane relaunches it elsewhere)."""
        with self.lock:
            self.stopped.add(allocation_id)  # a late launch must not revive it
            spec = self.running.get(allocation_id)
        if handle is not None:
            self.output.flush(spec, handle)  # a batch's last lines, before its files go
            self.driver.stop(handle, grace_s=float(env_int("SANDBOX_STOP_GRACE_S", 5, minimum=0)))
        # Its processes are gone: the last share on a GPU that follows demand stops its daemon.
        self.mps_daemons.release(allocation_id)
        self.backend.forget_load(allocation_id)
        with self.lock:
            self.running.pop(allocation_id, None)
            self.handles.pop(allocation_id, None)
            self.started_ms.pop(allocation_id, None)
            self._util.pop(allocation_id, None)

    def open_terminal(self, session: str, allocation_id: str, handle_json: dict[str, Any] | None) -> None:
        """Relay a pty into the sandbox for a browser (see ``workers.terminal_relay``), on a
        thread of its own: a session may last as long as the user types."""
        handle = SandboxHandle.from_json(handle_json) if handle_json else self.find(allocation_id)
        idle_s = float(env_int("TERMINAL_IDLE_S", 900, minimum=10))

        async def serve() -> None:
            layer = make_layer(config.redis_url())
            if handle is None:
                await terminal_relay.refuse(
                    layer, session, f"sandbox {allocation_id} is not on host {self.host}"
                )
                return
            try:
                terminal = await asyncio.to_thread(self.driver.exec_terminal, handle)
            except DriverError as exc:
                await terminal_relay.refuse(layer, session, str(exc))
                return
            reason = await terminal_relay.relay(layer, terminal, session, idle_s)
            log.info("terminal into %s ended: %s", allocation_id, reason)

        threading.Thread(
            target=asyncio.run, args=(serve(),), name=f"terminal-{session[:8]}", daemon=True
        ).start()

    def mig_instances_in_use(self) -> dict[str, str]:
        """MIG uuid -> sandbox id, for every MIG instance a sandbox this agent runs sees."""
        with self.lock:
            specs = list(self.running.values())
        return {d: str(s.sandbox_id) for s in specs for d in s.device_uuids if d.startswith("MIG-")}

    def execute_plan(
        self, plan_id: int, stops: list[dict[str, Any]], mig_plan: dict[str, Any] | None, busy: dict[str, str]
    ) -> None:
        outcome = moves.execute_plan(self, plan_id, stops, mig_plan, busy)
        results, steps, error = outcome.report()
        inventory = None
        if mig_plan is not None:
            inventory = {"backend": self.backend.name, "driver": self.driver.name, "gpus": self.inventory()}
        dispatch.to_control("plan_executed", plan_id, self.host, results, steps, error, inventory)

    def gpu_mode(self, gpu_uuid: str, mode: str) -> None:
        """An admin pinned the GPU (or let it follow demand): only a pin to MPS keeps its
        daemon up between shares."""
        self.mps_daemons.set_pinned(gpu_uuid, mode == "mps")

    def find(self, allocation_id: str) -> SandboxHandle | None:
        return next((h for h in self.driver.list_owned() if h.allocation_id == allocation_id), None)

    def _simulated_load(self, spec: SandboxSpec) -> tuple[int, float]:
        """What a sandbox puts on a simulated GPU; real backends measure it instead."""
        if spec.mps is not None:  # most of its pinned-memory limit, not all of it: no alert
            return int(spec.mps.memory_mib * 0.8), float(spec.mps.thread_pct) * 0.9
        sizes = {g.uuid: g.memory_mib for g in self._gpus}
        sizes.update({m.uuid: m.memory_mib for g in self._gpus for m in g.mig_devices})
        device_mib = sizes.get(spec.device_uuids[0], 8192) if spec.device_uuids else 8192
        return int(device_mib * 0.4), 85.0

    # --- health ------------------------------------------------------------------------------

    def health_events(self, samples: dict[str, GpuSample]) -> list[dict[str, Any]]:
        """The backend's fault events, plus an ``overheat`` when a GPU first crosses the
        temperature limit (again only after it cooled 5 °C below it)."""
        events = [dataclasses.asdict(e) for e in self.backend.health_events()]
        reported = {(e["uuid"], e["kind"]) for e in events}
        for uuid, sample in samples.items():
            if uuid not in self._overheating and sample.temp_c > self.temp_limit_c:
                self._overheating.add(uuid)
                if (uuid, "overheat") not in reported:
                    detail = f"{sample.temp_c:.1f} °C over the {self.temp_limit_c:.0f} °C limit"
                    events.append({"uuid": uuid, "kind": "overheat", "detail": detail, "t_ms": sample.t_ms})
            elif uuid in self._overheating and sample.temp_c < self.temp_limit_c - 5:
                self._overheating.discard(uuid)
        return events

    def report_health(
        self, samples: dict[str, GpuSample], running: dict[str, SandboxSpec]
    ) -> list[AlertMessage]:
        """Faults go to the control worker (it drains the GPU); an XID also raises alerts for
        the GPU and each sandbox on it, and is kept as the GPU's last XID for /metrics."""
        events = self.health_events(samples)
        if not events:
            return []
        log.error("GPU faults on %s: %s", self.host, events)
        dispatch.to_control("gpu_health", self.host, events)
        changes: list[AlertMessage] = []
        parent_of = {m.uuid: g.uuid for g in self._gpus for m in g.mig_devices}
        for event in events:
            if event["kind"] != "xid" or not event.get("xid"):
                continue
            gpu_uuid = parent_of.get(event["uuid"], event["uuid"])
            self._last_xid[gpu_uuid] = int(event["xid"])
            on_gpu = [
                spec.sandbox_id
                for spec in running.values()
                if any(parent_of.get(d, d) == gpu_uuid for d in spec.device_uuids)
            ]
            changes += self.alerts.note_xid(gpu_uuid, int(event["xid"]), int(event["t_ms"]), on_gpu)
        return changes

    # --- telemetry ---------------------------------------------------------------------------

    def figures(
        self, allocation_id: str, spec: SandboxSpec, now_ms: int, mem_mib: int, util_pct: float
    ) -> SandboxFigures:
        elapsed_us = max(0, now_ms - self.started_ms.get(allocation_id, now_ms)) * 1000
        cost = cost_micros(spec.price_per_gpu_hour_micros, spec.milli_gpu, elapsed_us)
        return SandboxFigures(mem_mib=mem_mib, util_pct=util_pct, cost_micros=cost)

    async def sample_forever(self, interval_s: float, heartbeat_s: float) -> None:
        layer = make_layer(config.redis_url())
        latest = AsyncRedis.from_url(config.redis_url())
        tick = 0
        next_beat = 0.0
        while not self._stop.is_set():
            started = time.monotonic()
            if started >= next_beat:
                await asyncio.to_thread(self.heartbeat)
                next_beat = started + heartbeat_s
            try:
                await self._publish_all(layer, tick, latest)
            except Exception:  # a bad sample must not stop the stream for every GPU
                log.exception("sampling failed")
            tick += 1
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    async def _publish_all(self, layer: Any, tick: int, latest: Any) -> None:
        """One tick: sample every GPU, stream it (GPU group, one tick in FLEET_EVERY the
        fleet), then each sandbox's device to its group; fold everything into the minute's
        rollups, run the alert rules, keep the newest samples for /metrics."""
        with self.lock:
            running = dict(self.running)
        now = _now_ms()
        closed = self.rollups.roll(now)
        if closed is not None:
            await asyncio.to_thread(dispatch.to_control, "telemetry_rollups", self.host, closed)
        by_device: dict[str, list[tuple[str, SandboxSpec]]] = {}
        for key, spec in running.items():
            for device in spec.device_uuids:
                by_device.setdefault(device, []).append((key, spec))
        parent_of = {m.uuid: g.uuid for g in self._gpus for m in g.mig_devices}
        samples = {}  # a dedicated sandbox's device is its GPU: sample each device once a tick
        newest: list[GpuSampleMessage] = []
        changes: list[AlertMessage] = []
        for gpu in self._gpus:
            sample = samples[gpu.uuid] = self.backend.sample(gpu.uuid)
            on_gpu = {
                key: spec
                for key, spec in running.items()
                if set(spec.device_uuids) & ({gpu.uuid} | {m.uuid for m in gpu.mig_devices})
            }
            figures = {
                str(spec.sandbox_id): self.figures(
                    key, spec, now, self.memory_of(sample, key), sample.util_pct
                )
                for key, spec in on_gpu.items()
            }
            message = sample_message(
                sample, self.host, self.backend.simulated, figures, self._last_xid.get(gpu.uuid, 0)
            )
            await publish(layer, gpu_group(gpu.uuid), message)
            newest.append(message)
            self.rollups.add_gpu(message)
            changes += self.alerts.observe_gpu(message, now)
        if tick % FLEET_EVERY == 0 and newest:
            # The fleet gets the host's GPUs as one message: a burst of one per GPU would queue
            # behind each other in every fleet watcher's channel and age the GPU streams too.
            await publish(layer, FLEET_GROUP, fleet_message(self.host, now, list(newest)))
        changes += await asyncio.to_thread(self.report_health, samples, running)
        for device, holders in by_device.items():
            device_sample = samples.get(device) or self.backend.sample(device)
            gpu_uuid = parent_of.get(device, device)
            for key, spec in holders:
                self.note_util(key, now, device_sample.util_pct)
                own_figures = self.figures(
                    key, spec, now, self.memory_of(device_sample, key), device_sample.util_pct
                )
                xid = self._last_xid.get(gpu_uuid, 0)
                own = sample_message(
                    device_sample,
                    self.host,
                    self.backend.simulated,
                    {str(spec.sandbox_id): own_figures},
                    xid,
                    parent_of.get(device, ""),
                )
                await publish(layer, sandbox_group(spec.sandbox_id), own)
                if device != spec.device_uuids[0]:
                    continue  # a multi-GPU sandbox is rolled up and judged by its first GPU
                self.rollups.add_sandbox(str(spec.sandbox_id), own_figures, own)
                limit = spec.mps.memory_mib if spec.mps else device_sample.mem_total_mib
                changes += self.alerts.observe_sandbox(
                    spec.sandbox_id, spec.tier, gpu_uuid, own, own_figures["mem_mib"], limit, now
                )
            if device in parent_of:
                newest.append(own)  # a MIG device's own figures, for /metrics
        live = {f"gpu:{g.uuid}" for g in self._gpus} | {f"sandbox:{s.sandbox_id}" for s in running.values()}
        changes += self.alerts.forget(live, now)
        await store_latest(latest, self.host, newest)
        for piece in await asyncio.to_thread(self.output.collect, running):
            await publish(layer, sandbox_group(piece["sandbox"]), piece)
        if changes:
            await self._publish_alerts(layer, changes)

    async def _publish_alerts(self, layer: Any, changes: list[AlertMessage]) -> None:
        """Live to the subject's groups and the fleet; stored by the control worker."""
        for change in changes:
            groups = {FLEET_GROUP, gpu_group(change["gpu"])}
            if change["sandbox"] is not None:
                groups.add(sandbox_group(change["sandbox"]))
            for group in groups:
                await publish(layer, group, change)
        log.warning("alerts on %s: %s", self.host, [(c["state"], c["message"]) for c in changes])
        await asyncio.to_thread(dispatch.to_control, "telemetry_alerts", self.host, changes)

    def set_alert_policy(self, policy: dict[str, Any]) -> None:
        with self.lock:
            self.alerts.set_policy(policy)
        log.info("agent %s: alert policy %s", self.host, self.alerts.version)

    def note_util(self, allocation_id: str, t_ms: int, util_pct: float) -> None:
        window = self._util.setdefault(allocation_id, deque())
        window.append((t_ms, util_pct))
        while window and window[0][0] < t_ms - self.util_window_s * 1000:
            window.popleft()

    def util_over_window(self, allocation_id: str) -> tuple[float, float] | None:
        """(mean GPU utilization %, seconds covered) over the last UTIL_WINDOW_S, from the
        samples of the sandbox's devices; None before the first sample. On a shared GPU
        (MPS, time-slice) it is the whole GPU's utilization: idle means idle for everyone."""
        window = self._util.get(allocation_id)
        if not window:
            return None
        mean = sum(u for _, u in window) / len(window)
        return round(mean, 1), (window[-1][0] - window[0][0]) / 1000

    def start(self) -> None:
        interval = env_int("SAMPLE_INTERVAL_MS", 1000, minimum=50) / 1000
        heartbeat = float(env_int("AGENT_HEARTBEAT_S", 5, minimum=1))
        self.report_inventory()
        # Alerts this host raised before a restart can no longer clear themselves.
        dispatch.to_control("telemetry_agent_started", self.host)
        threading.Thread(
            target=lambda: asyncio.run(self.sample_forever(interval, heartbeat)),
            name="agent-sampler",
            daemon=True,
        ).start()

    def shutdown(self) -> None:
        self._stop.set()
        self._reporter.shutdown(wait=False)
        self.backend.close()


_agent: Agent | None = None
_agent_lock = threading.Lock()


def get_agent() -> Agent:
    global _agent
    with _agent_lock:
        if _agent is None:
            host = env_str("GPUSHARE_HOST")
            var = config.var_dir() / "agents" / host
            var.mkdir(parents=True, exist_ok=True)
            backend = make_backend(config.gpu_backend_kind(), host, os.environ.get("GPUSHARE_SIM_GPUS", ""))
            driver = make_driver(config.sandbox_driver_kind(), host, var / "sandboxes")
            log.info("agent %s: GPU backend %s, sandbox driver %s", host, backend.name, driver.name)
            _agent = Agent(host, backend, driver, var)
        return _agent


@app.task(name="workers.agent.launch_sandbox", ignore_result=True)
def launch_sandbox(spec: dict[str, Any]) -> None:
    get_agent().launch(SandboxSpec.from_json(spec))


@app.task(name="workers.agent.set_alert_policy", ignore_result=True)
def set_alert_policy(policy: dict[str, Any]) -> None:
    get_agent().set_alert_policy(policy)


@app.task(name="workers.agent.report_inventory", ignore_result=True)
def report_inventory() -> None:
    get_agent().report_inventory()


@app.task(name="workers.agent.execute_plan", ignore_result=True)
def execute_plan(
    plan_id: int, stops: list[dict[str, Any]], mig_plan: dict[str, Any] | None, busy: dict[str, str]
) -> None:
    get_agent().execute_plan(plan_id, stops, mig_plan, busy)


@app.task(name="workers.agent.open_terminal", ignore_result=True)
def open_terminal(session: str, allocation_id: str, handle: dict[str, Any] | None) -> None:
    get_agent().open_terminal(session, allocation_id, handle)


@app.task(name="workers.agent.gpu_mode", ignore_result=True)
def gpu_mode(gpu_uuid: str, mode: str) -> None:
    get_agent().gpu_mode(gpu_uuid, mode)


@app.task(name="workers.agent.stop_sandbox", ignore_result=True)
def stop_sandbox(allocation_id: str, sandbox_id: int, handle: dict[str, Any] | None) -> None:
    get_agent().stop(allocation_id, sandbox_id, handle)


# A worker that exits with this code refused to start for its configuration (sysexits
# EX_CONFIG): systemd's unit does not restart it in a loop (RestartPreventExitStatus).
EXIT_CANNOT_LAUNCH = 78


@signals.worker_init.connect
def _self_test(**_: Any) -> None:
    """Before the first task: launch and stop one sandbox; a driver that cannot launch
    must not take sandboxes (each would fail with the same message), so the agent exits."""
    try:
        agent = get_agent()
    except DriverUnavailable as exc:
        log.error("agent cannot start: %s\n    to fix: %s", exc, exc.remedy)
        raise SystemExit(EXIT_CANNOT_LAUNCH) from exc
    if not env_bool("AGENT_SELFTEST", True):
        return
    result = selftest.try_driver(agent.driver, agent.host)
    if not result.ok:
        log.error("agent %s cannot start: %s", agent.host, result.describe())
        raise SystemExit(EXIT_CANNOT_LAUNCH)
    log.info("agent %s: %s", agent.host, result.describe())


@signals.worker_ready.connect
def _on_ready(**_: Any) -> None:
    get_agent().start()


@signals.worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    if _agent is not None:
        _agent.shutdown()
