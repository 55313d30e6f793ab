"""/healthz: the state of every part, for load balancers and operators.

200 when the database and Redis answer and a control worker beat recently; agents are
reported one by one (a lost GPU host does not make the portal unhealthy).
"""

from __future__ import annotations

import time
from typing import Any

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from portal.fleet.models import Host
from wire.config import CONTROL_HEARTBEAT_KEY

CONTROL_STALE_S = 15


def _database() -> dict[str, Any]:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any database failure is reported, not raised
        return {"ok": False, "error": str(exc)[:200]}
    return {"ok": True, "vendor": connection.vendor}


def _redis_and_control() -> tuple[dict[str, Any], dict[str, Any]]:
    age: float | None = None
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
        client.ping()
        beat = client.get(CONTROL_HEARTBEAT_KEY)
    except redis.RedisError as exc:
        return {"ok": False, "error": str(exc)[:200]}, {"ok": False, "last_heartbeat_age_s": None}
    if isinstance(beat, bytes):
        age = round(time.time() - int(beat) / 1000, 1)
    control = {"ok": age is not None and age < CONTROL_STALE_S, "last_heartbeat_age_s": age}
    return {"ok": True, "embedded": settings.EMBEDDED_REDIS_DIR is not None}, control


def _agents() -> dict[str, dict[str, Any]]:
    now = timezone.now()
    agents = {}
    for host in Host.objects.all():
        age = (now - host.last_heartbeat_at).total_seconds() if host.last_heartbeat_at else None
        fresh = age is not None and age < settings.AGENT_HEARTBEAT_S * 3
        agents[host.name] = {
            "ok": host.state == Host.State.UP and fresh,
            "state": host.state,
            "backend": host.backend,
            "simulated": host.simulated,
            "driver": host.driver,
            "last_heartbeat_age_s": round(age, 1) if age is not None else None,
        }
    return agents


def healthz(request: HttpRequest) -> JsonResponse:
    database = _database()
    redis_check, control = _redis_and_control()
    checks = {
        "database": database,
        "redis": redis_check,
        "control_worker": control,
        "agents": _agents() if database["ok"] else {},
    }
    ok = database["ok"] and redis_check["ok"] and control["ok"]
    return JsonResponse({"ok": ok, "checks": checks}, status=200 if ok else 503)
