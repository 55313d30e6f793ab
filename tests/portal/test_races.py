"""Races on PostgreSQL (issue 8): many requests for the last free GPUs through the real API,
and scheduling cycles started at once, from the Celery task and from ``schedule_once``.

Every racing thread has its own database connection, as a web or worker process would, and
closes it when done. The shared test server allows 100 connections in all (other suites run
beside this one), so at most ``DB_CONNECTIONS`` threads hold one at a time: all start at one
barrier and queue for a connection, which still makes the requests contend on the same rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
import pytest
import redis
from django.conf import settings as django_settings
from django.core.cache import cache
from django.db import connection
from django.db.models import Count, Q
from django.test import Client
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.control import scheduling
from portal.control.scheduling import schedule_once
from portal.fleet.models import Gpu
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox, SandboxEvent
from scheduler.cluster import DeviceGrant
from tests.conftest import seed_host
from tests.portal.helpers import request
from workers import control

# Threads race, each on its own connection: the rows they fight over must be committed.
# races: starved of CPU beside other work, SQLite's lock wait runs out (scripts/run-tests.sh).
pytestmark = [pytest.mark.slow, pytest.mark.races, pytest.mark.django_db(transaction=True)]
ON_POSTGRESQL = django_settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"
# What only PostgreSQL has: the cycle's advisory lock that a second cycle finds taken and
# skips, and connections that die with their worker. On SQLite (the embedded default) a
# cycle's BEGIN IMMEDIATE serialises cycles and requests instead: the races below that do
# not name these run there too.
postgres_only = pytest.mark.skipif(not ON_POSTGRESQL, reason="the cycle's advisory lock is PostgreSQL's")
T = TypeVar("T")
REQUESTS = 200
FREE_GPUS = 10
DB_CONNECTIONS = 40
PLACED = ("placing", "starting", "running")
SKIPPED = "scheduling cycle skipped: another cycle holds the database lock"


def race(count: int, work: Callable[[int], T]) -> list[T]:
    """``work(i)`` for i < count, each in its own thread, all released by one barrier."""
    barrier = threading.Barrier(count)
    slots = threading.BoundedSemaphore(DB_CONNECTIONS)
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            with slots:
                try:
                    results[i] = work(i)
                finally:
                    connection.close()  # this thread's own connection
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == count, "a thread did not finish"
    return [results[i] for i in range(count)]


@pytest.fixture
def cycles_overlap(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Wrap the pure scheduler: each cycle dwells in it a little, widening the window for a
    second cycle to slip in, and the most cycles ever inside it at once is recorded."""
    inside, most, guard = [0], [0], threading.Lock()
    real = scheduling.run_cycle

    def run_cycle(*args: Any, **kwargs: Any) -> Any:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.2)
            return real(*args, **kwargs)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(scheduling, "run_cycle", run_cycle)
    yield most


def one_cycle_each_way(i: int) -> None:
    """Even threads run the control worker's task, odd ones ``schedule_once`` directly:
    both meet at the database's lock."""
    if i % 2:
        schedule_once(time.time())
    else:
        control.TASKS["schedule_cycle"]()


def state_of_play() -> tuple[Any, ...]:
    states = Counter(Sandbox.objects.values_list("state", flat=True))
    return tuple(sorted(states.items())), Allocation.objects.filter(active=True).count()


def schedule_until_settled(threads: int = 4, rounds: int = 6) -> int:
    """Rounds of ``threads`` cycles at once until a round changes nothing; returns the rounds."""
    before = state_of_play()
    for done in range(1, rounds + 1):
        race(threads, one_cycle_each_way)
        after = state_of_play()
        if after == before and done > 1:
            return done
        before = after
    raise AssertionError(f"still changing after {rounds} rounds: {before}")


def assert_no_device_booked_twice() -> None:
    live = Allocation.objects.filter(active=True)
    whole = live.filter(kind="exclusive").values("gpu").annotate(n=Count("pk")).filter(n__gt=1)
    assert not whole.exists(), list(whole)
    # A whole GPU is never shared with anything else either.
    mixed = (
        live.values("gpu")
        .annotate(n=Count("pk"), whole=Count("pk", filter=Q(kind="exclusive")))
        .filter(whole__gte=1, n__gt=1)
    )
    assert not mixed.exists(), list(mixed)
    for sandbox in Sandbox.objects.filter(state__in=PLACED):
        assert sandbox.allocations.filter(active=True).count() == sandbox.gpu_count, sandbox
        # Placed once: one move to ``placing`` in its history, whatever the cycles did.
        assert sandbox.events.filter(to_state="placing").count() == 1, sandbox
    assert not Allocation.objects.filter(active=True, sandbox__state="queued").exists()


