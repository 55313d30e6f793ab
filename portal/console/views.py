"""Admin console pages beside Django admin."""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Count, Prefetch, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from portal.fleet.models import Gpu, Host
from portal.sandboxes.models import Allocation


@staff_member_required
def fleet(request: HttpRequest) -> HttpResponse:
    gpus = Gpu.objects.prefetch_related("mig_instances").annotate(
        live_allocations=Count("allocations", filter=Q(allocations__active=True))
    )
    hosts = Host.objects.prefetch_related(Prefetch("gpus", queryset=gpus))
    live = Allocation.objects.filter(active=True).select_related("sandbox", "gpu")
    return render(request, "console/fleet.html", {"hosts": hosts, "live": live})
