"""/healthz: the state of every part, for load balancers and operators.

200 when the database and Redis answer and a control worker beat recently; agents are
reported one by one (a lost GPU host does not make the portal unhealthy).
"""

from __future__ import annotations

import time

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from portal.fleet.models import Host
from workers.config import CONTROL_HEARTBEAT_KEY

CONTROL_STALE_S = 15


def healthz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, object] = {}
    ok = True
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = {"ok": True, "vendor": connection.vendor}
    except Exception as exc:  # any database failure is reported, not raised
        checks["database"] = {"ok": False, "error": str(exc)[:200]}
        ok = False
    control_age: float | None = None
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
        client.ping()
        checks["redis"] = {"ok": True, "embedded": settings.EMBEDDED_REDIS_DIR is not None}
        beat = client.get(CONTROL_HEARTBEAT_KEY)
        if beat is not None:
            control_age = round(time.time() - int(beat) / 1000, 1)
    except redis.RedisError as exc:
        checks["redis"] = {"ok": False, "error": str(exc)[:200]}
        ok = False
    control_ok = control_age is not None and control_age < CONTROL_STALE_S
    checks["control_worker"] = {"ok": control_ok, "last_heartbeat_age_s": control_age}
    ok = ok and control_ok
    agents = {}
    if checks["database"].get("ok"):  # type: ignore[union-attr]
        now = timezone.now()
        for host in Host.objects.all():
            age = (now - host.last_heartbeat_at).total_seconds() if host.last_heartbeat_at else None
            agents[host.name] = {
                "ok": host.state == Host.State.UP and age is not None
                and age < settings.AGENT_HEARTBEAT_S * 3,
                "state": host.state, "backend": host.backend, "simulated": host.simulated,
                "driver": host.driver, "last_heartbeat_age_s": round(age, 1) if age is not None else None,
            }
    checks["agents"] = agents
    return JsonResponse({"ok": ok, "checks": checks}, status=200 if ok else 503)
