"""Reconciliation: the database repaired to match what an agent reports it runs."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.control import tasks
from portal.control.hosts import mark_lost_hosts
from portal.control.reconcile import LAUNCH_RESEND_S, STOP_RESEND_S, do_reconcile_host
from portal.fleet.models import Gpu, Host
from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox
from tests.factories import beat
from tests.portal.helpers import place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def entry(
    sandbox: Sandbox | None = None, key: str = "", state: str = "running", **kw: Any
) -> Any:  # an agent's report entry, as JSON
    key = key or (sandbox.allocation_key if sandbox else "")
    return {
        "allocation_key": key,
        "sandbox_id": sandbox.pk if sandbox else 0,
        "state": state,
        "exit_code": kw.get("exit_code"),
        "reason": kw.get("reason"),
        "started_at_ms": kw.get("started_at_ms"),
        "handle": {"driver": "docker", "allocation_key": key, "sandbox_id": 0, "ref": "c1"},
        "tracked": kw.get("tracked", True),
    }


def placed(people: Any, catalog: Any, running: bool = True, tier: str = "dedicated") -> Sandbox:
    sandbox = request(people["owner"], people["project"], catalog[tier], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    if running:
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c1"}, timezone.now())
        sandbox.refresh_from_db()
    return sandbox


def host_of(sandbox: Sandbox) -> str:
    assert sandbox.host is not None
    return sandbox.host.name


def later(seconds: float = 1) -> Any:
    return timezone.now() + timedelta(seconds=seconds)


def stops(sent: list[Any]) -> list[str]:
    return [args[0] for _, task, args in sent if task == "stop_sandbox"]


def test_a_matching_report_changes_nothing(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = placed(people, catalog)
    repairs = do_reconcile_host(host_of(sandbox), later(), [entry(sandbox)])
    assert not repairs
    sandbox.refresh_from_db()
    assert sandbox.state == "running"


def test_orphans_are_stopped(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = placed(people, catalog)
    actions.do_request_stop(sandbox.pk, people["owner"])
    actions.do_mark_stopped(sandbox.allocation_key, timezone.now())
    sent_tasks.clear()
    report = [entry(sandbox), entry(key="never-heard-of")]
    repairs = do_reconcile_host(host_of(sandbox), later(), report)
    assert sorted(repairs.orphans_stopped) == sorted([sandbox.allocation_key, "never-heard-of"])
    assert sorted(stops(sent_tasks)) == sorted(repairs.orphans_stopped)


def test_a_report_taken_before_the_stop_is_no_orphan(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """An agent's report goes out with its next beat, up to a beat after it was taken: read
    after a stop it still lists the sandbox running. make run warned "orphan sandbox" a beat
    after every stop and stopped it again; a listing taken after the end is one."""
    sandbox = placed(people, catalog)
    host = host_of(sandbox)
    listed_at = timezone.now()
    actions.do_request_stop(sandbox.pk, people["owner"])
    actions.do_mark_stopped(sandbox.allocation_key, later(1))
    sent_tasks.clear()
    assert not do_reconcile_host(host, listed_at, [entry(sandbox)])
    assert not stops(sent_tasks)
    after = do_reconcile_host(host, later(2), [entry(sandbox)])
    assert after.orphans_stopped == [sandbox.allocation_key]


def test_an_exited_run_waiting_for_its_clean_up_is_no_orphan(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """A batch that exits by itself is recorded stopped and its clean-up stop sent; the
    agent's next report may still list it, exited: no orphan warning for the normal end of a
    run (make run's terminal printed one after every batch), but it is one once the stop
    should long have been carried out."""
    sandbox = placed(people, catalog)
    host = host_of(sandbox)
    do_reconcile_host(host, later(), [entry(sandbox, state="exited", exit_code=0)])
    sandbox.refresh_from_db()
    assert sandbox.state == "stopped" and stops(sent_tasks) == [sandbox.allocation_key]
    sent_tasks.clear()
    exited = [entry(sandbox, state="exited", exit_code=0)]
    assert not do_reconcile_host(host, later(5), exited)
    assert not stops(sent_tasks)
    overdue = do_reconcile_host(host, later(STOP_RESEND_S + 5), exited)
    assert overdue.orphans_stopped == [sandbox.allocation_key]


def test_a_vanished_sandbox_fails_and_frees_its_gpu(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = placed(people, catalog)
    repairs = do_reconcile_host(host_of(sandbox), later(), [])
    assert repairs.vanished == [sandbox.pk]
    sandbox.refresh_from_db()
    assert sandbox.state == "failed" and "vanished" in sandbox.failure
    assert not Allocation.objects.filter(sandbox=sandbox, active=True).exists()
    assert UsageRecord.objects.get(sandbox=sandbox).ended_at is not None
    # The next report is the same: nothing more happens (idempotent).
    assert not do_reconcile_host(host_of(sandbox), later(2), [])


def test_a_vanished_sandbox_of_a_requeue_tier_queues_again(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    catalog["dedicated"].requeue_on_failure = True
    catalog["dedicated"].save()
    sandbox = placed(people, catalog)
    old_key, host = sandbox.allocation_key, host_of(sandbox)
    do_reconcile_host(host, later(), [])
    sandbox.refresh_from_db()
    assert sandbox.state == "queued" and sandbox.host is None and sandbox.allocation_key == ""
    assert "requeued: vanished" in str(sandbox.events.values_list("message", flat=True).last())
    # If the lost copy turns up again, it is an orphan.
    assert do_reconcile_host(host, later(2), [entry(key=old_key)]).orphans_stopped == [old_key]


def test_a_report_taken_before_the_start_does_not_count_as_vanished(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = placed(people, catalog)
    assert not do_reconcile_host(host_of(sandbox), timezone.now() - timedelta(seconds=5), [])
    sandbox.refresh_from_db()
    assert sandbox.state == "running"


def test_a_sandbox_still_being_launched_when_the_report_was_taken_is_not_vanished(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """The agent reports a launch under way as ``created`` (the driver lists it only once set
    up); read after the sandbox was marked running, that report must leave it running."""
    sandbox = placed(people, catalog)
    report: list[Any] = [
        {
            "allocation_key": sandbox.allocation_key,
            "sandbox_id": sandbox.pk,
            "state": "created",
            "tracked": True,
        }
    ]
    assert not do_reconcile_host(host_of(sandbox), later(), report)
    sandbox.refresh_from_db()
    assert sandbox.state == "running"


def test_a_lost_launch_report_is_recovered(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = placed(people, catalog, running=False)
    assert sandbox.state == "starting"
    started_ms = int(timezone.now().timestamp() * 1000)
    repairs = do_reconcile_host(host_of(sandbox), later(), [entry(sandbox, started_at_ms=started_ms)])
    assert repairs.marked_running == [sandbox.pk]
    sandbox.refresh_from_db()
    assert sandbox.state == "running" and (sandbox.handle or {}).get("ref") == "c1"


def test_a_lost_launch_message_is_sent_again(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = placed(people, catalog, running=False)
    sent_tasks.clear()
    assert not do_reconcile_host(host_of(sandbox), later(), [])  # still within the launch's time
    repairs = do_reconcile_host(host_of(sandbox), later(LAUNCH_RESEND_S + 1), [])
    assert repairs.launches_resent == [sandbox.pk]
    [(_, _, (spec,))] = [t for t in sent_tasks if t[1] == "launch_sandbox"]
    assert spec["allocation_key"] == sandbox.allocation_key
    # Reports within LAUNCH_RESEND_S of that resend leave the slow launch alone; then it
    # is sent once more.
    assert not do_reconcile_host(host_of(sandbox), later(5), [])
    assert do_reconcile_host(host_of(sandbox), later(LAUNCH_RESEND_S + 2), []).launches_resent


def test_a_created_but_never_started_sandbox_is_launched_again(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = placed(people, catalog, running=False)
    report = [entry(sandbox, state="created")]
    assert not do_reconcile_host(host_of(sandbox), later(), report)  # not an exit, not yet overdue
    assert do_reconcile_host(host_of(sandbox), later(LAUNCH_RESEND_S + 1), report).launches_resent
    sandbox.refresh_from_db()
    assert sandbox.state == "starting"


def test_an_exit_is_recorded_with_its_reason(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = placed(people, catalog)
    oom = "out of memory: killed at the memory limit"
    report = [entry(sandbox, state="exited", exit_code=137, reason=oom)]
    repairs = do_reconcile_host(host_of(sandbox), later(), report)
    assert repairs.exited == [sandbox.pk]
    sandbox.refresh_from_db()
    assert sandbox.state == "stopped"
    last = str(sandbox.events.values_list("message", flat=True).last())
    assert "out of memory" in last and "137" in last
    assert stops(sent_tasks)[-1] == sandbox.allocation_key  # the agent cleans it up


def test_a_restarted_agent_is_told_to_adopt(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = placed(people, catalog)
    sent_tasks.clear()
    repairs = do_reconcile_host(host_of(sandbox), later(), [entry(sandbox, tracked=False)])
    assert repairs.adopted == [sandbox.pk]
    assert [t[1] for t in sent_tasks] == ["launch_sandbox"]


def test_a_lost_host_loses_its_sandboxes(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:

    sandbox = placed(people, catalog)
    host = Host.objects.get(name=host_of(sandbox))
    Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert mark_lost_hosts(timezone.now()) >= 1
    host.refresh_from_db()
    sandbox.refresh_from_db()
    assert host.state == "lost"
    assert not Gpu.objects.filter(host=host, state="available").exists()
    assert sandbox.state == "failed" and f"host {host.name} lost" in sandbox.failure


def test_a_host_whose_agent_still_beats_is_not_lost_while_its_beats_wait_in_the_queue(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """The control workers were away: the database saw no beat for minutes, but the agent's
    liveness key is fresh (its beats are queued behind this tick). Lost only when both are."""
    import redis
    from django.conf import settings

    from wire import liveness

    sandbox = placed(people, catalog)
    host = Host.objects.get(name=host_of(sandbox))
    now = timezone.now()
    Host.objects.filter(pk=host.pk).update(last_heartbeat_at=now - timedelta(minutes=5))
    client = redis.Redis.from_url(settings.REDIS_URL)
    liveness.note_alive(client, [host.name], int(now.timestamp() * 1000) - 1000)
    mark_lost_hosts(now)
    host.refresh_from_db()
    assert host.state == "up"
    # Revoked, its beats are dropped unread: its own liveness key (written through a Redis
    # without per-host users) does not keep it up.
    from portal.fleet.models import HostCredential

    credential = HostCredential.objects.create(host=host.name, password_sha256="0" * 64, revoked_at=now)
    assert mark_lost_hosts(now) >= 1
    host.refresh_from_db()
    assert host.state == "lost"
    credential.delete()
    Host.objects.filter(pk=host.pk).update(state="up")
    liveness.note_alive(client, [host.name], int(now.timestamp() * 1000) - 5 * 60 * 1000)
    assert mark_lost_hosts(now) >= 1
    host.refresh_from_db()
    sandbox.refresh_from_db()
    assert host.state == "lost" and sandbox.state == "failed"


def test_the_utilization_window_is_stored_for_idle_culling(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = placed(people, catalog)
    at = later()
    report: list[Any] = [{**entry(sandbox), "util": [3.5, 590.0]}]
    assert not do_reconcile_host(host_of(sandbox), at, report)  # not a repair
    sandbox.refresh_from_db()
    assert (sandbox.gpu_util_pct, sandbox.gpu_util_window_s, sandbox.gpu_util_at) == (3.5, 590.0, at)


def test_an_unmeasured_utilization_window_stops_culling_counting(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """Guards review §1.3: a window with no measured sample (MIG without GPM) reaches the
    portal as None, not 0: culling skips the sandbox and its idle streak is dropped."""
    sandbox = placed(people, catalog)
    Sandbox.objects.filter(pk=sandbox.pk).update(gpu_util_pct=0.0, idle_since=later(), idle_warned_at=later())
    at = later()
    report: list[Any] = [{**entry(sandbox), "util": (None, 590.0)}]
    assert not do_reconcile_host(host_of(sandbox), at, report)
    sandbox.refresh_from_db()
    assert (sandbox.gpu_util_pct, sandbox.gpu_util_at, sandbox.idle_since, sandbox.idle_warned_at) == (
        None,
        at,
        None,
        None,
    )


def test_a_round_of_empty_reports_reconciles_only_the_hosts_holding_sandboxes(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """A fleet's first round after its agents started carries every host's report, nearly
    all empty: one query finds the hosts the database has sandboxes on, and only those are
    reconciled (here the one whose sandbox vanished)."""
    sandbox = placed(people, catalog)
    beats = [beat(name) for name in Host.objects.values_list("name", flat=True)]
    for one in beats:
        one["owned"], one["owned_ms"] = [], int(later().timestamp() * 1000)
    with CaptureQueriesContext(connection) as queries:
        tasks.agent_heartbeats(beats)
    reconciled = [
        q for q in queries.captured_queries if 'FROM "fleet_host"' in q["sql"] and "LIMIT 1" in q["sql"]
    ]
    assert len(reconciled) == 1  # do_reconcile_host's host, for the one host holding a sandbox
    sandbox.refresh_from_db()
    assert sandbox.state == "failed" and "vanished" in sandbox.failure