@pytest.fixture
def last_slots(people: Any, catalog: Any, sent_tasks: Any) -> dict[str, Any]:
    """Twelve whole GPUs on two hosts, two already running another project's work: the
    dedicated tier has exactly ten free slots, and nothing else exists to place on."""
    seed_host("race-a", "H100-80GB:8")
    seed_host("race-b", "H100-80GB:4")
    busy = [
        request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
        for _ in range(2)
    ]
    schedule_once(time.time())
    for sandbox in busy:
        sandbox.refresh_from_db()
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, timezone.now())
    assert Sandbox.objects.filter(state="running").count() == 2
    # The agents report their GPUs following demand: any idle one takes a dedicated request.
    free = Gpu.objects.filter(state="available", sharing_mode="auto").exclude(allocations__active=True)
    assert free.count() == FREE_GPUS
    # The quotas this test needs, raised for its project only (the defaults allow 10 live).
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=REQUESTS, max_gpus=REQUESTS)
    return {**people, **catalog, "busy": busy}


def test_200_requests_for_the_last_10_slots_place_10_and_queue_the_rest(
    last_slots: dict[str, Any], settings: Any, cycles_overlap: list[int], caplog: Any
) -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"burst": "10000/min", "sustained": "100000/hour"},
    }
    cache.clear()
    scopes: list[str] = [ApiToken.Scope.WRITE_SANDBOXES, ApiToken.Scope.READ_USAGE]
    keys = [ApiToken.issue(last_slots[who], "race", scopes)[1] for who in ("owner", "member")]
    body = {"project": "vision", "tier": "dedicated", "image": "busybox", "isolation": "container",
            "gpu_count": 1, "duration_hours": 1}  # fmt: skip

    def create(i: int) -> tuple[int, int]:
        client = Client(HTTP_AUTHORIZATION=f"Bearer {keys[i % len(keys)]}")
        answer = client.post(
            "/api/v1/sandboxes/", body, content_type="application/json", headers={"Idempotency-Key": f"r{i}"}
        )
        return answer.status_code, answer.json().get("id", 0)

    started = time.perf_counter()
    answers = race(REQUESTS, create)
    created = time.perf_counter() - started
    assert [status for status, _ in answers] == [201] * REQUESTS
    ids = {pk for _, pk in answers}
    asked = Sandbox.objects.filter(project=last_slots["project"])
    assert len(ids) == REQUESTS and set(asked.values_list("pk", flat=True)) == ids  # each exactly once
    assert set(asked.values_list("state", flat=True)) == {"queued"}

    caplog.set_level(logging.INFO, logger="portal.control.scheduling")
    started = time.perf_counter()
    rounds = schedule_until_settled()
    print(f"{REQUESTS} requests in {created:.1f} s; cycles settled in {rounds} rounds, "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip

    assert cycles_overlap[0] == 1  # never two cycles inside the scheduler at once
    assert asked.filter(state__in=PLACED).count() == FREE_GPUS
    waiting = asked.filter(state="queued")
    assert waiting.count() == REQUESTS - FREE_GPUS
    assert not waiting.filter(pending_reason="").exists()
    assert_no_device_booked_twice()
    assert Allocation.objects.filter(active=True).count() == FREE_GPUS + 2  # and the two busy ones
    assert Gpu.objects.exclude(allocations__active=True).count() == 0
    if ON_POSTGRESQL:  # cycles started at once did meet: a direct one found the lock taken
        assert [r.getMessage() for r in caplog.records].count(SKIPPED) >= 1


@postgres_only
def test_two_cycles_at_once_run_one_at_a_time_and_never_place_twice(
    last_slots: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    project, tier, image = last_slots["project"], last_slots["dedicated"], last_slots["image"]
    asked = [request(last_slots["owner"], project, tier, image) for _ in range(FREE_GPUS + 2)]
    inside, release = threading.Event(), threading.Event()
    real = scheduling.run_cycle
    first: list[bool] = []

    def run_cycle(*args: Any, **kwargs: Any) -> Any:
        if not first:  # the first cycle stops in the middle, holding its locks
            first.append(True)
            inside.set()
            assert release.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduling, "run_cycle", run_cycle)
    caplog.set_level(logging.INFO)
    failures: list[BaseException] = []

    def holder() -> None:
        try:
            control.TASKS["schedule_cycle"]()  # the Celery task: on PostgreSQL, the database's lock
        except BaseException as exc:
            failures.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(timeout=30)
        # A second worker's task, and a direct cycle, find the database lock taken.
        caplog.clear()
        control.TASKS["schedule_cycle"]()
        assert schedule_once(time.time()) == (0, 0)
        assert [r.getMessage() for r in caplog.records].count(SKIPPED) == 2
        assert not Sandbox.objects.filter(pk__in=[s.pk for s in asked]).exclude(state="queued").exists()
        assert Allocation.objects.filter(active=True).count() == 2  # only the busy ones
    finally:
        release.set()
        thread.join(timeout=60)
    assert not failures, failures
    ids = [s.pk for s in asked]
    assert Sandbox.objects.filter(pk__in=ids, state__in=PLACED).count() == FREE_GPUS

    # Cycles again and again, at once: nothing is placed twice and the two left wait.
    schedule_until_settled(threads=4, rounds=4)
    assert Sandbox.objects.filter(pk__in=ids, state__in=PLACED).count() == FREE_GPUS
    assert_no_device_booked_twice()

    # A stale decision repeated (a placed sandbox, or a held GPU for a queued one) is refused.
    placed = Sandbox.objects.filter(pk__in=ids, state__in=PLACED).first()
    waiting = Sandbox.objects.filter(pk__in=ids, state="queued").first()
    assert placed is not None and waiting is not None and placed.host is not None
    held = placed.allocations.get(active=True)
    grant = DeviceGrant(held.gpu.uuid, held.device_uuid, "exclusive", 1000)
    assert actions.do_place(placed.pk, placed.host.name, (grant,)) is False
    assert actions.do_place(waiting.pk, placed.host.name, (grant,)) is False
    waiting.refresh_from_db()
    assert waiting.state == "queued" and not waiting.allocations.exists()

    # A GPU frees up: the cycles racing for it place exactly one of the two waiting.
    actions.do_mark_stopped(last_slots["busy"][0].allocation_key, timezone.now())
    schedule_until_settled(threads=4, rounds=4)
    assert Sandbox.objects.filter(pk__in=ids, state__in=PLACED).count() == FREE_GPUS + 1
    assert Sandbox.objects.filter(pk__in=ids, state="queued").count() == 1
    assert_no_device_booked_twice()
    events = SandboxEvent.objects.filter(sandbox__in=ids, to_state="placing")
    assert events.count() == FREE_GPUS + 1


def test_concurrent_bookings_of_one_mps_gpu_never_overfill_it(
    people: Any, catalog: Any, sent_tasks: Any
) -> None:
    """Outside the cycle (a plan's relaunch books too) only the GPU's row lock stands
    between two MPS shares that together pass its threads: no constraint can sum rows."""
    seed_host("race-mps", "H100-80GB:1", {0: "mps"})
    gpu = Gpu.objects.get(host__name="race-mps")
    tier = catalog["mps"]
    wants: dict[str, Any] = {"mps_memory_mib": 20480, "mps_thread_pct": 60}
    shares = [request(people["owner"], people["project"], tier, catalog["image"], **wants) for _ in range(4)]
    grant = DeviceGrant(gpu.uuid, gpu.uuid, "mps", 600, mps_memory_mib=20480, mps_thread_pct=60)
    booked = race(len(shares), lambda i: actions.do_place(shares[i].pk, "race-mps", (grant,)))
    assert sorted(booked) == [False, False, False, True]
    assert Allocation.objects.filter(gpu=gpu, active=True).count() == 1
    assert Sandbox.objects.filter(state="queued").count() == 3


def test_concurrent_requests_cannot_overshoot_the_live_sandbox_quota(
    people: Any, catalog: Any, sent_tasks: Any, settings: Any
) -> None:
    """Forty requests at once against a quota of five live sandboxes: five get in, each
    other one is a 400 naming the quota, through the API and through the form alike."""
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"burst": "10000/min", "sustained": "100000/hour"},
    }
    cache.clear()
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=5, max_gpus=100)
    _, key = ApiToken.issue(people["owner"], "race", [ApiToken.Scope.WRITE_SANDBOXES])
    body = {"project": "vision", "tier": "dedicated", "image": "busybox", "isolation": "container",
            "gpu_count": 1, "duration_hours": 1}  # fmt: skip
    form = {**body, "project": people["project"].pk, "tier": catalog["dedicated"].pk,
            "image": catalog["image"].pk}  # fmt: skip

    def create(i: int) -> tuple[int, str]:
        if i % 2:
            api = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
            answer = api.post("/api/v1/sandboxes/", body, content_type="application/json")
            return answer.status_code, answer.content.decode()
        page = Client()
        page.force_login(people["owner"])
        answer = page.post("/sandboxes/new/", form)
        return answer.status_code, answer.content.decode()

    answers = race(40, create)
    accepted = [status for status, _ in answers if status in (201, 302)]
    assert len(accepted) == 5, Counter(status for status, _ in answers)
    refused = [text for status, text in answers if status == 400]
    assert len(refused) == 35 and all("quota of 5 live sandboxes" in text for text in refused)
    assert Sandbox.objects.filter(project=people["project"]).count() == 5


