"""The heartbeat, and the report it carries of every sandbox on this host (for reconcile)."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import redis

from wire import config, liveness
from wire.liveness import Beat, OwnedSandbox
from wire.messages import to_control
from wire.spec import SandboxHandle
from workers.drivers.base import DriverError
from workers.gpu.base import GpuBackendError, GpuSample
from workers.host.context import HostContext
from workers.host.lifecycle import now_ms

log = logging.getLogger(__name__)
# A report still being built after this long is logged with where it is stuck: meanwhile
# the host beats with no report, so nothing it runs is reconciled.
REPORT_STUCK_S = 30.0
# A big round (a process serving many hosts) goes as a few messages, so that several
# control workers can share it.
BEATS_PER_MESSAGE = 250


def send_beats(client: redis.Redis, beats: list[Beat]) -> None:
    """A round of beats, one host's or many: one time for all (the control worker writes
    it once), their liveness in one Redis round trip, the beats in messages of
    ``BEATS_PER_MESSAGE``."""
    t_ms = max(beat["t_ms"] for beat in beats)
    for beat in beats:
        beat["t_ms"] = t_ms
    try:
        liveness.note_alive(client, [beat["host"] for beat in beats], t_ms)
    except redis.RedisError as exc:  # the beats below still go (or fail) on their own
        log.warning("liveness not written: %s", exc)
    for start in range(0, len(beats), BEATS_PER_MESSAGE):
        to_control.agent_heartbeats(beats[start : start + BEATS_PER_MESSAGE])


class HostReports:
    """This host's heartbeat and the report of what it runs, built on a thread of its own."""

    def __init__(self, context: HostContext, builder: Executor | None = None) -> None:
        self.context = context
        self._redis: redis.Redis | None = None  # liveness key, written with each heartbeat
        self._pid_owner: dict[str, str] = {}  # "pid:<host pid>" -> allocation id
        self._attributed: set[str] = set()  # allocation ids whose pids the driver listed
        # Its own thread, or a few a process serving many hosts shares (workers.host.agent_pool).
        self._own_builder = builder is None
        self._builder = builder or ThreadPoolExecutor(1, thread_name_prefix="agent-report")
        self._job: Future[None] | None = None
        self._job_since = 0.0  # monotonic start of the job
        self._job_thread: int | None = None  # ident of the thread building it
        self._stuck_logged = False
        self._job_lock = threading.Lock()
        self.ready: tuple[list[OwnedSandbox], int] | None = None
        self.gate = ReportGate(context.host, context.settings.full_report_s)
        self._ended_sent: set[str] = set()  # sandboxes whose end a report has carried at once

    def heartbeat(self) -> None:
        """Beat: this host's liveness in Redis, and its beat to the control queue. First,
        each GPU's NVLink fabric readiness: a change goes to the portal as a new inventory
        (a GPU Fabric Manager has not registered is not offered, and is offered again once
        it is)."""
        try:
            self.context.inventory.recheck_fabric()
        except GpuBackendError as exc:  # the beat goes all the same
            log.warning("GPU inventory not re-read for its fabric state: %s", exc)
        send_beats(self._liveness_redis(), [self.beat()])

    def beat(self) -> Beat:
        """This host's beat, with the newest finished report of what it runs.

        The report is built on its own thread: listing sandboxes can block behind a slow
        driver call (libvirt serialises a connection while it defines a domain, ~40 s on a
        host with a root-only /dev/kvm), and a beat held up by it would get a healthy host
        marked lost. A report goes out once, with the time its listing began.
        """
        with self._job_lock:
            stuck_for = 0.0
            if self._job is None or self._job.done():
                self._job = self._builder.submit(self.build)
                self._job.add_done_callback(_log_build_failure)
                self._job_since, self._stuck_logged = time.monotonic(), False
            elif not self._stuck_logged and time.monotonic() - self._job_since > REPORT_STUCK_S:
                self._stuck_logged = True
                stuck_for = time.monotonic() - self._job_since
            ready, self.ready = self.ready, None
        if stuck_for:
            self._log_stuck(stuck_for)
        owned, owned_ms = ready if ready is not None else (None, None)
        if owned is not None and not self.gate.passes(owned):
            owned, owned_ms = None, None
        return Beat(
            host=self.context.host,
            t_ms=now_ms(),
            backend=self.context.backend.name,
            driver=self.context.driver.name,
            owned=owned,
            owned_ms=owned_ms,
            alerts_version=self.context.alerts.version,
        )

    def _liveness_redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(config.redis_url(), socket_timeout=2)
        return self._redis

    def _log_stuck(self, seconds: float) -> None:
        frame = sys._current_frames().get(self._job_thread or 0)
        where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(not started)\n"
        log.warning("the sandbox report has been building for %.0f s; it is at:\n%s", seconds, where)

    def build(self) -> None:
        self._job_thread = threading.get_ident()
        taken_ms = now_ms()
        with (
            self.context.sandboxes.lock
        ):  # before listing: a launch leaves this only once the driver lists it
            launching = dict(self.context.sandboxes.launching)
        try:
            handles = self.context.driver.list_owned()  # listed once, for all uses
            self.refresh_pid_owners(handles)
            owned = self.owned(handles, launching)
        except DriverError as exc:  # the engine is down: beat anyway, reconcile next time
            log.warning("cannot list sandboxes for the report: %s", exc)
            return
        if all(entry.get("tracked") for entry in owned):
            # Everything that runs here is registered with the daemons (none left to adopt
            # after a restart): a daemon no share holds was left up, and goes.
            self.context.mps_daemons.sweep(g.uuid for g in self.context.inventory.gpus)
        with self._job_lock:
            self.ready = (owned, taken_ms)
        self._send_at_once_if_one_ended(owned)

    def _send_at_once_if_one_ended(self, owned: list[OwnedSandbox]) -> None:
        """A report in which a sandbox's command has ended (a batch done, a crash) goes now
        rather than with the next beat: its room goes back to the queue a heartbeat sooner.
        In a burst of short batches the queued ones waited for the room of those that had
        ended: 10 s (p50) from a start to its stop (BENCHMARKS.md, "A burst of requests").
        Once per ended sandbox; not in a process serving many simulated hosts (a reporting
        period set), whose beats go together in rounds."""
        if self.gate.period > 0:
            return
        ended = {
            entry["allocation_key"] for entry in owned if entry["state"] == "exited" and entry["tracked"]
        }
        new, self._ended_sent = ended - self._ended_sent, ended
        if new:
            send_beats(self._liveness_redis(), [self.beat()])

    def refresh_pid_owners(self, handles: list[SandboxHandle]) -> None:
        """Which sandbox each host pid belongs to, for backends (NVML) that report GPU memory
        by process. Drivers without ``pids`` (or failing) leave the memory unattributed."""
        pids_of = getattr(self.context.driver, "pids", None)
        if pids_of is None or self.context.backend.simulated:
            return
        owners: dict[str, str] = {}
        attributed: set[str] = set()
        running = set(self.context.sandboxes.specs())
        for handle in handles:
            if handle.allocation_key in running:
                with contextlib.suppress(DriverError):
                    owners.update({f"pid:{pid}": handle.allocation_key for pid in pids_of(handle)})
                    attributed.add(handle.allocation_key)
        self._pid_owner, self._attributed = owners, attributed

    def memory_of(self, sample: GpuSample, allocation_key: str) -> int:
        """MiB of GPU memory a sandbox holds: the backend's figure for it (simulated), or the
        sum over its processes (NVML reports memory by pid, MPS clients included)."""
        if allocation_key in sample.mem_by_owner:
            return sample.mem_by_owner[allocation_key]
        return sum(m for k, m in sample.mem_by_owner.items() if self._pid_owner.get(k) == allocation_key)

    def util_of(self, sample: GpuSample, allocation_key: str) -> float | None:
        """A sandbox's own utilization on a shared GPU (% of the device's time): the backend's
        figure for it (simulated), or the sum over its processes through the same pid ->
        sandbox map as memory_of (NVML); 0 when none of them was busy. None when the device
        cannot measure it per process (MIG, MPS where NVML names the server: see
        workers/gpu/process_util.py), or when its processes are not known (a driver without
        ``pids``, or before the first report listed them): unmeasured, never its neighbours'
        figure, and never an idle 0 that culling would act on."""
        by_owner = sample.util_by_owner
        if by_owner is None:
            return None
        if allocation_key in by_owner:
            return round(min(100.0, by_owner[allocation_key]), 1)
        if allocation_key not in self._attributed:
            return None
        own = sum(u for k, u in by_owner.items() if self._pid_owner.get(k) == allocation_key)
        return round(min(100.0, own), 1)

    def owned(
        self, handles: list[SandboxHandle], launching: dict[str, int] | None = None
    ) -> list[OwnedSandbox]:
        """Every sandbox the driver owns on this host (``handles``, found by labels or names,
        so they survive a restart of this agent), with its state and whether this agent
        tracks it; and those still being launched (``launching``), as ``created``: without
        them a report taken during a launch and read once the sandbox runs would call it
        vanished (the driver's start time precedes the report, its listing does not)."""
        tracked = set(self.context.sandboxes.specs())
        self.context.utilization.keep_only(tracked)
        report: list[OwnedSandbox] = []
        for handle in handles:
            status = self.context.driver.status(handle)
            if status.state == "missing":
                continue
            entry = OwnedSandbox(
                allocation_key=handle.allocation_key,
                sandbox_id=handle.sandbox_id,
                state=status.state,
                exit_code=status.exit_code,
                reason=status.reason,
                started_at_ms=status.started_at_ms,
                handle=handle.to_json(),
                tracked=handle.allocation_key in tracked,
                util=self.context.utilization.over_window(handle.allocation_key),
            )
            if status.ended_at_ms:
                entry["ended_at_ms"] = status.ended_at_ms
            report.append(entry)
        listed = {entry["allocation_key"] for entry in report}
        for allocation_key, sandbox_id in (launching or {}).items():
            if allocation_key not in listed:
                report.append(
                    OwnedSandbox(
                        allocation_key=allocation_key, sandbox_id=sandbox_id, state="created", tracked=True
                    )
                )
        return report

    def shutdown(self) -> None:
        if self._own_builder:
            self._builder.shutdown(wait=False)


