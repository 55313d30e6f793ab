"""Allocated / used / idle / unmeasured GPU-hours from the ledger and the minute rollups,
checked against figures worked out by hand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from portal.accounts.models import ApiToken
from portal.billing.models import UsageRecord
from portal.sandboxes.models import Sandbox
from portal.telemetry.models import SandboxRollup
from portal.telemetry.utilization import (
    GpuHours,
    Grouping,
    _gpu_hours_in_python,
    by_sandbox,
    gpu_hours,
)
from tests.portal.helpers import client_for, request

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)
NOW = T0 + timedelta(minutes=3, seconds=30)
END = T0 + timedelta(hours=1)
NANO = Decimal("0.000000001")


def minutes(m: float) -> timedelta:
    return timedelta(seconds=m * 60)


def usage(sandbox: Sandbox, milli: int, start: datetime, end: datetime | None) -> None:
    UsageRecord.objects.create(
        sandbox=sandbox, allocation_key=f"k{sandbox.pk}-{start:%H%M%S}", project=sandbox.project,
        user=sandbox.owner, tier=sandbox.tier, gpu_model="H100-80GB", milli_gpu=milli,
        price_per_gpu_hour_micros=1_000_000, currency="EUR", started_at=start, ended_at=end,
        duration=end - start if end else None, cost_micros=0 if end else None,
    )  # fmt: skip


def rollup(sandbox: Sandbox, minute: datetime, util: float | None) -> None:
    SandboxRollup.objects.create(
        sandbox=sandbox, minute=minute, samples=60, mem_min_mib=0, mem_mean_mib=0, mem_max_mib=0,
        util_min_pct=util, util_mean_pct=util, util_max_pct=util, temp_max_c=50, power_mean_w=100,
    )  # fmt: skip


def close(h: GpuHours, allocated: float, used: float, idle: float, unmeasured: float) -> None:
    """Each figure within a nano-GPU-hour of the hand figure (in GPU-minutes), and the four
    adding up exactly."""
    got = (h.allocated, h.used, h.idle, h.unmeasured)
    want = tuple(Decimal(v) / 60 for v in (allocated, used, idle, unmeasured))
    assert all(abs(g - w) <= NANO for g, w in zip(got, want, strict=True)), (got, want)
    assert h.allocated == h.used + h.idle + h.unmeasured


@pytest.fixture
def sandboxes(people: Any, catalog: Any, sent_tasks: Any) -> dict[str, Sandbox]:
    owner, image = people["owner"], catalog["image"]
    a = request(owner, people["project"], catalog["dedicated"], image)
    b = request(owner, people["project"], catalog["mig"], image, mig_profile="1g.10gb")
    c = request(people["outsider"], people["other_project"], catalog["dedicated"], image)
    # a: one whole GPU 10:00-10:10, measured in three of its ten minutes.
    usage(a, 1000, T0, T0 + minutes(10))
    rollup(a, T0, 50)
    rollup(a, T0 + minutes(1), 100)
    rollup(a, T0 + minutes(5), 0)
    # b: half a GPU from 10:00:30, still open at 10:03:30; every minute at 40 %.
    usage(b, 500, T0 + timedelta(seconds=30), None)
    for m in range(4):
        rollup(b, T0 + minutes(m), 40)
    # c: two GPUs 09:50-10:02, before the period in part; measured 09:55 (outside) and 10:01.
    usage(c, 2000, T0 - minutes(10), T0 + minutes(2))
    rollup(c, T0 - minutes(5), 100)
    rollup(c, T0 + minutes(1), 25)
    # An earlier run of c, wholly before the period: not counted.
    usage(c, 2000, T0 - minutes(30), T0 - minutes(20))
    return {"a": a, "b": b, "c": c}


def test_per_sandbox_figures(sandboxes: dict[str, Sandbox], django_assert_num_queries: Any) -> None:
    a, b, c = sandboxes["a"], sandboxes["b"], sandboxes["c"]
    # One SQL statement on PostgreSQL; on SQLite the same sums in Python over two queries
    # (intervals, then their rollups): a fixed count either way, whatever the sandboxes.
    with django_assert_num_queries(1 if connection.vendor == "postgresql" else 2):
        result = by_sandbox(T0, END, now=NOW)
    assert set(result) == {a.pk, b.pk, c.pk}
    # a: 10 GPU-min; measured 3 (50 %, 100 %, 0 % -> 1.5 used, 1.5 idle); 7 unmeasured.
    close(result[a.pk], 10, 1.5, 1.5, 7)
    # b: 3 min x 0.5 = 1.5 GPU-min, all measured (30 s + 60 + 60 + 30 s); 40 % used.
    close(result[b.pk], 1.5, 0.6, 0.9, 0)
    # c: 10:00-10:02 x 2 GPUs = 4 GPU-min; 10:01 measured (2 GPU-min at 25 %); 10:00 not.
    close(result[c.pk], 4, 0.5, 1.5, 2)
    assert result[b.pk].utilization == Decimal("0.4")


def test_per_project_and_per_tier_add_their_sandboxes(
    people: Any, catalog: Any, sandboxes: dict[str, Sandbox]
) -> None:
    projects = gpu_hours("project", T0, END, now=NOW)
    close(projects[people["project"].pk], 11.5, 2.1, 2.4, 7)  # a + b
    close(projects[people["other_project"].pk], 4, 0.5, 1.5, 2)  # c
    tiers = gpu_hours("tier", T0, END, now=NOW)
    close(tiers[catalog["dedicated"].pk], 14, 2, 3, 9)  # a + c
    close(tiers[catalog["mig"].pk], 1.5, 0.6, 0.9, 0)  # b
    assert set(gpu_hours("tier", T0, END, now=NOW, only=[catalog["mig"].pk])) == {catalog["mig"].pk}


def test_the_period_clips_intervals_and_minutes(sandboxes: dict[str, Sandbox]) -> None:
    a = sandboxes["a"]
    # 10:00:30-10:01:30: half of minute 10:00 (50 %) and half of 10:01 (100 %).
    [(key, h)] = by_sandbox(T0 + timedelta(seconds=30), T0 + timedelta(seconds=90), only=[a.pk]).items()
    assert key == a.pk
    close(h, 1, 0.75, 0.25, 0)
    assert by_sandbox(T0 + minutes(20), END, now=NOW) == {}  # nothing allocated then


def test_an_open_interval_counts_up_to_now(sandboxes: dict[str, Sandbox]) -> None:
    b = sandboxes["b"]
    later = by_sandbox(T0, END, now=T0 + minutes(10) + timedelta(seconds=30), only=[b.pk])[b.pk]
    # 10 min x 0.5 = 5 GPU-min; 3.5 min (30 s + 60 + 60 + 60) x 0.5 = 1.75 measured at 40 %:
    # 0.7 used, 1.05 idle; 3.25 unmeasured.
    close(later, 5, 0.7, 1.05, 3.25)


def test_a_minute_with_unmeasured_utilization_is_unmeasured_not_idle(sandboxes: dict[str, Sandbox]) -> None:
    """Guards review §1.3: a MIG device without GPM has rollups with null utilization; those
    minutes are unmeasured, in SQL and in the Python fallback, never counted as idle."""
    a = sandboxes["a"]
    for m in (2, 3, 4):  # three more minutes of a, rolled up but not measured
        rollup(a, T0 + minutes(m), None)
    for h in (
        by_sandbox(T0, END, now=NOW, only=[a.pk])[a.pk],
        _gpu_hours_in_python("sandbox", T0, END, now=NOW, only=[a.pk], projects=None, tiers=None)[a.pk],
    ):
        close(h, 10, 1.5, 1.5, 7)  # as before: the null minutes stay with the unmeasured


def test_projects_filter_keeps_their_usage_only(
    people: Any, catalog: Any, sandboxes: dict[str, Sandbox]
) -> None:
    tiers = gpu_hours("tier", T0, END, now=NOW, projects=[people["project"].pk])
    close(tiers[catalog["dedicated"].pk], 10, 1.5, 1.5, 7)  # a only: c is another project's


@pytest.mark.parametrize("grouping", ["sandbox", "project", "tier"])
@pytest.mark.parametrize(
    ("start", "end", "now"),
    [
        (T0, END, NOW),
        (T0 + timedelta(seconds=30), T0 + timedelta(seconds=90), NOW),
        (T0 - minutes(40), END, END),
    ],
)
def test_the_python_fallback_agrees_with_postgresql(
    sandboxes: dict[str, Sandbox], grouping: Grouping, start: datetime, end: datetime, now: datetime
) -> None:
    """SQLite (the embedded deployment) computes in Python: the same figures to the quantum."""
    rollup(sandboxes["b"], T0 + minutes(4), 100 / 3)  # a third: float to numeric digits agree
    sql = gpu_hours(grouping, start, end, now=now)
    python = _gpu_hours_in_python(grouping, start, end, now=now, only=None, projects=None, tiers=None)
    assert sql == python and sql


PERIOD = {"start": T0.isoformat(), "end": END.isoformat()}


def rows(response: Any) -> dict[str, dict[str, Any]]:
    assert response.status_code == 200, response.content
    return {row["key"]: row for row in response.json()["results"]}


def test_api_gives_each_caller_their_projects_figures(
    people: Any, catalog: Any, sandboxes: dict[str, Sandbox]
) -> None:
    owner, admin = client_for(people["owner"]), client_for(people["admin"])
    mine = rows(owner.get("/api/v1/utilization/", PERIOD))
    assert set(mine) == {"vision"}
    # The open interval of b counts up to the period's end (it is long past).
    want = gpu_hours("project", T0, END, now=END)[people["project"].pk]
    assert mine["vision"]["allocated_gpu_hours"] == f"{want.allocated:.9f}"
    assert mine["vision"]["unmeasured_gpu_hours"] == f"{want.unmeasured:.9f}"
    assert set(rows(admin.get("/api/v1/utilization/", PERIOD))) == {"vision", "nlp"}
    # Per tier, a member sees only their projects' part of a shared tier.
    tiers = rows(owner.get("/api/v1/utilization/", {**PERIOD, "by": "tier"}))
    assert tiers["dedicated"]["allocated_gpu_hours"] == f"{Decimal(10) / 60:.9f}"
    by_sandbox_rows = rows(owner.get("/api/v1/utilization/", {**PERIOD, "by": "sandbox", "tier": "mig"}))
    assert set(by_sandbox_rows) == {str(sandboxes["b"].pk)}
    # Another project's slug gives nothing, not its figures.
    assert (
        rows(client_for(people["outsider"]).get("/api/v1/utilization/", {**PERIOD, "project": "vision"}))
        == {}
    )


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"by": "user"}, "by"),
        ({"start": "yesterday"}, "start"),
        ({"start": "2026-03-02", "end": "2026-03-01"}, "end"),
        ({"start": "2024-01-01", "end": "2026-01-01"}, "end"),
        ({"project": "vi\x00sion"}, "project"),
    ],
)
def test_api_names_the_bad_parameter(people: Any, params: dict[str, str], field: str) -> None:
    response = client_for(people["owner"]).get("/api/v1/utilization/", params)
    assert response.status_code == 400 and field in response.json(), response.content


def test_api_needs_the_read_scope(people: Any) -> None:
    _, key = ApiToken.issue(people["owner"], "writer", [ApiToken.Scope.WRITE_SANDBOXES])
    response = Client().get("/api/v1/utilization/", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 403 and "read:usage" in response.json()["detail"]
