"""Process configuration shared by the portal and the workers, from the environment.

Pure Python (no Django) so that a host agent needs nothing but these variables and the
broker: REDIS_URL, GPU_BACKEND, SANDBOX_DRIVER, GPUSHARE_HOST, GPUSHARE_SIM_GPUS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from portal.env import ConfigError, env_bool, env_choice, env_int, env_str

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
    """GPUSHARE_HOSTS_FILE: the simulated hosts one agent process serves (workers.agent_pool)."""
    value = os.environ.get("GPUSHARE_HOSTS_FILE", "").strip()
    return Path(value) if value else None


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


# The channel layer's options, the portal's and the agents' alike (live telemetry, fleet
# notices; terminals and apps are relayed through Redis streams of their own). A message
# its reader has not taken in ``expiry`` seconds is stale. Every process-local channel of a
# web process (each open page's) shares one Redis key, and senders drop what goes past its
# capacity: 2000 leaves room for many pages at once.
CHANNEL_LAYER_OPTIONS: dict[str, Any] = {
    "capacity": 200,
    "expiry": 10,
    "channel_capacity": {"specific.*": 2000},
}

# Written every 2 s by the control worker, read by /healthz.
CONTROL_HEARTBEAT_KEY = "gpushare:control:heartbeat"


@dataclass(frozen=True)
class AgentSettings:
    """What a host agent takes from its environment, read once when it starts
    (``from_env``); its parts get these values and never read the environment themselves.
    The defaults are the documented ones (README, "Configuration")."""

    host: str = "h"
    gpu_backend: str = "auto"
    sandbox_driver: str = "auto"
    sim_gpus: str = ""  # GPUSHARE_SIM_GPUS: the simulated backend's GPUs
    sim_host_cpus: int = 64  # GPUSHARE_SIM_HOST: what a simulated host offers sandboxes
    sim_host_memory_mib: int = 512 * 1024
    sample_interval_s: float = 1.0
    heartbeat_s: float = 5.0
    full_report_s: float = 0.0  # an unchanged report goes again after this long; 0: every beat
    util_window_s: int = 600  # idle culling judges the mean utilization over this window
    stop_grace_s: float = 5.0
    terminal_idle_s: float = 900.0
    self_test: bool = True
    mps_dir: str = ""  # MPS_DIR: "" for the default (workers.gpu.mps.mps_root)
    mps_exclusive_process: bool = False  # EXCLUSIVE_PROCESS compute mode while a GPU runs MPS
    checkpoint_hook: str = "-"  # "-": none (workers.moves)
    checkpoint_timeout_s: int = 300
    storage_measure_s: float = 20.0  # the longest walk measuring one volume
    storage_interval_s: float = 600.0  # how often running sandboxes' volumes are measured

    @classmethod
    def from_env(cls, host: str | None = None) -> AgentSettings:
        """``host``: the name to use instead of GPUSHARE_HOST (a process serving many)."""
        cpus, memory_mib = _sim_host(env_str("GPUSHARE_SIM_HOST", "cpus=64,memory_gib=512"))
        return cls(
            host=env_str("GPUSHARE_HOST") if host is None else host,
            gpu_backend=gpu_backend_kind(),
            sandbox_driver=sandbox_driver_kind(),
            sim_gpus=os.environ.get("GPUSHARE_SIM_GPUS", ""),
            sim_host_cpus=cpus,
            sim_host_memory_mib=memory_mib,
            sample_interval_s=env_int("SAMPLE_INTERVAL_MS", 1000, minimum=50) / 1000,
            heartbeat_s=float(env_int("AGENT_HEARTBEAT_S", 5, minimum=1)),
            full_report_s=float(env_int("AGENT_FULL_REPORT_S", 0, minimum=0)),
            util_window_s=env_int("UTIL_WINDOW_S", 600, minimum=10),
            stop_grace_s=float(env_int("SANDBOX_STOP_GRACE_S", 5, minimum=0)),
            terminal_idle_s=float(env_int("TERMINAL_IDLE_S", 900, minimum=10)),
            self_test=env_bool("AGENT_SELFTEST", True),
            mps_dir=os.environ.get("MPS_DIR", ""),
            mps_exclusive_process=env_bool("MPS_EXCLUSIVE_PROCESS", False),
            checkpoint_hook=env_str("SANDBOX_CHECKPOINT_HOOK", "-"),
            storage_measure_s=float(env_int("STORAGE_MEASURE_S", 20, minimum=1)),
            storage_interval_s=float(env_int("STORAGE_INTERVAL_S", 600, minimum=10)),
            checkpoint_timeout_s=env_int("SANDBOX_CHECKPOINT_TIMEOUT_S", 300, minimum=1),
        )


def _sim_host(value: str) -> tuple[int, int]:
    """``cpus=64,memory_gib=512`` -> (cores, MiB)."""
    try:
        spec = dict(item.split("=", 1) for item in value.split(","))
        return int(spec["cpus"]), int(spec["memory_gib"]) * 1024
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"GPUSHARE_SIM_HOST={value!r} must look like cpus=64,memory_gib=512") from exc
