"""Projects: who is in them, what they use, and how much of their quota is left."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, Sum
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.accounts.access import visible_projects
from portal.accounts.members import (
    MembershipError,
    can_manage_members,
    do_add_member,
    do_change_role,
    do_remove_member,
    do_set_member_limit,
)
from portal.accounts.models import Membership, Project
from portal.billing.models import UsageRecord
from portal.billing.pricing import format_money
from portal.catalog.storage import storage_lines
from portal.inputs import whole_number
from portal.quotas.departments import project_ids_below, tree_figures
from portal.quotas.models import Department, ModelQuota, QuotaPolicy
from portal.quotas.usage import gpu_hours_since, month_start
from portal.sandboxes.models import LIVE_STATES, Allocation
from portal.telemetry.utilization import GpuHours, gpu_hours


def _bar(used: float, limit: float | None) -> dict[str, Any]:
    share = 0 if not limit else min(100, round(100 * used / limit))
    shown = f"{round(used, 3):g}"
    return {"used": shown, "limit": limit, "pct": share, "level": "high" if share >= 80 else "ok"}


def quota_bars(projects: list[Project]) -> dict[int, list[tuple[str, dict[str, Any]]]]:
    """Per project: live sandboxes and GPUs held against the quota's limits (3 queries)."""
    ids = [p.pk for p in projects]
    quotas = {q.project_id: q for q in QuotaPolicy.objects.filter(project_id__in=ids)}
    live = dict(
        Project.objects.filter(pk__in=ids)
        .annotate(n=Count("sandboxes", filter=Q(sandboxes__state__in=LIVE_STATES)))
        .values_list("pk", "n")
    )
    held = dict(
        Allocation.objects.filter(active=True, sandbox__project_id__in=ids)
        .values("sandbox__project_id")
        .annotate(milli=Sum("milli_gpu"))
        .values_list("sandbox__project_id", "milli")
    )
    bars: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for pk in ids:
        quota = quotas.get(pk)
        gpus = (held.get(pk) or 0) / 1000
        bars[pk] = [
            ("Live sandboxes", _bar(live.get(pk, 0), quota.max_live_sandboxes if quota else None)),
            ("GPUs held", _bar(gpus, quota.max_gpus if quota else None)),
        ]
        if quota is not None and quota.max_gpu_hours_month is not None:
            now = timezone.now()
            used = round(gpu_hours_since(pk, month_start(now), now), 1)
            bars[pk].append(("GPU-hours this month", _bar(used, quota.max_gpu_hours_month)))
    _model_bars(ids, bars)
    return bars


def _model_bars(ids: list[int], bars: dict[int, list[tuple[str, dict[str, Any]]]]) -> None:
    """Each limit per GPU model: what the project holds of its models, and their GPU-hours
    this month (2 queries, and 2 a limit on hours)."""
    limits = list(
        ModelQuota.objects.filter(quota__project_id__in=ids).select_related("quota").order_by("name")
    )
    if not limits:
        return
    held: dict[tuple[int, str], int] = {
        (project, model): milli
        for project, model, milli in Allocation.objects.filter(active=True, sandbox__project_id__in=ids)
        .values("sandbox__project_id", "gpu__model")
        .annotate(milli=Sum("milli_gpu"))
        .values_list("sandbox__project_id", "gpu__model", "milli")
    }
    now = timezone.now()
    for limit in limits:
        assert limit.quota is not None  # noqa: S101 - only projects' limits are read here
        pk, covered = limit.quota.project_id, limit.covered
        if limit.max_gpus is not None:
            gpus = sum(held.get((pk, model), 0) for model in covered) / 1000
            bars[pk].append((f"{limit.name} GPUs held", _bar(gpus, limit.max_gpus)))
        if limit.max_gpu_hours_month is not None:
            used = round(gpu_hours_since(pk, month_start(now), now, covered), 1)
            bars[pk].append((f"{limit.name} GPU-hours this month", _bar(used, limit.max_gpu_hours_month)))


def department_lines(quota: QuotaPolicy | None) -> list[dict[str, Any]]:
    """The project's department and each unit above it, the nearest first: what all of the
    projects under it hold now against the guarantee it gives (its own, or its parts' as the
    scheduler counts them) and its limit (2 queries, and 2 a level)."""
    if quota is None or quota.department is None:
        return []
    given = tree_figures(list(Department.objects.all()))
    lines = []
    for unit in [quota.department, *quota.department.ancestors()]:
        under = project_ids_below(unit)
        milli = Allocation.objects.filter(active=True, sandbox__project_id__in=under).aggregate(
            milli=Sum("milli_gpu")
        )["milli"]
        held = (milli or 0) / 1000
        guaranteed = given[unit.pk][1]
        lines.append(
            {
                "unit": unit,
                "projects": len(under),
                "guaranteed": guaranteed,
                "over_guarantee": guaranteed is not None and held > guaranteed,
                "bar": _bar(held, unit.max_gpus),
            }
        )
    return lines


