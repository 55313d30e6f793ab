"""The state the last scheduling cycle left, published for the request form's preview.

The preview used to rebuild the snapshot and the queue from the database and run a whole
cycle over every waiting request plus the one being written, on each form change: seconds
at the openb cluster's size. After each cycle the control worker now publishes, in Redis,
a digest of the state its committed decisions left:

- every host and GPU with what is free on it (the pure ``Snapshot`` after the cycle's
  bookings), and the sandboxes holding them (what preemption and the ETA need);
- the waiting requests in the order the cycle took them (the preview's place in the queue);
- the devices reserved for the queue head;
- the fair-share state (weights, guarantees, limits, decayed usage);
- the placement policy's name and the typical requests its workload model learned;
- when it was written.

The web server decodes it once per publication, brings its ``Mirror`` of the fleet up to
date host by host, and answers each preview with one placement attempt on that mirror
(``portal/scheduling/preview.py``). A digest older than
``max_age_s()`` (the control worker is down or stuck) is not used: the preview falls back
to reading the database. An empty queue gives the cycle nothing to decide, yet capacity
frees as sandboxes stop, so an idle cycle refreshes the digest every ``IDLE_REFRESH_S``.

JSON, never pickle: whatever can write the Redis database must not be able to run code in
the web server. Two keys written together (MULTI): the body, and a small ``meta`` (a hash
of the body and the time it was written) that the web server polls on each preview.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, cast

import redis
from django.conf import settings

from portal.scheduling import kept_snapshot
from scheduler.cluster import (
    MODES,
    DepartmentShare,
    DeviceGrant,
    FairShareState,
    GpuState,
    HostState,
    MigSlot,
    ModelLimit,
    ProjectShare,
    Request,
    Reserve,
    Running,
    Snapshot,
)
from scheduler.placement.workload import TypicalPod
from scheduler.topology import Topology

log = logging.getLogger(__name__)

BODY_KEY = "gpushare:scheduling:state"
META_KEY = "gpushare:scheduling:state-meta"
FORMAT = 4  # bump when the layout below changes: an old digest then reads as missing
# An idle cycle (empty queue) republishes at most this often, so capacity freed by
# sandboxes that stopped shows in the preview within a few seconds.
IDLE_REFRESH_S = 5.0
# Redis forgets a digest nobody refreshes (the control worker is gone for good).
EXPIRE_S = 600


def max_age_s() -> float:
    """How old a digest may be and still answer a preview: several missed cycles (and an
    idle refresh) past the tick, whatever ``CYCLE_INTERVAL_S`` an operator set."""
    return max(15.0, 3.0 * settings.CYCLE_INTERVAL_S + IDLE_REFRESH_S)


_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return _client


# --- what the control worker writes ---------------------------------------------------------


def encode(
    *,
    snapshot: Snapshot,
    running: list[Running],
    pending: list[Request],
    reservation: Reserve | None,
    fairshare: FairShareState,
    now: float,
    policy: str,
    typical: list[TypicalPod],
    multi_gpu_share: float,
    multi_gpu: list[TypicalPod] | None = None,
) -> bytes:
    """The digest's body: compact JSON of rows (lists), not of objects with named fields."""
    body = {
        "format": FORMAT,
        "now": now,
        "policy": policy,
        "hosts": [_host_row(h) for h in snapshot.hosts],
        "running": [_running_row(r) for r in running],
        "pending": [[r.id, r.project, r.priority, r.submitted_at, r.mode, r.max_duration_s] for r in pending],
        "reservation": _reservation_row(reservation),
        "fairshare": {
            "half_life_s": fairshare.half_life_s,
            "horizon_s": fairshare.horizon_s,
            "usage_at": now if fairshare.usage_at is None else fairshare.usage_at,
            "projects": {
                name: [
                    s.weight,
                    s.guaranteed_milli,
                    s.limit_milli,
                    s.usage_gpu_s,
                    _limit_rows(s.model_limits),
                    s.department,
                ]
                for name, s in sorted(fairshare.projects.items())
            },
            "departments": {
                name: [d.parent, d.weight, d.guaranteed_milli, d.limit_milli, _limit_rows(d.model_limits)]
                for name, d in sorted(fairshare.departments.items())
            },
        },
        "typical": [[t.cpu_milli, t.gpu_milli, t.num_gpu, list(t.models), t.probability] for t in typical],
        "multi_gpu_share": multi_gpu_share,
        "multi_gpu": [
            [t.cpu_milli, t.gpu_milli, t.num_gpu, list(t.models), t.probability] for t in multi_gpu or []
        ],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def publish(body: bytes, fleet: str = "") -> None:
    """Store a digest for the web servers, with the fingerprint of the fleet it was read
    from (``fleet``, see ``idle_refresh_due``); a Redis failure costs the preview its fast
    path (it reads the database meanwhile), never the cycle."""
    meta = json.dumps(
        {"hash": hashlib.blake2b(body, digest_size=12).hexdigest(), "written_at": time.time(), "fleet": fleet}
    )
    try:
        with _redis().pipeline(transaction=True) as pipe:
            pipe.set(BODY_KEY, body, ex=EXPIRE_S)
            pipe.set(META_KEY, meta, ex=EXPIRE_S)
            pipe.execute()
    except redis.RedisError as exc:
        log.warning("scheduling state not published (the preview reads the database meanwhile): %s", exc)


def idle_refresh_due(fleet: str) -> bool:
    """Whether an idle cycle should publish: no digest, one older than IDLE_REFRESH_S, or one
    read from another fleet than ``fleet`` (a fingerprint of hosts, GPUs and who holds them).
    Without the last, a host that joined, a GPU drained or a sandbox that ended showed in the
    preview only at the next refresh: a platform's first preview said "no GPU host is up"."""
    meta = _meta_json()  # read once: it is a Redis round trip inside the cycle's lock
    if meta is None:
        return True
    try:
        age = time.time() - float(meta["written_at"])
    except (ValueError, KeyError, TypeError):
        return True
    return age >= IDLE_REFRESH_S or meta.get("fleet", "") != fleet


def _host_row(host: HostState) -> list[Any]:
    gpus = [
        [
            g.uuid, g.index, g.model, g.memory_mib, g.mode, g.available, g.exclusive_busy,
            g.mps_used_mib, g.mps_used_threads, g.replicas, sorted(g.replicas_used),
            [[m.uuid, m.profile, m.start, m.memory_slices, m.busy] for m in g.mig],
            list(g.mps_share) if g.mps_share else None, g.mps_one_size, list(g.offers),
        ]
        for g in host.gpus
    ]  # fmt: skip
    return [
        host.name, host.up, host.cpu_milli, host.memory_mib, host.cpu_used_milli, host.memory_used_mib,
        list(host.isolation_levels), gpus, host.cluster, host.topology.row(),
    ]  # fmt: skip


def _grant_row(g: DeviceGrant) -> list[Any]:
    # A whole GPU's device is the GPU itself: "" spares thousands of repeated UUIDs.
    device = "" if g.device_uuid == g.gpu_uuid else g.device_uuid
    return [
        g.gpu_uuid,
        device,
        g.kind,
        g.milli_gpu,
        g.mig_uuid,
        g.mps_memory_mib,
        g.mps_thread_pct,
        g.replica,
    ]


def _running_row(r: Running) -> list[Any]:
    # Times to the millisecond: a microsecond's digits are a fifth of the digest for nothing.
    ends = None if r.ends_at is None else round(r.ends_at, 3)
    return [
        r.sandbox_id, r.project, r.host, r.priority, round(r.started_at, 3), ends, r.preemptible, r.borrowed,
        r.cpu_milli, r.memory_mib, [_grant_row(g) for g in r.grants],
        None if math.isinf(r.preemptible_at) else round(r.preemptible_at, 3), r.warning_s,
    ]  # fmt: skip


def _reservation_row(reservation: Reserve | None) -> list[Any] | None:
    if reservation is None:
        return None
    r = reservation
    return [r.request_id, r.host, r.at, [_grant_row(g) for g in r.grants]]


# --- what the web server reads ------------------------------------------------------------


@dataclass(frozen=True)
class Digest:
    """A decoded digest. The fleet and the sandboxes holding it stay rows (lists) until a
    ``Mirror`` builds, or brings up to date, the objects of the ones that changed."""

    hash: str
    written_at: float
    now: float
    policy: str
    hosts: list[list[Any]]
    running_rows: list[list[Any]]
    pending: list[Request]
    reservation: Reserve | None
    fairshare: FairShareState
    typical: list[TypicalPod]
    multi_gpu_share: float
    # The multi-GPU request shapes the worker's model has seen (the policy keeps room for
    # them); absent from a digest an older worker wrote.
    multi_gpu: list[TypicalPod] = field(default_factory=list)

    @property
    def running(self) -> list[Running]:
        return [_running(row) for row in self.running_rows]

    def snapshot(self) -> Snapshot:
        """A fleet of its own, built from the rows."""
        return Snapshot(hosts=[_host(row) for row in self.hosts], running=self.running)


class Mirror:
    """A fleet kept in step with the digests it follows, for a policy that remembers scores
    per snapshot: while the hosts and their GPUs stay the same, a new digest replaces only
    the hosts whose rows changed (reported through ``Snapshot.changed``) and reuses the
    ``Running`` of every sandbox whose row is the same. Not thread-safe: its user locks."""

    hash: str
    snapshot: Snapshot
    _rows: list[list[Any]]
    _running: dict[int, tuple[list[Any], Running]]

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the fleet: the next ``follow`` builds it afresh."""
        self.hash, self.snapshot, self._rows, self._running = "", Snapshot(hosts=[]), [], {}

    def follow(self, digest: Digest) -> Snapshot | None:
        """The fleet as ``digest`` has it; None when its rows cannot be read."""
        if digest.hash == self.hash and not kept_snapshot.worn(self.snapshot):
            return self.snapshot
        try:
            rows = digest.hosts
            snapshot = kept_snapshot.follow(
                self.snapshot,
                self._rows,
                rows,
                layout=_layout,
                host=_host,
                rebuild=lambda: Snapshot(hosts=[_host(row) for row in rows]),
            )
            running: dict[int, tuple[list[Any], Running]] = {}
            for row in digest.running_rows:
                kept = self._running.get(row[0])
                running[row[0]] = kept if kept is not None and kept[0] == row else (row, _running(row))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("scheduling state unreadable, ignored: %r", exc)
            self.reset()  # what was half brought up to date is dropped
            return None
        snapshot.running = [holder for _, holder in running.values()]
        self.snapshot, self.hash, self._rows, self._running = snapshot, digest.hash, rows, running
        return snapshot


def _layout(row: list[Any]) -> tuple[Any, ...]:
    """What a policy may have built on for the whole fleet, of one host's row: its name,
    capacity and isolation, and each GPU's UUID, model and sharing mode. Not what is free."""
    return (row[0], row[2], row[3], row[6], row[8:], [(g[0], g[2], g[4], g[14:]) for g in row[7]])


def _host(row: list[Any]) -> HostState:
    # cluster and topology absent: a digest from before them
    name, up, cpu, memory, cpu_used, memory_used, isolation, gpus, *cluster = row
    states = [
        GpuState(
            uuid, name, index, model, memory_mib, mode, available, exclusive_busy,
            [MigSlot(*slot) for slot in mig], mps_mib, mps_threads, replicas, set(replicas_used),
            tuple(sizing[0]) if sizing and sizing[0] else None, bool(sizing[1:] and sizing[1]),
            tuple(sizing[2]) if sizing[2:] else MODES,
        )
        for (
            uuid, index, model, memory_mib, mode, available, exclusive_busy,
            mps_mib, mps_threads, replicas, replicas_used, mig, *sizing,  # none: a digest from before
        ) in gpus
    ]  # fmt: skip
    return HostState(
        name, up, states, cpu, memory, cpu_used, memory_used, tuple(isolation), cluster[0] if cluster else "",
        Topology.from_row(cluster[1] if cluster[1:] else None),
    )  # fmt: skip


_cached: Digest | None = None
_cache_lock = threading.Lock()


def latest(max_age: float | None = None) -> Digest | None:
    """The newest digest if it is younger than ``max_age`` (default ``max_age_s()``), else None.

    Each call reads the small meta key; the body is fetched and decoded only when its hash
    changed since this process last decoded one, so previews between two cycles share it.
    """
    global _cached
    meta = _read_meta()
    limit = max_age_s() if max_age is None else max_age
    if meta is None or time.time() - meta[1] > limit:
        return None
    digest_hash, written_at = meta
    with _cache_lock:
        if _cached is None or _cached.hash != digest_hash:
            try:
                body = cast(bytes | None, _redis().get(BODY_KEY))
            except redis.RedisError as exc:
                log.warning("scheduling state unreadable: %s", exc)
                return None
            if body is None:
                return None
            # Rewritten between the two reads (both keys change together): the body is the
            # newer one, dated no later than it was, which is the safe side.
            body_hash = hashlib.blake2b(body, digest_size=12).hexdigest()
            decoded = decode(body, body_hash, written_at)
            if decoded is None:
                return None
            _cached = decoded
        cached = _cached
    # Written again with the same content: the same decoded digest, with its newer time.
    return cached if cached.written_at == written_at else replace(cached, written_at=written_at)


def clear() -> None:
    """Delete the published digest and what this process decoded of it (tests: one test's
    fleet must not answer another's previews)."""
    global _cached
    with _cache_lock:
        _cached = None
    _redis().delete(BODY_KEY, META_KEY)


def _read_meta() -> tuple[str, float] | None:
    meta = _meta_json()
    try:
        return None if meta is None else (str(meta["hash"]), float(meta["written_at"]))
    except (ValueError, KeyError, TypeError):
        return None


def _meta_json() -> dict[str, Any] | None:
    try:
        raw = cast(bytes | None, _redis().get(META_KEY))
    except redis.RedisError as exc:
        log.warning("scheduling state unreadable: %s", exc)
        return None
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def decode(body: bytes, digest_hash: str = "", written_at: float = 0.0) -> Digest | None:
    """A digest from its body; None (and a warning) for one this code cannot read."""
    try:
        data = json.loads(body)
        if data.get("format") != FORMAT:
            return None
        fair = data["fairshare"]
        return Digest(
            hash=digest_hash,
            written_at=written_at,
            now=float(data["now"]),
            policy=str(data["policy"]),
            hosts=list(data["hosts"]),
            running_rows=list(data["running"]),
            pending=[
                Request(id=i, project=p, priority=prio, submitted_at=at, mode=mode, max_duration_s=duration)
                for i, p, prio, at, mode, duration in data["pending"]
            ],
            reservation=_reservation(data["reservation"]),
            fairshare=FairShareState(
                projects={name: _share(share) for name, share in fair["projects"].items()},
                departments={name: _department(row) for name, row in fair["departments"].items()},
                half_life_s=fair["half_life_s"],
                usage_at=fair["usage_at"],
                horizon_s=fair["horizon_s"],
            ),
            typical=[TypicalPod(c, m, n, tuple(models), p) for c, m, n, models, p in data["typical"]],
            multi_gpu_share=float(data["multi_gpu_share"]),
            multi_gpu=[
                TypicalPod(c, m, n, tuple(models), p) for c, m, n, models, p in data.get("multi_gpu", [])
            ],
        )
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("scheduling state undecodable, ignored: %r", exc)
        return None


def _limit_rows(limits: tuple[ModelLimit, ...]) -> list[list[Any]]:
    return [[m.name, sorted(m.models), m.limit_milli, m.closed] for m in limits]


def _limits(rows: list[Any]) -> tuple[ModelLimit, ...]:
    return tuple(ModelLimit(n, frozenset(models), milli, why) for n, models, milli, why in rows)


def _share(row: list[Any]) -> ProjectShare:
    weight, guaranteed, limit, usage, model_limits, department = row
    return ProjectShare(weight, guaranteed, limit, usage, _limits(model_limits), department)


def _department(row: list[Any]) -> DepartmentShare:
    parent, weight, guaranteed, limit, model_limits = row
    return DepartmentShare(parent, weight, guaranteed, limit, _limits(model_limits))


def _grant(row: list[Any]) -> DeviceGrant:
    gpu, device, kind, milli, mig, mps_mib, mps_threads, replica = row
    return DeviceGrant(gpu, device or gpu, kind, milli, mig, mps_mib, mps_threads, replica)


def _running(row: list[Any]) -> Running:
    (
        sandbox,
        project,
        host,
        priority,
        started,
        ends,
        preemptible,
        borrowed,
        cpu,
        memory,
        grants,
        preemptible_at,
        warning_s,
    ) = row
    return Running(
        sandbox_id=sandbox, project=project, host=host, grants=tuple(_grant(g) for g in grants),
        priority=priority, started_at=started, ends_at=ends, preemptible=preemptible, borrowed=borrowed,
        cpu_milli=cpu, memory_mib=memory,
        preemptible_at=math.inf if preemptible_at is None else preemptible_at, warning_s=warning_s,
    )  # fmt: skip


def _reservation(row: list[Any] | None) -> Reserve | None:
    if row is None:
        return None
    request_id, host, at, grants = row
    return Reserve(request_id, host, at, tuple(_grant(g) for g in grants))