@postgres_only
def test_a_worker_killed_mid_cycle_holds_nothing_back(last_slots: dict[str, Any]) -> None:
    """A control worker killed inside a cycle leaves its advisory lock with a connection the
    kernel then closes: PostgreSQL ends that transaction, and the next cycle runs at once.
    A Redis lock it left behind (an older release took one) is not waited out."""
    asked = request(last_slots["owner"], last_slots["project"], last_slots["dedicated"], last_slots["image"])
    store = redis.Redis.from_url(django_settings.REDIS_URL)
    store.set(scheduling.CYCLE_LOCK, "dead-worker", ex=60)
    try:
        dead = psycopg.connect(**connection.get_connection_params())
        dead.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(scheduling.CYCLE_LOCK_KEY))
        control.TASKS["schedule_cycle"]()  # the dying worker's cycle still holds the lock
        assert Sandbox.objects.get(pk=asked.pk).state == "queued"
        backend_pid = dead.info.backend_pid
        dead.close()  # what the kernel does to a SIGKILLed process's socket
        _until_the_server_dropped(backend_pid)
        control.TASKS["schedule_cycle"]()
        assert Sandbox.objects.get(pk=asked.pk).state in PLACED
    finally:
        store.delete(scheduling.CYCLE_LOCK)


@pytest.mark.django_db  # one thread: no race, only the lock in Redis
@pytest.mark.usefixtures("on_commit_runs")
def test_without_postgresql_a_redis_lock_keeps_cycles_apart(
    last_slots: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The embedded deployment (SQLite, one control process with threads) has no advisory
    lock: the task's Redis lock keeps its cycles apart, and one that outlives the lock is a
    warning, its placements kept."""
    monkeypatch.setattr(connection, "vendor", "sqlite")
    asked = request(last_slots["owner"], last_slots["project"], last_slots["dedicated"], last_slots["image"])
    store = redis.Redis.from_url(django_settings.REDIS_URL)
    held = store.lock(scheduling.CYCLE_LOCK, timeout=30)
    assert held.acquire(blocking=False)
    try:
        control.TASKS["schedule_cycle"]()  # another thread's cycle holds the lock: this one skips
        assert Sandbox.objects.get(pk=asked.pk).state == "queued"
    finally:
        held.release()

    real = scheduling.run_cycle

    def run_cycle(*args: Any, **kwargs: Any) -> Any:
        store.delete(scheduling.CYCLE_LOCK)  # as if it expired mid-cycle
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduling, "run_cycle", run_cycle)
    caplog.set_level(logging.WARNING, logger="portal.control.scheduling")
    control.TASKS["schedule_cycle"]()
    assert Sandbox.objects.get(pk=asked.pk).state in PLACED
    assert any("outlived its Redis lock" in r.getMessage() for r in caplog.records)


def _until_the_server_dropped(backend_pid: int, timeout_s: float = 10.0) -> None:
    """PostgreSQL ends a closed connection's backend (and its transaction, locks included)
    when it notices the socket closed, a moment later: a cycle run in that moment still
    finds the lock held (CI saw it once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [backend_pid])
            if cursor.fetchone() is None:
                return
        time.sleep(0.02)
