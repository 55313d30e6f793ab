"""History for the charts (from the one-minute rollups; a sandbox's cost from the usage
ledger) and the alerts panel, as JSON.

Each endpoint grants exactly what the matching WebSocket grants (portal/telemetry/access.py).
A window is given in minutes, 1 to the retention; anything else is a 400 naming the field.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.db.models import Func, IntegerField, Q, QuerySet
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_GET

from portal.accounts.access import visible_projects
from portal.billing.ledger import cost_by, sandbox_usage
from portal.fleet.models import SIMULATED_BACKENDS, Gpu
from portal.inputs import plain_text, whole_number
from portal.sandboxes.models import Sandbox
from portal.telemetry.access import may_watch_fleet, may_watch_gpu, may_watch_sandbox
from portal.telemetry.models import Alert, GpuRollup, SandboxRollup

DEFAULT_MINUTES = 60
FLEET_METRICS = {
    "util_pct": "util_mean_pct",
    "temp_c": "temp_mean_c",
    "power_w": "power_mean_w",
    "mem_pct": None,  # mem_mean_mib / mem_total_mib
}
RECENT_CLEARED = 20
ONE_MINUTE = timedelta(minutes=1)


class BadParameter(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _bad(exc: BadParameter) -> JsonResponse:
    return JsonResponse({exc.field: [str(exc)]}, status=400)


def _forbidden() -> JsonResponse:
    return JsonResponse({"detail": "You may not watch this."}, status=403)


def _minutes(request: HttpRequest) -> int:
    limit = settings.TELEMETRY_RETENTION_DAYS * 24 * 60
    minutes = whole_number(request.GET.get("minutes", str(DEFAULT_MINUTES)), 1, limit)
    if minutes is None:
        raise BadParameter("minutes", f"A whole number of minutes from 1 to {limit} (the retention).")
    return minutes


def _since(minutes: int, until: datetime | None = None) -> datetime:
    """The first minute of a window of ``minutes`` ending now, or at ``until`` (an ended
    sandbox's window ends where its figures do, not at today's empty minutes)."""
    end = (until or timezone.now()).replace(second=0, microsecond=0)
    return end - timedelta(minutes=minutes)


def _epoch_s(at: datetime) -> int:
    return int(at.timestamp())


def _triple(rows: list[dict[str, Any]], prefix: str, suffix: str) -> dict[str, list[float]]:
    return {k: [r[f"{prefix}_{k}_{suffix}"] for r in rows] for k in ("min", "mean", "max")}


@login_required
@require_GET
def gpu_history(request: HttpRequest, uuid: str) -> JsonResponse:
    if not may_watch_gpu(request.user, uuid):
        return _forbidden()
    try:
        minutes = _minutes(request)
    except BadParameter as exc:
        return _bad(exc)
    gpu = Gpu.objects.filter(uuid=uuid).only("pk", "memory_mib").first()
    rows: list[dict[str, Any]] = []
    if gpu is not None:
        rows = [
            dict(r)
            for r in GpuRollup.objects.filter(gpu=gpu, minute__gte=_since(minutes))
            .order_by("minute")
            .values()
        ]
    return JsonResponse(
        {
            "gpu": uuid,
            "minutes": minutes,
            "t": [_epoch_s(r["minute"]) for r in rows],
            "temp_c": _triple(rows, "temp", "c"),
            "util_pct": _triple(rows, "util", "pct"),
            "mem_used_mib": _triple(rows, "mem", "mib"),
            "power_w": _triple(rows, "power", "w"),
            "mem_total_mib": rows[-1]["mem_total_mib"] if rows else (gpu.memory_mib if gpu else 0),
        }
    )


@login_required
@require_GET
def sandbox_history(request: HttpRequest, pk: int) -> JsonResponse:
    sandbox_id = pk
    if not may_watch_sandbox(request.user, sandbox_id):
        return _forbidden()
    try:
        minutes = _minutes(request)
    except BadParameter as exc:
        return _bad(exc)
    currency, ended_at = Sandbox.objects.filter(pk=sandbox_id).values_list(
        "tier__currency", "ended_at"
    ).first() or ("", None)
    rows: list[dict[str, Any]] = [
        dict(r)
        for r in SandboxRollup.objects.filter(sandbox_id=sandbox_id, minute__gte=_since(minutes, ended_at))
        .order_by("minute")
        .values()
    ]
    usage = sandbox_usage(sandbox_id) if rows else []
    return JsonResponse(
        {
            "sandbox": sandbox_id,
            "minutes": minutes,
            "t": [_epoch_s(r["minute"]) for r in rows],
            "util_pct": _triple(rows, "util", "pct"),
            "mem_mib": _triple(rows, "mem", "mib"),
            "temp_max_c": [r["temp_max_c"] for r in rows],
            "power_mean_w": [r["power_mean_w"] for r in rows],
            # The cost so far at each minute's end, from the usage ledger (billing's figure).
            "cost_micros": [cost_by(usage, r["minute"] + ONE_MINUTE) for r in rows],
            "currency": currency or "",
        }
    )


@login_required
@require_GET
def fleet_history(request: HttpRequest) -> JsonResponse:
    """Every GPU's per-minute mean of one metric, for the fleet heatmap: one query for the
    rollups and one for the GPUs, whatever the fleet's size."""
    if not may_watch_fleet(request.user):
        return _forbidden()
    try:
        minutes = _minutes(request)
        metric = request.GET.get("metric", "util_pct")
        if metric not in FLEET_METRICS:
            raise BadParameter("metric", f"One of {', '.join(FLEET_METRICS)}.")
    except BadParameter as exc:
        return _bad(exc)
    since = _since(minutes)
    column = FLEET_METRICS[metric]
    fields = [column] if column else ["mem_mean_mib", "mem_total_mib"]
    first = _epoch_s(since)
    width = minutes + 1
    values: dict[int, list[float | None]] = {}
    # The minute comes back as seconds since the epoch, computed by the database: parsing
    # an hour of the openb cluster's rollups (372,720 timestamps) back into datetimes took
    # longer than the rest of the request.
    rows = GpuRollup.objects.filter(minute__gte=since).annotate(at=EpochSeconds("minute"))
    for gpu_id, at, *figures in rows.values_list("gpu_id", "at", *fields):
        index = (at - first) // 60
        if 0 <= index < width:
            series = values.setdefault(gpu_id, [None] * width)
            series[index] = figures[0] if column else round(100 * figures[0] / max(1, figures[1]), 1)
    gpus = Gpu.objects.order_by("host__name", "index").values_list(
        "pk", "uuid", "host__name", "index", "model", "name", "host__backend"
    )
    return JsonResponse(
        {
            "metric": metric,
            "minutes": minutes,
            "t": [first + 60 * i for i in range(width)],
            "gpus": [
                {
                    "uuid": uuid,
                    "host": host,
                    "index": index,
                    "model": model or name,
                    "simulated": backend in SIMULATED_BACKENDS,
                    "values": values.get(pk, [None] * width),
                }
                for pk, uuid, host, index, model, name, backend in gpus
            ],
        }
    )


