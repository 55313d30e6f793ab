"""/healthz and configuration errors that stop start-up naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import Client
from django.utils import timezone

from portal.fleet.models import Host
from wire.config import CONTROL_HEARTBEAT_KEY
from wire.env import ConfigError, env_bool, env_choice, env_int, env_networks, env_str

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.django_db
def test_healthz_reports_each_part(fleet: Any) -> None:
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(CONTROL_HEARTBEAT_KEY)
    Host.objects.filter(name="h100").update(last_heartbeat_at=timezone.now())
    body = Client().get("/healthz")
    assert body.status_code == 503  # no control worker yet
    checks = body.json()["checks"]
    assert checks["database"]["ok"] and checks["redis"]["ok"] and not checks["control_worker"]["ok"]
    assert checks["agents"]["h100"]["ok"] and checks["agents"]["h100"]["simulated"]
    assert not checks["agents"]["a100"]["ok"]
    import time

    client.set(CONTROL_HEARTBEAT_KEY, int(time.time() * 1000))
    assert Client().get("/healthz").status_code == 200


def test_env_helpers_name_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("X_BOOL", "maybe")
    with pytest.raises(ConfigError, match="X_BOOL='maybe' is not a boolean"):
        env_bool("X_BOOL", False)
    monkeypatch.setenv("X_INT", "ten")
    with pytest.raises(ConfigError, match="X_INT='ten' is not an integer"):
        env_int("X_INT", 1)
    monkeypatch.setenv("X_CHOICE", "gpu")
    with pytest.raises(ConfigError, match="X_CHOICE='gpu' is not one of: a, b"):
        env_choice("X_CHOICE", ("a", "b"), "a")
    monkeypatch.setenv("X_NETS", "10.0.0.0/8, 127.0.0.1,fd00::/8")
    assert [str(n) for n in env_networks("X_NETS")] == ["10.0.0.0/8", "127.0.0.1/32", "fd00::/8"]
    monkeypatch.setenv("X_NETS", "10.0.0.0/8,10.0.0.1/8")  # host bits set: which one was meant?
    with pytest.raises(ConfigError, match=r"X_NETS: '10\.0\.0\.1/8' is not an address or network"):
        env_networks("X_NETS")
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    monkeypatch.setenv("X_SECRET_FILE", str(secret))
    assert env_str("X_SECRET") == "from-a-file"
    monkeypatch.setenv("X_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="X_SECRET_FILE: cannot read"):
        env_str("X_SECRET")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("GPU_BACKEND", "cuda", "GPU_BACKEND='cuda' is not one of: auto, nvml, simulated"),
        ("SANDBOX_DRIVER", "kvm", "SANDBOX_DRIVER='kvm' is not one of: auto, docker, process, libvirt"),
        ("DEBUG", "perhaps", "DEBUG='perhaps' is not a boolean"),
        ("REDIS_URL", "http://x", "REDIS_URL='http://x' must start with redis://"),
        ("DATABASE_URL", "nosuch://x", "DATABASE_URL is not a database URL"),
        ("WEBHOOK_ALLOWED_NETWORKS", "localhost", "WEBHOOK_ALLOWED_NETWORKS: 'localhost' is not an address"),
    ],
)
def test_bad_value_stops_startup_with_its_name(variable: str, value: str, message: str) -> None:
    env = {**os.environ, variable: value, "SECRET_KEY": "abcdefghij" * 5}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert f"gpushare: configuration error: {message}" in result.stderr


def test_production_needs_a_secret_key() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "SECRET_KEY_FILE")}
    env["DEBUG"] = "false"
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "SECRET_KEY is required" in result.stderr
