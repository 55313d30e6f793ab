"""Process configuration both halves read from the environment: where state lives, the
broker, the channel layer's options.

Pure Python (no Django) so that a host agent needs nothing but these variables and the
broker: REDIS_URL, GPU_BACKEND, SANDBOX_DRIVER, GPUSHARE_HOST, GPUSHARE_SIM_GPUS. What only
an agent reads is ``workers.host.agent_settings``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from wire import embedded_redis
from wire.env import ConfigError, env_bool, env_choice, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
GPU_BACKENDS = ("auto", "nvml", "simulated")
SANDBOX_DRIVERS = ("auto", "docker", "process", "libvirt", "simulated")


def var_dir() -> Path:
    """Where run-time state lives (SQLite, embedded Redis, process-driver state)."""
    # Absolute: the embedded Redis daemon changes directory, and subprocesses inherit it.
    return Path(os.environ.get("GPUSHARE_VAR_DIR") or BASE_DIR / "var").resolve()


def storage_root() -> Path:
    """STORAGE_ROOT: the directory under which sandboxes' persistent storage lives on a GPU
    host (homes, project folders, datasets); in production a shared file system mounted at
    the same path on every host. Default, one host's own: ``/var/lib/gpushare/storage`` for a
    root agent, whose process sandboxes run as other uids that must pass through every folder
    above it (a checkout under /root or a 0700 home would hide <var>), else <var>/storage."""
    value = os.environ.get("STORAGE_ROOT", "").strip()
    if value:
        return Path(value).resolve()
    return Path("/var/lib/gpushare/storage") if os.geteuid() == 0 else var_dir() / "storage"


def apps_root() -> Path:
    """Where the drivers keep each sandbox's app socket folder (workers/drivers/app_socket.py):
    for a root agent under /run, as its MPS pipes (workers.gpu.mps.mps_root) and for the same
    reason as ``storage_root``; else <var>/apps."""
    return Path("/run/gpushare/apps") if os.geteuid() == 0 else var_dir() / "apps"


def embedded_redis_dir() -> Path | None:
    """The embedded Redis folder when REDIS_URL is unset, else None."""
    return None if os.environ.get("REDIS_URL") or os.environ.get("REDIS_URL_FILE") else (var_dir() / "redis")


def redis_url() -> str:
    embedded = embedded_redis_dir()
    if embedded is not None:
        return f"unix://{embedded / 'redis.sock'}"
    url = env_str("REDIS_URL")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"REDIS_URL={url!r} must start with redis://, rediss:// or unix://")
    return url


def celery_broker_url(url: str) -> str:
    """kombu spells unix sockets ``redis+socket://``."""
    return "redis+socket://" + url.removeprefix("unix://") if url.startswith("unix://") else url


def hosts_file() -> Path | None:
    """GPUSHARE_HOSTS_FILE: the simulated hosts one agent process serves (workers.host.agent_pool)."""
    value = os.environ.get("GPUSHARE_HOSTS_FILE", "").strip()
    return Path(value) if value else None


def slurm_gateway() -> bool:
    """GPUSHARE_SLURM_URL set: this agent process is a Slurm cluster's gateway (workers.slurm)."""
    return bool(os.environ.get("GPUSHARE_SLURM_URL", "").strip())


def serves_many_hosts() -> bool:
    """Whether this agent process speaks for many hosts (an agent pool, a Slurm gateway): it is
    enrolled, signs and keeps its in-flight messages under its prefix (GPUSHARE_POOL_PREFIX)."""
    return hosts_file() is not None or slurm_gateway()


def pool_prefix() -> str:
    """GPUSHARE_POOL_PREFIX: the name prefix an agent pool was enrolled under (every host of its
    file must start with it; ``manage.py host_credential issue --pool``); empty: not enrolled."""
    return os.environ.get("GPUSHARE_POOL_PREFIX", "").strip()


# Development only: the settings refuse it (or any weak key) when DEBUG is off.
DEV_SECRET = "insecure-dev-only-key-set-SECRET_KEY-in-production"  # noqa: S105 - refused in production


def secret_key() -> str:
    """SECRET_KEY (or SECRET_KEY_FILE), the control plane's: Django's, and the seed of the key
    its messages are signed with (``wire.signing.control_private_key``), so beat, which loads
    no settings, signs as the web and control processes do."""
    return env_str("SECRET_KEY", DEV_SECRET if env_bool("DEBUG", False) else None)


def host_key() -> str | None:
    """GPUSHARE_HOST_KEY (or _FILE): the private key a host's agent (or an agent pool) signs
    its messages with, written by ``manage.py host_credential issue --out``; None if unset."""
    return env_str("GPUSHARE_HOST_KEY", "") or None


def control_public_key() -> str | None:
    """GPUSHARE_CONTROL_PUBLIC_KEY (or _FILE): what an agent checks the control plane's
    messages against, written with its own key at enrolment; None if unset."""
    return env_str("GPUSHARE_CONTROL_PUBLIC_KEY", "") or None


def gpu_backend_kind() -> str:
    return env_choice("GPU_BACKEND", GPU_BACKENDS, "auto")


def sandbox_driver_kind() -> str:
    return env_choice("SANDBOX_DRIVER", SANDBOX_DRIVERS, "auto")


def ensure_embedded_redis() -> None:
    """Process entry points call this: starts the shared embedded Redis if we use it."""
    embedded = embedded_redis_dir()
    if embedded is not None:
        embedded_redis.ensure_running(embedded)


# The channel layer, the portal's and the agents' alike (live telemetry, sandbox state
# pushes; terminals and apps are relayed through Redis streams of their own). Redis pub/sub,
# not channels-redis's list-per-channel layer: a ``group_send`` is one PUBLISH that each web
# process receives once and hands to its own sockets in memory, where the list layer wrote
# one copy per socket into Redis and each socket's copy cost the web process a Redis round
# trip and a decode (the fan-out of 2,000 open sandbox pages, issue 37). Nothing here needs
# what pub/sub lacks: every message is a live sample or notice with a newer one coming, and
# the consumers keep only the newest (a message for a page that is not open is not wanted).
CHANNEL_LAYER_BACKEND = "channels_redis.pubsub.RedisPubSubChannelLayer"
CHANNEL_LAYER_OPTIONS: dict[str, Any] = {}

# Written every 2 s by the control worker, read by /healthz.
CONTROL_HEARTBEAT_KEY = "gpushare:control:heartbeat"