class ReportGate:
    """Which finished reports go out: every one when ``period`` is 0 (a real host's agent);
    else one that changed since the last sent (its utilization figures aside), or any once
    a full report is due, every ``period`` seconds. Reconciling a report costs the control
    worker ~16 ms (BENCHMARKS.md, heartbeats), so a process serving a cluster's simulated
    hosts sends the few that changed. A host's first full report is due at a point of the
    period its name picks: a fleet that started together does not report together."""

    def __init__(self, host: str, period: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.host, self.period, self.clock = host, period, clock
        self._sent: list[str] | None = None  # the last report sent, utilization aside
        self._full_due = 0.0

    def passes(self, owned: list[OwnedSandbox]) -> bool:
        if self.period <= 0:
            return True
        now = self.clock()
        fingerprint = sorted(
            json.dumps({k: v for k, v in entry.items() if k != "util"}, sort_keys=True) for entry in owned
        )
        if fingerprint == self._sent and now < self._full_due:
            return False
        if self._sent is None:  # a spread, not a secret
            self._full_due = now + random.Random(self.host).uniform(0, self.period)  # noqa: S311
        else:
            self._full_due = now + self.period
        self._sent = fingerprint
        return True


def _log_build_failure(job: Future[None]) -> None:
    """A report that raised (a bug, or an error the driver did not translate) is logged: its
    future is never read, so otherwise the host would silently beat with no reports."""
    exc = None if job.cancelled() else job.exception()
    if exc is not None:
        log.error("the sandbox report failed; the next beat tries again", exc_info=exc)
