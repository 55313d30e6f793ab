"""Faults with the real processes, each against servers the test owns and breaks: Redis
restarted mid-flow, PostgreSQL restarted, the control worker killed mid-cycle, two control
workers at once, a host agent killed, every message delivered twice. Requests go through
the REST API with running and queued sandboxes in flight when the fault hits; afterwards
``converge`` checks that the platform settled on the truth: no orphan container, no usage
second lost or counted twice, every request in a true state (tests/e2e/faults_support.py).

Heartbeats, hence reconcile reports, come every second unless a test says otherwise.
"""

from __future__ import annotations

import random
import re
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.conf import settings as django_settings

from portal.accounts.models import ApiToken
from tests.e2e.faults_support import (
    Api,
    PrivatePostgres,
    PrivateRedis,
    containers,
    converge,
    query,
    reported,
    states,
    wait_states,
)
from tests.e2e.platform import Platform, database_url, running_platform, wait_for
from tests.factories import ImageFactory, TierFactory
from tests.workers.engines import require_engine

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    # Production's failures: servers of its own restarted and killed, the database observed
    # with plain SQL over psycopg. The embedded default has one control worker and a Redis
    # the launcher owns; its faults are left to the other e2e tests there.
    pytest.mark.skipif(
        django_settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql",
        reason="production's servers (PostgreSQL and Redis) restarted and killed",
    ),
]
GPUS = "H100-80GB:3"  # three whole GPUs: a fourth request waits in the queue


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def api_key(people: Any, catalog: Any) -> str:
    TierFactory(slug="requeue", sharing_mode="dedicated", requeue_on_failure=True)
    ImageFactory(name="missing", reference="gpushare/no-such-image:404")
    return ApiToken.issue(people["owner"], "faults", ["write:sandboxes", "read:usage"])[1]


def api_of(platform: Platform, key: str) -> Api:
    return Api(f"http://127.0.0.1:{platform.port}", key)


def count(db: str, ids: list[int], *wanted: str) -> int:
    return sum(1 for pk, state in states(db, ids).items() if state in wanted)


def settle(platform: Platform, db: str, docker_client: Any, what: str, timeout: float = 45) -> float:
    took = converge(db, docker_client, platform.host, platform.heartbeat_s, timeout, platform.logs)
    print(f"{what}: converged in {took:.1f} s")
    return took


