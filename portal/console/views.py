"""Admin console pages beside Django admin."""

from __future__ import annotations

import time

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.core.paginator import Paginator
from django.db import models
from django.db.models import Count, Prefetch, Q
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest, QueryDict
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.audit.models import AuditEntry
from portal.catalog import registries
from portal.catalog.models import ImageRegistry, PriorityClass, SandboxImage, Storage, Tier
from portal.console.forms import (
    ConsolidationForm,
    DepartmentForm,
    FleetFilterForm,
    GpuModeForm,
    GroupRuleForm,
    ImageForm,
    MigRelayoutForm,
    ModelQuotaForm,
    PriorityClassForm,
    QuotaForm,
    RegistryForm,
    StorageForm,
    TierForm,
)
from portal.control.faults import do_drain_gpu, do_undrain_gpu
from portal.control.plans import (
    MigPreview,
    PlanError,
    do_start_consolidation,
    do_start_mig_plan,
    preview_mig_plan,
)
from portal.fleet.models import FleetPlan, Gpu, Host, PlanStep
from portal.fleet.modes import GpuModeError, describe, do_set_gpu_mode, serving
from portal.identity.models import GroupRule
from portal.inputs import plain_text
from portal.quotas.departments import tree_figures
from portal.quotas.models import Department, ModelQuota, QuotaPolicy
from portal.sandboxes.models import Allocation, Sandbox
from portal.scheduling.snapshot import build_fairshare, build_queue, build_snapshot
from scheduler.fairshare import FairOrder
from scheduler.topology import Topology, describe_host


@staff_member_required
def fleet(request: HttpRequest) -> HttpResponse:
    return _fleet_page(request)


HOSTS_PER_PAGE = 25  # the page's size stays the same at two hosts or the openb cluster's 1,213


def _fleet_page(request: HttpRequest, refused: tuple[str, GpuModeForm] | None = None) -> HttpResponse:
    """The fleet page, a page of hosts at a time, searched and filtered (``FleetFilterForm``);
    ``refused``: a GPU's mode form sent back with its error (400), on its host's page."""
    models = list(Gpu.objects.order_by("model").values_list("model", flat=True).distinct())
    query = request.GET.copy()
    if refused is not None:
        query = QueryDict(mutable=True)
        query["q"] = Gpu.objects.values_list("host__name", flat=True).get(uuid=refused[0])
    search = FleetFilterForm(query, models=models)
    bad_search = not search.is_valid()
    wanted = {} if bad_search else search.cleaned_data
    hosts = Host.objects.order_by("name")
    gpus = Gpu.objects.order_by("index")
    if wanted.get("q"):
        hosts = hosts.filter(name__icontains=wanted["q"])
    if wanted.get("state"):
        hosts = hosts.filter(state=wanted["state"])
    for field in ("model", "gpu_state"):
        if wanted.get(field):
            column = {"model": "model", "gpu_state": "state"}[field]
            gpus = gpus.filter(**{column: wanted[field]})
            hosts = hosts.filter(**{f"gpus__{column}": wanted[field]})
    gpus = gpus.prefetch_related("mig_instances").annotate(
        live_allocations=Count("allocations", filter=Q(allocations__active=True))
    )
    shown = Prefetch("gpus", queryset=gpus, to_attr="shown_gpus")
    page = Paginator(hosts.distinct().prefetch_related(shown), HOSTS_PER_PAGE).get_page(
        request.GET.get("page")
    )
    hosts_list = list(page.object_list)
    live = list(
        Allocation.objects.filter(active=True, gpu__host__in=hosts_list).select_related("sandbox__owner")
    )
    # What each MIG instance and GPU holds, for the layout drawings and the modes now.
    in_instance = {a.mig_instance_id: a.sandbox for a in live if a.mig_instance_id is not None}
    held: dict[int, list[Allocation]] = {}
    for alloc in live:
        held.setdefault(alloc.gpu_id, []).append(alloc)
    for host in hosts_list:
        host.topology_text = _topology_text(host.shown_gpus)
        for gpu in host.shown_gpus:
            gpu.host = host  # its form names it: no query per GPU for its host
            form = refused[1] if refused is not None and refused[0] == gpu.uuid else None
            _describe_gpu(gpu, held.get(gpu.pk, []), in_instance, form)
    kept = query.copy()
    kept.pop("page", None)
    return render(
        request,
        "console/fleet.html",
        {"hosts": hosts_list, "page": page, "search": search, "kept_query": kept.urlencode()},
        status=400 if refused is not None or bad_search else 200,
    )


def _topology_text(gpus: list[Gpu]) -> str:
    """The line under a host's name: how its GPUs are linked and their NUMA nodes ("NVLink:
    all 8 GPUs linked · NUMA 0: GPUs 0-3 · NUMA 1: GPUs 4-7"); "" when its agent reports none."""
    topology = Topology.from_gpus(
        (g.index, g.numa_node, {int(peer): level for peer, level in g.links.items()}) for g in gpus
    )
    return describe_host(topology, [g.index for g in gpus])


