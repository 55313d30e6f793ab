"""Heartbeats as the control worker takes them: a list of beats per message, one for a real
host's agent, a round of many for a process serving many simulated hosts."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.control import hosts, tasks
from portal.control.hosts import mark_lost_hosts
from portal.fleet.models import Host
from tests.conftest import seed_host
from tests.factories import beat

pytestmark = pytest.mark.django_db
HOSTS = [f"node-{i:02d}" for i in range(20)]


@pytest.fixture
def many(db: Any, sent_tasks: Any) -> list[str]:
    for name in HOSTS:
        seed_host(name, "V100M32:2")
    return HOSTS


def test_a_round_of_many_hosts_costs_one_update_for_their_liveness(many: list[str]) -> None:
    before = timezone.now()
    round_ms = int(before.timestamp() * 1000)  # a pool's round: one time for all its beats
    with CaptureQueriesContext(connection) as queries:
        tasks.agent_heartbeats([beat(name, t_ms=round_ms) for name in many])
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 1
    assert not Host.objects.filter(last_heartbeat_at__lt=before - timedelta(seconds=1)).exists()


def test_a_host_back_from_lost_in_a_round_is_regained_and_asked_for_its_inventory(
    many: list[str], sent_tasks: Any
) -> None:
    Host.objects.filter(name=many[3]).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert mark_lost_hosts(timezone.now()) == 1
    sent_tasks.clear()
    tasks.agent_heartbeats([beat(name) for name in many])
    assert set(Host.objects.values_list("state", flat=True)) == {Host.State.UP}
    assert [(queue, task) for queue, task, _ in sent_tasks] == [(f"host.{many[3]}", "report_inventory")]


def test_an_unknown_host_in_a_round_is_logged_and_the_rest_beat(
    many: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    stale = timezone.now() - timedelta(minutes=1)
    Host.objects.update(last_heartbeat_at=stale)
    with caplog.at_level(logging.WARNING, logger="portal.control.hosts"):
        tasks.agent_heartbeats([beat("nowhere"), *(beat(name) for name in many)])
    assert "heartbeat from unknown host nowhere ignored" in caplog.text
    assert not Host.objects.filter(last_heartbeat_at=stale).exists()
    assert not Host.objects.filter(name="nowhere").exists()


def test_only_an_agent_holding_old_alert_thresholds_is_sent_them(
    many: list[str], sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from portal.telemetry.alerts import alert_policy

    current = alert_policy()["version"]
    round_ = [beat(name, alerts_version=current) for name in many]
    round_[5]["alerts_version"] = "old"
    tasks.agent_heartbeats(round_)
    assert [(queue, task) for queue, task, _ in sent_tasks] == [(f"host.{many[5]}", "set_alert_policy")]
    # Its next beats, before it took them from its queue: not sent again until a minute passed.
    tasks.agent_heartbeats(round_)
    assert len(sent_tasks) == 1
    monkeypatch.setattr(hosts, "POLICY_RESEND_S", 0.0)
    tasks.agent_heartbeats(round_)
    assert len(sent_tasks) == 2
