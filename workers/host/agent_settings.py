"""What a host agent takes from its environment (README, "Configuration")."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from wire.config import gpu_backend_kind, sandbox_driver_kind
from wire.env import ConfigError, env_bool, env_int, env_str

log = logging.getLogger(__name__)


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
    checkpoint_hook: str = "-"  # "-": none (workers.host.moves)
    checkpoint_timeout_s: int = 300
    storage_measure_s: float = 20.0  # the longest walk measuring one volume
    storage_interval_s: float = 600.0  # how often running sandboxes' volumes are measured
    memory_check_s: float = 600.0  # how often each GPU's row remapping / page retirement is read

    @classmethod
    def from_env(cls, host: str | None = None) -> AgentSettings:
        """``host``: the name to use instead of GPUSHARE_HOST (a process serving many)."""
        cpus, memory_mib = _sim_host(env_str("GPUSHARE_SIM_HOST", "cpus=64,memory_gib=512"))
        _note_retired_settings()
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
            checkpoint_hook=env_str("SANDBOX_CHECKPOINT_HOOK", "-"),
            storage_measure_s=float(env_int("STORAGE_MEASURE_S", 20, minimum=1)),
            storage_interval_s=float(env_int("STORAGE_INTERVAL_S", 600, minimum=10)),
            memory_check_s=float(env_int("GPU_MEMORY_CHECK_S", 600, minimum=10)),
            checkpoint_timeout_s=env_int("SANDBOX_CHECKPOINT_TIMEOUT_S", 300, minimum=1),
        )


# Settings an agent no longer reads, and what to tell an operator whose environment file
# still sets one.
RETIRED = {
    "MPS_EXCLUSIVE_PROCESS": (
        "every GPU or MIG device that serves MPS is now set to EXCLUSIVE_PROCESS while its daemon "
        "runs (DEFAULT again after), and a share whose device cannot be set is refused with the "
        "reason, since without it a tenant leaves MPS and its limits by unsetting "
        "CUDA_MPS_PIPE_DIRECTORY; remove the line from the environment file"
    ),
}


def _note_retired_settings() -> None:
    for name, why in RETIRED.items():
        value = os.environ.get(name)
        if value is not None:
            log.warning("%s=%s is no longer read: %s", name, value, why)


def _sim_host(value: str) -> tuple[int, int]:
    """``cpus=64,memory_gib=512`` -> (cores, MiB)."""
    try:
        spec = dict(item.split("=", 1) for item in value.split(","))
        return int(spec["cpus"]), int(spec["memory_gib"]) * 1024
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"GPUSHARE_SIM_HOST={value!r} must look like cpus=64,memory_gib=512") from exc
