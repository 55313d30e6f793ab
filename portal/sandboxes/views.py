"""Thin views: they read, and call ``actions`` to change anything."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.accounts.access import can_manage_sandbox, visible_projects
from portal.billing.ledger import cost_by
from portal.billing.pricing import cost_micros
from portal.catalog.models import Tier
from portal.catalog.sharing import LABELS, TIMESLICE
from portal.catalog.storage import storage_lines
from portal.fleet.modes import most_replicas
from portal.inputs import whole_number
from portal.sandboxes import actions, unread
from portal.sandboxes.forms import EXTEND_CHOICES_H, SandboxRequestForm, tier_menus
from portal.sandboxes.models import Allocation, Notification, Sandbox
from portal.sandboxes.output import read_output
from portal.sandboxes.reach import TERMINAL_ISOLATION, app_origin


def _sandboxes_for_user(user: object) -> QuerySet[Sandbox]:
    # The tier's priority class: its preemption rule is on every status part.
    return Sandbox.objects.filter(project__in=visible_projects(user)).select_related(
        "project", "owner", "tier__priority_class", "image", "host"
    )


def get_sandbox_for_user(request: HttpRequest, pk: int) -> Sandbox:
    """The sandbox, or 404 for anything the user may not see (no hint it exists)."""
    sandbox = _sandboxes_for_user(request.user).filter(pk=pk).first()
    if sandbox is None:
        raise Http404("No such sandbox")
    return sandbox


# Rows per page of the list, newest first. Every open list refreshes its page every few
# seconds: 200 rows were 30 ms of a web process's CPU each time, most of a busy portal's.
LIST_PAGE_ROWS = 50
LIST_PAGES = 10_000


@login_required
def sandbox_list(request: HttpRequest) -> HttpResponse:
    raw_page = request.GET.get("page")
    page = whole_number(raw_page, 1, LIST_PAGES)
    if raw_page is not None and page is None:
        problem = f"page: a whole number from 1 to {LIST_PAGES}."
        return HttpResponseBadRequest(problem, content_type="text/plain")
    page = page or 1
    start = (page - 1) * LIST_PAGE_ROWS
    # One row more than the page tells whether an older page exists, without counting them all.
    rows = list(_sandboxes_for_user(request.user)[start : start + LIST_PAGE_ROWS + 1])
    context = {
        "sandboxes": rows[:LIST_PAGE_ROWS],
        "page": page,
        "newer_page": page - 1 if page > 1 else None,
        "older_page": page + 1 if len(rows) > LIST_PAGE_ROWS else None,
    }
    template = "sandboxes/_rows.html" if request.headers.get("HX-Request") else "sandboxes/list.html"
    return render(request, template, context)


@login_required
def sandbox_new(request: HttpRequest) -> HttpResponse:
    tiers = list(Tier.objects.filter(active=True))
    menus = tier_menus(tiers)
    form = SandboxRequestForm(request.POST or None, user=request.user, for_create=True, menus=menus)
    if request.method == "POST" and form.is_valid() and form.request_obj is not None:
        try:
            sandbox = actions.do_request_sandbox(request.user, form.request_obj)
        except actions.SandboxRequestError as exc:  # the quota, checked under the project's lock
            form.add_request_error(exc)
        else:
            return redirect("sandbox-detail", pk=sandbox.pk)
    tier_modes = {str(t.pk): t.sharing_mode for t in tiers}
    # What each mode the tiers offer gives and does not, stated before anyone chooses.
    offered = [mode for mode in LABELS if mode in tier_modes.values()]
    return render(
        request,
        "sandboxes/new.html",
        {
            "form": form,
            "tier_modes": tier_modes,
            "tier_menus": menus,
            "tier_profiles": {str(t.pk): t.mig_profiles for t in tiers if t.mig_profiles},
            "offered_modes": offered,
            "replicas": most_replicas() if TIMESLICE in offered else None,
        },
        status=400 if form.errors else 200,
    )


@login_required
def notifications(request: HttpRequest) -> HttpResponse:
    """The signed-in user's notifications, newest first; POST marks them all read."""
    mine = Notification.objects.filter(user_id=int(request.user.pk or 0)).select_related("sandbox")
    if request.method == "POST":
        mine.filter(read_at=None).update(read_at=timezone.now())
        unread.forget([int(request.user.pk or 0)])
        return redirect("notifications")
    return render(request, "sandboxes/notifications.html", {"notifications": mine[:100]})


HOUR_US = 3600 * 1_000_000


def _whole_seconds(delta: timedelta) -> timedelta:
    return timedelta(seconds=max(0, int(delta.total_seconds())))