def test_redis_restarted_mid_flow_loses_messages_but_not_requests(
    api_key: str, docker_client: Any, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    db = database_url()
    with running_platform(tmp_path, web=True, redis_url=redis_server.url, sim_gpus=GPUS) as platform:
        api = api_of(platform, api_key)
        first = [api.request() for _ in range(2)]
        wait_states(db, lambda s: count(db, first, "running") == 2, 60, "two to run", platform.logs)
        later = [api.request() for _ in range(3)]  # one GPU left: one places, two queue
        wait_states(db, lambda s: count(db, later, "placing", "starting", "running") >= 1, 30, "a placement")
        # The broker dies with launches, reports and cycle requests queued in it.
        redis_server.restart(down_s=1.0)
        time.sleep(3)
        # Celery 5.7 workers exit ("Unrecoverable error") when the broker goes away; systemd
        # starts them again (deploy/systemd: Restart=on-failure). Do what it would.
        exited = {n: p.returncode for n, p in platform.procs.items() if p.poll() is not None}
        print(f"exited on the Redis restart: {exited}")
        for name, code in exited.items():
            assert code != 0, f"{name} exited cleanly: Restart=on-failure would not restart it"
            platform.restart(name)
        assert api.stop(first[0]) == 200  # frees a GPU: a queued request is placed
        more = [api.request()]
        settle(platform, db, docker_client, "after the Redis restart")
        ids = first + later + more
        final = states(db, ids)
        # The workers' restart may outlast 3 beats: the host is then lost (its sandboxes
        # failed) and back. Either way no GPU idles while a request waits.
        live = count(db, ids, "running", "queued")
        assert count(db, ids, "running") == min(3, live), final


def test_every_message_delivered_twice_changes_nothing_the_second_time(
    api_key: str, docker_client: Any, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    """Every task either side sends (launch and stop orders; launched, launch failed,
    stopped, heartbeat with its reconcile report, inventory, telemetry reports) is sent
    twice, so the broker delivers each one two times."""
    db = database_url()
    twice = [sys.executable, "-m", "tests.e2e.faults_support", "twice", "celery"]
    with running_platform(
        tmp_path, web=True, redis_url=redis_server.url, sim_gpus=GPUS, celery_argv=twice
    ) as platform:
        api = api_of(platform, api_key)
        broken = api.request(image="missing")
        wait_states(db, lambda s: s.get(broken) == "failed", 60, "the broken launch to fail", platform.logs)
        ids = [api.request() for _ in range(4)]
        wait_states(db, lambda s: count(db, ids, "running") == 3, 60, "three to run", platform.logs)
        running = [pk for pk, state in states(db, ids).items() if state == "running"]
        assert api.stop(running[0]) == 200
        settle(platform, db, docker_client, "with every message twice")
        final = states(db, ids)
        assert final[running[0]] == "stopped"
        assert count(db, ids, "running") == 3, final
        for pk, sequence in transitions(db, [*ids, broken]).items():
            assert len(sequence) == len(set(sequence)), f"sandbox {pk} repeated a transition: {sequence}"
        assert len(containers(docker_client, platform.host)) == 3


def transitions(db: str, ids: list[int]) -> dict[int, list[tuple[str, str]]]:
    found: dict[int, list[tuple[str, str]]] = {pk: [] for pk in ids}
    for pk, was, to in query(
        db, "SELECT sandbox_id, from_state, to_state FROM sandboxes_sandboxevent ORDER BY at, id"
    ):
        if pk in found:
            found[pk].append((was, to))
    return found


def test_control_worker_killed_mid_cycle_places_nothing_twice(
    api_key: str, docker_client: Any, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    db = database_url()
    rng = random.Random(8)
    with running_platform(tmp_path, web=True, redis_url=redis_server.url, sim_gpus=GPUS) as platform:
        api = api_of(platform, api_key)
        ids = [api.request()]
        wait_states(db, lambda s: count(db, ids, "running") == 1, 60, "one to run", platform.logs)
        # Cycles run every second and on every request and end: SIGKILL the worker at
        # random moments while requests and stops keep coming, then let it come back.
        for round_ in range(4):
            ids += [api.request(), api.request()]
            time.sleep(rng.uniform(0.0, 1.5))
            platform.kill("control")
            live = [pk for pk, state in states(db, ids).items() if state == "running"]
            if round_ % 2 and live:
                assert api.stop(rng.choice(live)) == 200
            platform.restart("control")
            time.sleep(rng.uniform(2.0, 5.0))  # up and cycling (a cold Celery start is seconds)
        settle(platform, db, docker_client, "after the control worker was killed 4 times", timeout=55)
        # A GPU freed by the last stop goes to a queued request within a few cycles: a
        # worker killed mid-cycle leaves no lock behind to wait out.
        wait_states(db, lambda s: count(db, ids, "running") == 3, 15, "three running", platform.logs)
        doubled = query(
            db,
            "SELECT gpu_id, count(*) FROM sandboxes_allocation WHERE active "
            "GROUP BY gpu_id HAVING count(*) > 1",
        )
        assert not doubled


CYCLE_DONE = re.compile(r"workers\.control\.(?:tick|schedule_cycle)\[[^]]+\] succeeded")


def test_two_control_workers_place_each_request_once(
    api_key: str, docker_client: Any, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    """Two control workers on the one queue, requests arriving together: both run cycles
    (ticks and nudges go to whichever is free), the Redis and PostgreSQL locks keep them to
    one cycle at a time, and every request is placed once or waits."""
    db = database_url()
    with running_platform(tmp_path, web=True, redis_url=redis_server.url, sim_gpus=GPUS) as platform:
        platform.start_control("control-2")

        def log_of(name: str) -> str:
            return (platform.log_dir / f"{name}.log").read_text(errors="replace")

        def cycles(name: str) -> int:  # a tick ends by running a cycle (or finding it locked)
            return len(CYCLE_DONE.findall(log_of(name)))

        wait_for(lambda: " ready." in log_of("control-2"), 60, "the second control worker")
        api = api_of(platform, api_key)
        with ThreadPoolExecutor(max_workers=12) as pool:
            ids = list(pool.map(lambda _: api.request(), range(12)))
        # Each request nudged a cycle; a burst more, as a busy portal sends, while both wait on
        # the queue: Redis hands each to the worker that has waited longest, so both get some.
        with Celery(broker=redis_server.url) as broker:
            for _ in range(20):
                broker.send_task("workers.control.schedule_cycle", queue="control")
        wait_states(db, lambda s: count(db, ids, "running") == 3, 60, "three to run", platform.logs)
        wait_for(lambda: cycles("control") and cycles("control-2"), 60, "both workers to run cycles")
        settle(platform, db, docker_client, "with two control workers")
        final = states(db, ids)
        assert count(db, ids, "running") == 3 and count(db, ids, "queued") == 9, final
        twice = query(
            db,
            "SELECT sandbox_id FROM sandboxes_sandboxevent WHERE to_state = 'placing' "
            "GROUP BY sandbox_id HAVING count(*) > 1",
        )
        assert not twice
        assert not query(
            db, "SELECT gpu_id FROM sandboxes_allocation WHERE active GROUP BY gpu_id HAVING count(*) > 1"
        )


def test_agent_killed_and_back_within_the_timeout_readopts_its_sandboxes(
    api_key: str, docker_client: Any, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    # Beats every 5 s: a host is lost after 15 s of silence, more than a Celery cold start.
    db = database_url()
    with running_platform(
        tmp_path, web=True, heartbeat_s=5, redis_url=redis_server.url, sim_gpus=GPUS
    ) as platform:
        api = api_of(platform, api_key)
        ids = [api.request() for _ in range(3)]
        wait_states(db, lambda s: count(db, ids, "running") == 3, 60, "three to run", platform.logs)
        before = {c["key"]: c["id"] for c in containers(docker_client, platform.host)}
        ids += [api.request()]  # queued
        platform.kill("agent")
        assert api.stop(ids[0]) == 200  # the stop order waits in the agent's queue
        platform.restart("agent")
        wait_states(db, lambda s: s[ids[0]] == "stopped", 45, "the stop to be done", platform.logs)
        settle(platform, db, docker_client, "after the agent came back", timeout=55)
        assert reported(db, platform.host) == "up"
        final = states(db, ids)
        assert [final[pk] for pk in ids] == ["stopped", "running", "running", "running"], final
        after = {c["key"]: c["id"] for c in containers(docker_client, platform.host)}
        kept = {key: before[key] for key in before if key in after}
        assert len(kept) == 2 and all(after[k] == v for k, v in kept.items()), (before, after)
        lost_sql = "SELECT count(*) FROM sandboxes_sandboxevent WHERE to_state IN ('failed', 'queued') "
        failures = query(db, lost_sql + "AND message LIKE %s", "%lost%")
        assert failures == [(0,)]


def test_agent_killed_past_the_timeout_loses_its_host_and_bills_to_the_loss(
    api_key: str, docker_client: Any, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    db = database_url()
    with running_platform(tmp_path, web=True, redis_url=redis_server.url, sim_gpus=GPUS) as platform:
        api = api_of(platform, api_key)
        failing = [api.request(), api.request()]
        requeued = [api.request(tier="requeue")]
        queued = [api.request()]
        ids = failing + requeued + queued
        wait_states(db, lambda s: count(db, ids, "running") == 3, 60, "three to run", platform.logs)
        killed_at = time.time()
        platform.kill("agent")
        wait_states(
            db, lambda s: reported(db, platform.host) == "lost", 30, "the host to be lost", platform.logs
        )
        lost = states(db, ids)
        assert [lost[pk] for pk in failing] == ["failed", "failed"], lost
        assert lost[requeued[0]] == "queued" and lost[queued[0]] == "queued", lost
        # Usage stops at the loss, not at the last report nor when the agent returns.
        for pk, end in query(db, "SELECT sandbox_id, extract(epoch FROM ended_at) FROM billing_usagerecord"):
            assert killed_at < float(end) < killed_at + 3 * platform.heartbeat_s + 3, (pk, end)
        platform.restart("agent")
        # Back: the copies it still runs are orphans, stopped; the queue is placed again.
        wait_states(db, lambda s: count(db, ids, "running") == 2, 60, "the queue to run again", platform.logs)
        settle(platform, db, docker_client, "after the lost host came back", timeout=50)
        assert reported(db, platform.host) == "up"


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgresql_restarted_mid_flow(
    mode: str, docker_client: Any, redis_server: PrivateRedis, tmp_path: Path
) -> None:
    require_engine(PrivatePostgres.available(), "PostgreSQL 15 binaries run as root (initdb, pg_ctl)")
    pg = PrivatePostgres()
    try:
        pg.init()
        key = seed(pg.url, tmp_path)
        with running_platform(
            tmp_path, web=True, database_url=pg.url, redis_url=redis_server.url, sim_gpus=GPUS
        ) as platform:
            api = api_of(platform, key)
            ids = [api.request() for _ in range(2)]
            wait_states(pg.url, lambda s: count(pg.url, ids, "running") == 2, 60, "two to run", platform.logs)
            ids += [api.request() for _ in range(2)]  # one places, one queues
            pg.restart(mode)
            codes = []
            for _ in range(3):  # the web recovers by itself: a failed request at most
                codes.append(api.call("/api/v1/sandboxes/", NEW)[0])
                if codes[-1] == 201:
                    break
            assert codes[-1] == 201 and all(c in (201, 500, 502, 503) for c in codes), codes
            running = [pk for pk, state in states(pg.url, ids).items() if state == "running"]
            assert api.stop(running[0]) == 200
            settle(platform, pg.url, docker_client, f"after PostgreSQL {mode} restart", timeout=55)
            ids = sorted(states(pg.url))
            assert count(pg.url, ids, "running") == 3, states(pg.url)
            assert count(pg.url, ids, "stopped") == 1, states(pg.url)
            assert reported(pg.url, platform.host) == "up"
            for name in ("control", "agent", "beat", "web"):
                assert platform.procs[name].poll() is None, f"{name} died"
    finally:
        pg.remove()


NEW = {"project": "vision", "tier": "dedicated", "image": "busybox", "isolation": "container",
       "gpu_count": 1, "duration_hours": 1}  # fmt: skip

SEED = """
from portal.accounts.models import ApiToken
from tests.factories import ImageFactory, MembershipFactory, ProjectFactory, TierFactory, UserFactory
owner = UserFactory(username="olivia")
MembershipFactory(user=owner, project=ProjectFactory(slug="vision", name="Vision"), role="manager")
TierFactory(slug="dedicated")
ImageFactory()
print("KEY=" + ApiToken.issue(owner, "faults", ["write:sandboxes", "read:usage"])[1])
"""


def seed(url: str, tmp_path: Path) -> str:
    """Migrate the private database and add a user, project, tier and image to it."""
    import os
    import subprocess

    from django.conf import settings

    from tests.e2e.platform import ROOT

    env = {**os.environ, "DATABASE_URL": url, "SECRET_KEY": settings.SECRET_KEY,
           "GPUSHARE_VAR_DIR": str(tmp_path / "seed")}  # fmt: skip
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v0"], cwd=ROOT, env=env, check=True, timeout=300)
    out = subprocess.run([*manage, "shell", "-c", SEED], cwd=ROOT, env=env, check=True, timeout=120,
                         capture_output=True, text=True).stdout  # fmt: skip
    return next(line[4:] for line in out.splitlines() if line.startswith("KEY="))