@login_required
def project_list(request: HttpRequest) -> HttpResponse:
    projects = list(visible_projects(request.user).distinct())
    roles = dict(
        Membership.objects.filter(user_id=int(request.user.pk or 0)).values_list("project_id", "role")
    )
    bars = quota_bars(projects)
    rows = [
        (p, Membership.Role(roles[p.pk]).label if p.pk in roles else "admin", bars[p.pk]) for p in projects
    ]
    return render(request, "accounts/project_list.html", {"rows": rows})


def _project_for(request: HttpRequest, slug: str) -> Project:
    project = visible_projects(request.user).filter(slug=slug).first()
    if project is None:
        raise Http404("No such project")
    return project


def _utilization_parts(hours: GpuHours | None) -> list[dict[str, Any]]:
    """The month's allocated GPU-hours split for a stacked bar: used, idle, unmeasured."""
    if hours is None or not hours.allocated:
        return []
    parts = [
        ("used", "Used", hours.used),
        ("idle", "Idle", hours.idle),
        ("unmeasured", "Unmeasured", hours.unmeasured),
    ]
    return [
        {"key": key, "label": label, "hours": value, "pct": float(100 * value / hours.allocated)}
        for key, label, value in parts
    ]


@login_required
def project_detail(request: HttpRequest, slug: str) -> HttpResponse:
    project = _project_for(request, slug)
    now = timezone.now()
    month = UsageRecord.objects.filter(project=project, started_at__gte=month_start(now))
    charged = [
        format_money(micros, currency)
        for currency, micros in month.values("currency")
        .annotate(c=Sum("cost_micros"))
        .values_list("currency", "c")
    ]
    hours = gpu_hours("project", month_start(now), now, now=now, only=[project.pk]).get(project.pk)
    quota = QuotaPolicy.objects.filter(project=project).select_related("department__parent").first()
    invoices = list(
        project.invoices.annotate(credited=Sum("credit_notes__amount_micros")).order_by(
            "-period_start", "currency"
        )[:24]
    )
    for invoice in invoices:
        credited = getattr(invoice, "credited", None)
        invoice.credited_display = format_money(credited, invoice.currency) if credited else "—"  # type: ignore[attr-defined]
    return render(
        request,
        "accounts/project_detail.html",
        {
            "project": project,
            "members": project.memberships.select_related("user").order_by("user__username"),
            "can_manage": can_manage_members(request.user, project),
            "roles": Membership.Role.choices,
            "bars": quota_bars([project])[project.pk],
            "quota": quota,
            "departments": department_lines(quota),
            "hours": hours,
            "storage": storage_lines(None, request.user, project),
            "parts": _utilization_parts(hours),
            "invoices": invoices,
            "charged": " + ".join(charged) or "nothing",
            "month": month_start(now),
        },
    )


def _member_limit(data: Any) -> int | None:
    """The posted GPU limit of a member: empty for none, else a whole number."""
    text = str(data.get("max_gpus", "")).strip()
    if not text:
        return None
    value = whole_number(text)
    if value is None:
        raise MembershipError("A member's GPU limit is a whole number, or empty for none.")
    return value


@login_required
@require_POST
def project_members(request: HttpRequest, slug: str) -> HttpResponse:
    """Add, change the role of, or remove a member (project managers and admins)."""
    project = _project_for(request, slug)
    if not can_manage_members(request.user, project):
        raise PermissionDenied("Only the project's managers and admins change its members.")
    action, role = request.POST.get("action", ""), request.POST.get("role", "")
    try:
        if action == "add":
            added = do_add_member(project, request.POST.get("username", ""), role)
            messages.success(
                request, f"{added.user.get_username()} joined {project.name} as {added.get_role_display()}."
            )
        elif action == "role":
            changed = do_change_role(project, whole_number(request.POST.get("membership")) or 0, role)
            messages.success(request, f"{changed.user.get_username()} is now {changed.get_role_display()}.")
        elif action == "limit":
            changed = do_set_member_limit(
                project, whole_number(request.POST.get("membership")) or 0, _member_limit(request.POST)
            )
            limit = (
                "no GPU limit of their own"
                if changed.max_gpus is None
                else f"at most {changed.max_gpus} GPUs"
            )
            messages.success(
                request, f"{changed.user.get_username()} may now hold {limit} in {project.name}."
            )
        elif action == "remove":
            do_remove_member(project, whole_number(request.POST.get("membership")) or 0)
            messages.success(request, "Member removed.")
        else:
            raise MembershipError(f"Unknown action {action!r}.")
    except (MembershipError, ValueError) as exc:
        messages.error(request, str(exc))
    return redirect("project-detail", slug=project.slug)
