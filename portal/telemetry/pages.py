"""Admin pages for live telemetry: one GPU's charts, facts and alerts, and the fleet heatmap.

The pages only lay out what the browser fills in: the figures come from the history
endpoints (portal/telemetry/views.py) and the WebSocket streams, which check permission
themselves, so a page never grants more than its streams do.
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from portal.fleet.models import Gpu
from portal.fleet.modes import describe, serving
from portal.sandboxes.models import Allocation
from portal.telemetry.views import FLEET_METRICS

METRIC_LABELS = {
    "util_pct": "Utilization (%)",
    "temp_c": "Temperature (°C)",
    "mem_pct": "Memory used (%)",
    "power_w": "Power (W)",
}


@staff_member_required
def gpu_page(request: HttpRequest, uuid: str) -> HttpResponse:
    gpu = get_object_or_404(Gpu.objects.select_related("host"), uuid=uuid)
    live = list(
        Allocation.objects.filter(gpu=gpu, active=True)
        .select_related("sandbox__owner", "sandbox__project", "mig_instance")
        .order_by("created_at")
    )
    held = {a.mig_instance_id: a.sandbox for a in live if a.mig_instance_id}
    layout = [(m, held.get(m.pk)) for m in gpu.mig_instances.all()]
    return render(
        request,
        "telemetry/gpu.html",
        {
            "gpu": gpu,
            "host": gpu.host,
            "allocations": live,
            "layout": layout,
            "mode": describe(gpu.sharing_mode, (a.kind for a in live)),
            # What the mode it serves now gives its sandboxes (none while idle, following demand).
            "serving": serving(gpu.sharing_mode, (a.kind for a in live)),
        },
    )


@staff_member_required
def heatmap(request: HttpRequest) -> HttpResponse:
    # The rows the heatmap starts with; the history endpoint lists the same GPUs in the same
    # order (host, index), so its minutes line up with these rows.
    gpus: list[dict[str, Any]] = [
        {"uuid": g.uuid, "host": g.host.name, "index": g.index, "model": g.model or g.name}
        for g in Gpu.objects.select_related("host").order_by("host__name", "index")
    ]
    hosts = len({g["host"] for g in gpus})
    # What the endpoint serves, so the menu never offers a metric it would refuse.
    metrics = [(key, METRIC_LABELS.get(key, key)) for key in FLEET_METRICS]
    return render(
        request,
        "telemetry/heatmap.html",
        {"gpus": gpus, "hosts": hosts, "metrics": metrics},
    )
