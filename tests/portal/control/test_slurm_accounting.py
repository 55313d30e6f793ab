"""The ledger of a sandbox that ran as a Slurm job, checked against what slurmdbd accounted
(portal/control/slurm_accounting.py): agreement is quiet, a difference in time or GRES is an
alert for admins, and a ledger still open waits (issue 39)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.control.retry import Retry
from portal.control.slurm_accounting import do_check_accounting
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from portal.telemetry.models import Alert
from tests.portal.helpers import place_all, request
from wire.messages import SlurmAccounting

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]


def ran(people: Any, catalog: Any, tier: str, seconds: int, **kw: Any) -> Sandbox:
    """A sandbox that started on the whole second and ran ``seconds``, its ledger closed."""
    sandbox = request(people["owner"], people["project"], catalog[tier], catalog["image"], **kw)
    place_all()
    sandbox.refresh_from_db()
    start = timezone.now().replace(microsecond=0) - timedelta(seconds=seconds + 5)
    actions.do_mark_running(sandbox.allocation_key, {"driver": "slurm", "ref": "7"}, start)
    actions.do_request_stop(sandbox.pk, people["owner"])
    actions.do_mark_stopped(sandbox.allocation_key, start + timedelta(seconds=seconds))
    sandbox.refresh_from_db()
    return sandbox


def record(sandbox: Sandbox, elapsed_s: int, gres: dict[str, int]) -> SlurmAccounting:
    start = int(sandbox.started_at.timestamp())  # type: ignore[union-attr]
    return SlurmAccounting(job_id=7, start_s=start, end_s=start + elapsed_s, elapsed_s=elapsed_s, gres=gres)


def accounting_alerts() -> list[str]:
    return list(Alert.objects.filter(kind=Alert.Kind.ACCOUNTING).values_list("message", flat=True))


def test_a_job_that_agrees_with_the_ledger_raises_nothing(people: Any, catalog: Any) -> None:
    sandbox = ran(people, catalog, "dedicated", 42)
    assert do_check_accounting(sandbox.allocation_key, record(sandbox, 42, {"gpu": 1, "shard": 0})) is None
    mps = ran(people, catalog, "mps", 10, mps_memory_mib=1024, mps_thread_pct=30)
    assert do_check_accounting(mps.allocation_key, {**record(mps, 11, {"mps": 30}), "job_id": 8}) is None
    assert accounting_alerts() == []  # one second apart is within the tolerance


def test_a_difference_in_time_or_gres_is_an_alert_for_admins(people: Any, catalog: Any) -> None:
    sandbox = ran(people, catalog, "dedicated", 42)
    do_check_accounting(sandbox.allocation_key, record(sandbox, 50, {"gpu": 2}))
    [message] = accounting_alerts()
    assert "Slurm job 7" in message and "billed 42.0 s, Slurm accounted 50 s" in message
    assert "placed {'gpu': 1}, Slurm accounted {'gpu': 2}" in message
    alert = Alert.objects.get(kind=Alert.Kind.ACCOUNTING)
    assert alert.sandbox_id == sandbox.pk and alert.host == sandbox.host
    do_check_accounting(sandbox.allocation_key, record(sandbox, 50, {"gpu": 2}))
    assert len(accounting_alerts()) == 1  # once per job


def test_a_ledger_still_open_waits_for_the_end(people: Any, catalog: Any) -> None:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "slurm", "ref": "7"}, timezone.now())
    sandbox.refresh_from_db()
    assert isinstance(do_check_accounting(sandbox.allocation_key, record(sandbox, 3, {"gpu": 1})), Retry)
    assert do_check_accounting("no-such-key", record(sandbox, 3, {"gpu": 1})) is None