def _describe_gpu(
    gpu: Gpu, on_gpu: list[Allocation], in_instance: dict[int, Sandbox], form: GpuModeForm | None
) -> None:
    """What the fleet page shows of a GPU: its mode now, its mode form, what holds it."""
    kinds = [a.kind for a in on_gpu]
    shares = [a for a in on_gpu if a.kind == Allocation.Kind.MPS]
    facts = {
        "mode_text": describe(gpu.sharing_mode, kinds),
        "serving": serving(gpu.sharing_mode, kinds),
        # MIG GPUs change only through re-layout plans: no form, unless one came back refused.
        "mode_form": form
        if form is not None or gpu.mig_enabled
        else GpuModeForm(initial={"mode": gpu.sharing_mode}, gpu=gpu),
        "layout": [(m, in_instance.get(m.pk)) for m in gpu.mig_instances.all()],
        "shares": shares,
        "threads_used": sum(a.mps_thread_pct for a in shares),
        "replicas_used": kinds.count(Allocation.Kind.TIMESLICE),
    }
    for name, value in facts.items():
        setattr(gpu, name, value)


@staff_member_required
@require_POST
def set_gpu_mode(request: HttpRequest, uuid: str) -> HttpResponse:
    """Pin a GPU to a sharing mode or let it follow demand; a refusal (it holds sandboxes
    of another mode, it is in MIG mode) comes back as the GPU's form error."""
    gpu = get_object_or_404(Gpu.objects.select_related("host"), uuid=uuid)
    form = GpuModeForm(request.POST, gpu=gpu)
    if form.is_valid():
        try:
            do_set_gpu_mode(gpu.uuid, form.cleaned_data["mode"], request.user)
        except GpuModeError as exc:
            form.add_error("mode", str(exc))
        else:
            gpu.refresh_from_db()
            messages.success(request, f"{gpu}: {gpu.get_sharing_mode_display().lower()}.")
            return redirect("console-fleet")
    return _fleet_page(request, refused=(gpu.uuid, form))


@staff_member_required
@require_POST
def drain_gpu(request: HttpRequest, uuid: str) -> HttpResponse:
    gpu = get_object_or_404(Gpu, uuid=uuid)
    reason = request.POST.get("reason", "").strip()
    if not reason:
        messages.error(request, f"Say why {gpu} is drained: the reason is shown to every admin.")
    elif do_drain_gpu(gpu.uuid, reason, request.user):
        messages.success(request, f"{gpu} drained: it takes no new sandboxes; running ones keep running.")
    else:
        messages.info(request, f"{gpu} is {gpu.get_state_display().lower()}: nothing to drain.")
    return redirect("console-fleet")


@staff_member_required
@require_POST
def undrain_gpu(request: HttpRequest, uuid: str) -> HttpResponse:
    gpu = get_object_or_404(Gpu, uuid=uuid)
    if do_undrain_gpu(gpu.uuid, request.user):
        messages.success(request, f"{gpu} is back in service.")
    else:
        messages.info(request, f"{gpu} is not drained.")
    return redirect("console-fleet")


def _plans_page(
    request: HttpRequest,
    mig_form: MigRelayoutForm | None = None,
    consolidation_form: ConsolidationForm | None = None,
    preview: MigPreview | None = None,
) -> HttpResponse:
    plans = FleetPlan.objects.select_related("created_by").prefetch_related(
        Prefetch("steps", queryset=PlanStep.objects.select_related("sandbox"))
    )[:20]
    return render(
        request,
        "console/plans.html",
        {
            "plans": plans,
            "mig_form": mig_form or MigRelayoutForm(),
            "consolidation_form": consolidation_form or ConsolidationForm(),
            "preview": preview,
            # While a plan runs the list refreshes itself, so an admin watches its steps land.
            "any_running": FleetPlan.objects.filter(state=FleetPlan.State.RUNNING).exists(),
        },
        status=400 if (mig_form or consolidation_form) and not preview else 200,
    )


@staff_member_required
def plans(request: HttpRequest) -> HttpResponse:
    return _plans_page(request)


@staff_member_required
@require_POST
def start_mig_relayout(request: HttpRequest) -> HttpResponse:
    form = MigRelayoutForm(request.POST)
    if not form.is_valid():
        return _plans_page(request, mig_form=form)
    data = form.cleaned_data
    host, profile, limit = data["host"].name, data["profile"], data["max_disturbed"]
    try:
        if request.POST.get("action") == "preview" or not data["fingerprint"]:
            preview = preview_mig_plan(host, profile, limit)
            approve = MigRelayoutForm(initial={**data, "host": host, "fingerprint": preview.fingerprint})
            return _plans_page(request, mig_form=approve, preview=preview)
        plan = do_start_mig_plan(host, profile, limit, request.user, expect=data["fingerprint"])
    except PlanError as exc:
        form.add_error(None, str(exc))
        return _plans_page(request, mig_form=form)
    messages.success(request, f"Plan {plan.pk} started: {plan.purpose}.")
    return redirect("console-plans")


