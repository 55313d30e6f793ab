"""One agent process serving many simulated hosts, with the real processes: every host of
its file comes up with its inventory and beats, and a sandbox placed on one of them runs on
the state-only driver and ends."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import connections
from django.utils import timezone

from portal.fleet import credentials
from portal.fleet.models import Gpu, Host
from portal.launcher import AGENT_WORKER_FLAGS
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.e2e.platform import Platform, wait_for
from tests.portal.helpers import request
from wire import broker_acl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
HOSTS = 40


def state_of(pk: int) -> str:
    return Sandbox.objects.values_list("state", flat=True).get(pk=pk)


def test_one_process_serves_many_hosts_through_the_control_plane(
    people: Any, catalog: Any, tmp_path: Path
) -> None:
    prefix = f"pool{uuid.uuid4().hex[:6]}-"  # ACL users belong to the whole Redis server
    names = [f"{prefix}{i:02d}" for i in range(HOSTS)]
    hosts = tmp_path / "hosts.csv"
    rows = [f"{name},{'V100M32:8' if i % 2 else 'T4:2'},64,256" for i, name in enumerate(names)]
    hosts.write_text("name,gpus,cpus,memory_gib\n" + "\n".join(rows) + "\n")
    (tmp_path / "logs").mkdir()
    platform = Platform(tmp_path / "var", tmp_path / "logs", heartbeat_s=1)
    celery = [sys.executable, "-m", "celery", "-A", "workers"]
    try:
        platform.start_control("control", celery)
        platform.start("beat", [*celery, "beat", "-s", str(tmp_path / "beat-schedule")], GPUSHARE_ROLE="beat")
        # No -Q: the process consumes each host's queue from the file.
        # Enrolled as one, under its hosts' prefix, as the twin's pool is (issue 38): its key
        # always, its own Redis user where the Redis has ACL selectors (Redis 7).
        enrolled = broker_acl.supports_selectors(redis.Redis.from_url(settings.REDIS_URL))
        own = {**credentials.issue(prefix, pool=True).env(), "GPUSHARE_POOL_PREFIX": prefix}
        if not enrolled:
            del own["REDIS_URL"]
        platform.start(
            "pool",
            [
                *celery,
                "worker",
                "-n",
                "pool@%h",
                "-P",
                "threads",
                "-c",
                "4",
                *AGENT_WORKER_FLAGS,
                "--loglevel=INFO",
            ],
            GPUSHARE_ROLE="agent",
            GPUSHARE_HOSTS_FILE=str(hosts),
            SAMPLE_INTERVAL_MS="5000",
            **own,
        )
        wait_for(
            lambda: Host.objects.filter(name__in=names, state="up", driver="simulated").count() == HOSTS,
            120,
            lambda: "every host of the file to come up\n" + platform.logs(),
        )
        assert Gpu.objects.filter(host__name__in=names).count() == HOSTS // 2 * 10
        began = timezone.now()
        time.sleep(3)  # three rounds of beats
        assert Host.objects.filter(name__in=names, last_heartbeat_at__gt=began).count() == HOSTS

        sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
        wait_for(
            lambda: state_of(sandbox.pk) == "running", 60, lambda: "the sandbox to run\n" + platform.logs()
        )
        sandbox.refresh_from_db()
        assert sandbox.host is not None and sandbox.host.name in names
        actions.do_request_stop(sandbox.pk, people["owner"])
        wait_for(
            lambda: state_of(sandbox.pk) == "stopped", 60, lambda: "the sandbox to stop\n" + platform.logs()
        )
        assert not Host.objects.filter(name__in=names).exclude(state="up").exists()
        user = broker_acl.pool_username(prefix)
        assert [e for e in platform.redis_log() if e.get("username") == user] == []  # refused nothing
    except BaseException:
        sys.stderr.write(platform.logs())
        raise
    finally:
        platform.stop()
        redis.Redis.from_url(settings.REDIS_URL).execute_command(
            "ACL", "DELUSER", broker_acl.pool_username(prefix)
        )
        connections.close_all()