def _status_context(sandbox: Sandbox) -> dict[str, object]:
    """What the status part shows (templates/sandboxes/_status.html): the detail page renders
    it inside, and its pushes fetch it alone, so nothing else is read here."""
    usage = list(sandbox.usage.all())
    now = timezone.now()
    cost = cost_by(usage, now)
    allocations = list(sandbox.allocations.select_related("gpu", "mig_instance"))
    time_left = (
        _whole_seconds(sandbox.started_at + sandbox.max_duration - now)
        if sandbox.started_at and sandbox.state == "running"
        else None
    )
    return {
        "sandbox": sandbox,
        "extend_hours": EXTEND_CHOICES_H,
        "events": sandbox.events.select_related("actor"),
        "allocations": allocations,
        "usage": usage,
        "app_origin": app_origin(sandbox) if sandbox.image.app else None,
        "cost": f"{cost / 1_000_000:.4f} {sandbox.tier.currency}",
        # The page moves these two on between pushes (static/src/sandbox-status.js): the cost
        # grows at the open intervals' price, linear in time (portal/billing/pricing.py).
        "cost_micros": cost,
        "cost_per_hour_micros": sum(
            cost_micros(u.price_per_gpu_hour_micros, u.priced_milli, HOUR_US)
            for u in usage
            if u.ended_at is None
        ),
        "time_left": time_left,
        "seconds_left": int(time_left.total_seconds()) if time_left is not None else None,
    }


@login_required
def sandbox_detail(request: HttpRequest, pk: int) -> HttpResponse:
    sandbox = get_sandbox_for_user(request, pk)
    context = _status_context(sandbox)
    context["can_manage"] = can_manage_sandbox(request.user, sandbox)
    context["storage"] = storage_lines(sandbox.tier, sandbox.owner, sandbox.project)
    # The GPU a time-slice replica shares: its replica count and memory make its terms concrete.
    allocations: list[Allocation] = context["allocations"]  # type: ignore[assignment]
    shared_gpu = next((a.gpu for a in allocations if a.kind == Allocation.Kind.TIMESLICE), None)
    context["share_replicas"] = shared_gpu.timeslice_replicas if shared_gpu else None
    context["share_memory_mib"] = shared_gpu.memory_mib if shared_gpu else None
    # Shown while it lives (the page is loaded before it runs); the socket itself refuses a
    # sandbox that is not running yet, and says so.
    context["can_open_terminal"] = (
        sandbox.is_live
        and sandbox.isolation in TERMINAL_ISOLATION
        and not (sandbox.host and sandbox.host.simulated_sandboxes)
        and can_manage_sandbox(request.user, sandbox)
    )
    if sandbox.batch:  # its output's tail; the page follows it live from there
        context["output"] = read_output(sandbox, None, PAGE_OUTPUT_BYTES)
    return render(request, "sandboxes/detail.html", context)


PAGE_OUTPUT_BYTES = 64 * 1024


@login_required
def sandbox_output_download(request: HttpRequest, pk: int) -> HttpResponse:
    """All the kept output of a batch, as a text file (its bytes as the run printed them)."""
    sandbox = get_sandbox_for_user(request, pk)
    view = read_output(sandbox, 0, settings.BATCH_OUTPUT_MAX_BYTES * 2)
    response = HttpResponse(view.data, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="sandbox-{sandbox.pk}-output.txt"'
    response["X-Content-Type-Options"] = "nosniff"
    return response


@login_required
def sandbox_status(request: HttpRequest, pk: int, extend_error: str = "") -> HttpResponse:
    """The htmx-polled part of the detail page: state, events, usage."""
    sandbox = get_sandbox_for_user(request, pk)
    context = _status_context(sandbox)
    context["extend_error"] = extend_error
    context["can_manage"] = can_manage_sandbox(request.user, sandbox)
    return render(request, "sandboxes/_status.html", context)


@login_required
@require_POST
def sandbox_extend(request: HttpRequest, pk: int) -> HttpResponse:
    sandbox = get_sandbox_for_user(request, pk)
    if not can_manage_sandbox(request.user, sandbox):
        raise PermissionDenied("Only the owner, a project manager or an admin can extend this sandbox.")
    hours = whole_number(request.POST.get("hours"))
    problem = ""
    if hours not in EXTEND_CHOICES_H:
        problem = f"Extend by one of {', '.join(map(str, EXTEND_CHOICES_H))} hours."
    else:
        try:
            actions.do_extend(sandbox.pk, request.user, timedelta(hours=hours))
        except actions.SandboxRequestError as exc:
            problem = exc.message
    if request.headers.get("HX-Request"):
        response = sandbox_status(request, pk, extend_error=problem)
        response.status_code = 400 if problem else 200
        return response
    if problem:
        messages.error(request, problem)
    return redirect("sandbox-detail", pk=pk)


@login_required
@require_POST
def sandbox_stop(request: HttpRequest, pk: int) -> HttpResponse:
    sandbox = get_sandbox_for_user(request, pk)
    if not can_manage_sandbox(request.user, sandbox):
        raise PermissionDenied("Only the owner, a project manager or an admin can stop this sandbox.")
    actions.do_request_stop(sandbox.pk, request.user)
    if request.headers.get("HX-Request"):
        return sandbox_status(request, pk)
    return redirect("sandbox-detail", pk=pk)
