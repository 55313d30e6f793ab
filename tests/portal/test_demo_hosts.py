"""``make run``'s demo hosts are sized like the four-GPU servers they simulate (portal/demo.py),
so the demo holds what such servers would: a burst of 100 small CPU batches at once."""

from __future__ import annotations

from typing import Any

import pytest

from portal.console.management.commands.seed_demo import HOST_SHARE
from portal.demo import DEMO_HOST_SIZE, DEMO_HOSTS
from portal.launcher import commands
from workers.host.agent_settings import AgentSettings


def test_each_demo_agent_offers_the_size_of_a_real_four_gpu_server(monkeypatch: pytest.MonkeyPatch) -> None:
    agents = {name: env for name, _, env in commands(8000, "127.0.0.1", "docker", list(DEMO_HOSTS))}
    for host in DEMO_HOSTS:
        env: dict[str, Any] = agents[f"agent:{host}"]
        assert env["GPUSHARE_SIM_HOST"] == DEMO_HOST_SIZE
        monkeypatch.setenv("GPUSHARE_SIM_HOST", env["GPUSHARE_SIM_HOST"])
        settings = AgentSettings.from_env(host=host)
        # Two sockets of 48 to 64 cores with SMT: 192 to 256 hardware threads, 1 TiB or more.
        assert 96 <= settings.sim_host_cpus <= 256 and settings.sim_host_memory_mib >= 1024 * 1024


def test_the_demo_holds_a_hundred_cpu_sandboxes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_SIM_HOST", DEMO_HOST_SIZE)
    host = AgentSettings.from_env(host="any")
    cores, memory_mib = HOST_SHARE["cpu"]
    each = min(host.sim_host_cpus // cores, host.sim_host_memory_mib // memory_mib)
    assert each * len(DEMO_HOSTS) >= 100