class EpochSeconds(Func):
    """Seconds since the epoch of a datetime column, as the database computes them."""

    output_field = IntegerField()

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        template = "CAST(EXTRACT(EPOCH FROM %(expressions)s) AS INTEGER)"
        return self.as_sql(compiler, connection, template=template, **extra)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # '%%%%s': the template's own formatting halves it, the driver's placeholders once more.
        template = "CAST(strftime('%%%%s', %(expressions)s) AS INTEGER)"
        return self.as_sql(compiler, connection, template=template, **extra)


def alert_json(alert: Alert) -> dict[str, Any]:
    return {
        "key": alert.key,
        "kind": alert.kind,
        "state": "raised" if alert.cleared_at is None else "cleared",
        "message": alert.message,
        "value": alert.value,
        "threshold": alert.threshold,
        "host": alert.host.name,
        "gpu": alert.gpu.uuid if alert.gpu else "",
        "sandbox": alert.sandbox_id,
        "raised_at": alert.raised_at.isoformat(),
        "cleared_at": alert.cleared_at.isoformat() if alert.cleared_at else None,
    }


@login_required
@require_GET
def alerts(request: HttpRequest) -> JsonResponse:
    """Open alerts, then the most recent cleared ones, of a sandbox, of a GPU (its own and
    its sandboxes'), or (staff, no filter) of the whole fleet."""
    sandbox_id = request.GET.get("sandbox")
    uuid = request.GET.get("gpu")
    scope: QuerySet[Alert]
    if sandbox_id is not None:
        if whole_number(sandbox_id) is None:
            return _bad(BadParameter("sandbox", "A sandbox id."))
        if not may_watch_sandbox(request.user, sandbox_id):
            return _forbidden()
        # The sandbox's own alerts: its device's conditions under its tier's rules, exactly
        # what its live stream carries (the GPU's fleet alerts are the admins' view).
        scope = Alert.objects.filter(sandbox_id=sandbox_id)
    elif uuid is not None:
        if plain_text(uuid, 64) is None:
            return _bad(BadParameter("gpu", "A GPU or MIG device UUID."))
        if not may_watch_gpu(request.user, uuid):
            return _forbidden()
        scope = Alert.objects.filter(gpu__uuid=uuid)
        if not request.user.is_staff:  # the GPU's own alerts and their projects' sandboxes' only
            scope = scope.filter(
                Q(sandbox__isnull=True) | Q(sandbox__project__in=visible_projects(request.user))
            )
    else:
        if not may_watch_fleet(request.user):
            return _forbidden()
        scope = Alert.objects.all()
    scope = scope.select_related("host", "gpu")
    open_alerts = list(scope.filter(cleared_at__isnull=True).order_by("-raised_at")[:200])
    cleared = list(scope.filter(cleared_at__isnull=False).order_by("-cleared_at")[:RECENT_CLEARED])
    return JsonResponse({"alerts": [alert_json(a) for a in open_alerts + cleared]})
