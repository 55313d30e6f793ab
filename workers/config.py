"""Process configuration shared by the portal and the workers, from the environment.

Pure Python (no Django) so that a host agent needs nothing but these variables and the
broker: REDIS_URL, GPU_BACKEND, SANDBOX_DRIVER, GPUSHARE_HOST, GPUSHARE_SIM_GPUS.
"""

from __future__ import annotations

import os
from pathlib import Path

from portal.env import env_choice, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
GPU_BACKENDS = ("auto", "nvml", "simulated")
SANDBOX_DRIVERS = ("auto", "docker", "process", "libvirt")


def var_dir() -> Path:
    """Where run-time state lives (SQLite, embedded Redis, process-driver state)."""
    # Absolute: the embedded Redis daemon changes directory, and subprocesses inherit it.
    return Path(os.environ.get("GPUSHARE_VAR_DIR") or BASE_DIR / "var").resolve()


def embedded_redis_dir() -> Path | None:
    """The embedded Redis folder when REDIS_URL is unset, else None."""
    return None if os.environ.get("REDIS_URL") or os.environ.get("REDIS_URL_FILE") else (var_dir() / "redis")


def redis_url() -> str:
    embedded = embedded_redis_dir()
    if embedded is not None:
        return f"unix://{embedded / 'redis.sock'}"
    url = env_str("REDIS_URL")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        from portal.env import ConfigError

        raise ConfigError(f"REDIS_URL={url!r} must start with redis://, rediss:// or unix://")
    return url


def celery_broker_url(url: str) -> str:
    """kombu spells unix sockets ``redis+socket://``."""
    return "redis+socket://" + url.removeprefix("unix://") if url.startswith("unix://") else url


def gpu_backend_kind() -> str:
    return env_choice("GPU_BACKEND", GPU_BACKENDS, "auto")


def sandbox_driver_kind() -> str:
    return env_choice("SANDBOX_DRIVER", SANDBOX_DRIVERS, "auto")


def ensure_embedded_redis() -> None:
    """Process entry points call this: starts the shared embedded Redis if we use it."""
    embedded = embedded_redis_dir()
    if embedded is not None:
        from portal.embedded_redis import ensure_running

        ensure_running(embedded)


# Written every 2 s by the control worker, read by /healthz.
CONTROL_HEARTBEAT_KEY = "gpushare:control:heartbeat"