@staff_member_required
@require_POST
def start_consolidation(request: HttpRequest) -> HttpResponse:
    form = ConsolidationForm(request.POST)
    if not form.is_valid():
        return _plans_page(request, consolidation_form=form)
    try:
        plan = do_start_consolidation(form.cleaned_data["max_migrations"], request.user)
    except PlanError as exc:
        form.add_error(None, str(exc))
        return _plans_page(request, consolidation_form=form)
    messages.success(request, f"Plan {plan.pk} started: {plan.purpose}.")
    return redirect("console-plans")


@staff_member_required
def queue(request: HttpRequest) -> HttpResponse:
    """Every waiting request in the order the scheduler takes them (priority class, fair
    share, age), with the reason each one waits."""
    now = time.time()
    requests = build_queue()
    order = FairOrder(requests, build_fairshare(now), build_snapshot().running, now)
    ranked: list[int] = []
    while (item := order.next()) is not None:
        ranked.append(item.id)
        order.settle(item)
    sandboxes = Sandbox.objects.filter(pk__in=ranked).select_related(
        "project", "owner", "tier__priority_class"
    )
    by_id = {s.pk: s for s in sandboxes}
    rows = [by_id[pk] for pk in ranked if pk in by_id]
    held = (
        Sandbox.objects.filter(state="queued")
        .exclude(pk__in=ranked)
        .select_related("project", "owner", "tier")
    )
    return render(request, "console/queue.html", {"rows": rows, "held": held, "now": timezone.now()})


@staff_member_required
def audit_log(request: HttpRequest) -> HttpResponse:
    """The newest audit entries, optionally of one kind of target (``?target=catalog.tier``)."""
    entries = AuditEntry.objects.select_related("actor")
    target = request.GET.get("target", "")
    if plain_text(target, 60) is None:
        return HttpResponseBadRequest("target: a kind of target, such as catalog.tier.")
    if target:
        entries = entries.filter(target_type=target)
    kinds = AuditEntry.objects.order_by("target_type").values_list("target_type", flat=True).distinct()
    return render(
        request, "console/audit.html", {"entries": entries[:200], "target": target, "kinds": list(kinds)}
    )


# What the catalog page edits: kind in the URL -> (model, form, what to call one).
CATALOG: dict[str, tuple[type[models.Model], type[forms.ModelForm], str]] = {
    "tiers": (Tier, TierForm, "tier"),
    "departments": (Department, DepartmentForm, "department"),
    "quotas": (QuotaPolicy, QuotaForm, "quota policy"),
    "model-quotas": (ModelQuota, ModelQuotaForm, "GPU model limit"),
    "priority-classes": (PriorityClass, PriorityClassForm, "priority class"),
    "images": (SandboxImage, ImageForm, "image"),
    "storage": (Storage, StorageForm, "storage"),
    "registries": (ImageRegistry, RegistryForm, "registry"),
    "group-rules": (GroupRule, GroupRuleForm, "group rule"),
}


@staff_member_required
def catalog(request: HttpRequest) -> HttpResponse:
    """Tiers, quotas, priority classes and images at a glance, each with its edit link."""
    images = list(SandboxImage.objects.all())
    prefixes = ImageRegistry.active_prefixes()
    departments = list(Department.objects.select_related("parent"))
    figures = tree_figures(departments)
    for unit in departments:  # for the table: projects anywhere under it, the guarantee it gives
        unit.projects_below, unit.guarantee_given = figures[unit.pk]  # type: ignore[attr-defined]
    return render(
        request,
        "console/catalog.html",
        {
            "tiers": Tier.objects.select_related("priority_class"),
            "departments": departments,
            "quotas": QuotaPolicy.objects.select_related("project", "department"),
            "model_quotas": ModelQuota.objects.select_related("quota__project", "department").order_by(
                "department__name", "quota__project__name", "name"
            ),
            "classes": PriorityClass.objects.all(),
            "images": images,
            # Those the agents pull when missing: one query for the approvals, not one per image.
            "pulled": {i.pk for i in images if registries.approved_by(i.reference, prefixes)},
            "storages": Storage.objects.prefetch_related("tiers"),
            "registries": ImageRegistry.objects.all(),
            "group_rules": GroupRule.objects.select_related("project"),
            "providers": [
                name
                for name, on in (("OpenID Connect", settings.OIDC_ENABLED), ("LDAP", settings.LDAP_ENABLED))
                if on
            ],
        },
    )


@staff_member_required
def catalog_edit(request: HttpRequest, kind: str, pk: int | None = None) -> HttpResponse:
    """Create or change one catalog entry; every change lands in the audit log."""
    if kind not in CATALOG:
        raise Http404("No such catalog")
    model, form_class, noun = CATALOG[kind]
    instance = get_object_or_404(model, pk=pk) if pk is not None else None
    form = form_class(request.POST or None, instance=instance)
    if request.method == "POST" and form.is_valid():
        saved = form.save()
        messages.success(request, f"The {noun} {saved} is saved.")
        return redirect("console-catalog")
    return render(
        request,
        "console/catalog_edit.html",
        {"form": form, "noun": noun, "instance": instance},
        status=400 if form.errors else 200,
    )
