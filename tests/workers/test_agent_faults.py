"""The agent's GPU faults: which faults drain a GPU, which are the tenant's own bug, one
alert per fault, one temperature rule, and a lost GPU that does not stop the host's
telemetry. Issue 18, findings 2 and 7 and the agent's part of the review (§1.5)."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from redis.asyncio import Redis as AsyncRedis

import workers.agent
import workers.host
import workers.host.agent
from wire.spec import SandboxSpec
from workers.drivers.process import ProcessDriver
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host import sampler as sampler_module
from workers.host.agent import Agent


class FakeLayer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        self.sent.append((group, message))


def host(tmp_path: Path, spec: str = "H100-80GB:2:mig=1") -> tuple[Agent, SimulatedBackend]:
    backend = SimulatedBackend("h", parse_sim_spec(spec))
    agent = Agent("h", backend, ProcessDriver(tmp_path / "sandboxes", host="h"), tmp_path)
    agent.context.inventory.refresh()
    return agent, backend


def run_on(agent: Agent, key: str, sandbox_id: int, device: str) -> None:
    agent.context.sandboxes.running[key] = SandboxSpec(
        key, sandbox_id, "h", "vision", "olivia", "img", (), (device,), False, tier="t"
    )


def drains(sent_tasks: Any) -> list[tuple[str, str]]:
    return [(e["uuid"], e["kind"]) for t in sent_tasks if t[1] == "gpu_faults" for e in t[2][1]]


def test_a_device_xid_drains_the_gpu_with_one_alert_for_the_gpu(tmp_path: Path, sent_tasks: Any) -> None:
    agent, backend = host(tmp_path)
    plain = agent.context.inventory.gpus[0].uuid
    run_on(agent, "a1", 7, plain)
    backend.inject_xid(plain, 79)
    changes = agent.faults.report(agent.context.sandboxes.specs(), [], agent.context.inventory.parent_of())
    assert drains(sent_tasks) == [(plain, "xid")]
    # One alert: the GPU's. Its sandbox's owner hears of the drain (portal.control.faults).
    assert [(c["kind"], c["sandbox"], c["gpu"]) for c in changes] == [("xid", None, plain)]
    assert "fallen off the bus" in changes[0]["message"] and agent.faults.last_xid[plain] == 79


def test_an_application_xid_drains_nothing_and_alerts_only_the_sandbox_that_faulted(
    tmp_path: Path, sent_tasks: Any
) -> None:
    agent, backend = host(tmp_path)
    mig_gpu = agent.context.inventory.gpus[1]
    mine, neighbour = mig_gpu.mig_devices[0].uuid, mig_gpu.mig_devices[1].uuid
    run_on(agent, "a1", 7, mine)
    run_on(agent, "a2", 8, neighbour)
    backend.inject_xid(mine, 31)  # an illegal address in a7's kernel
    changes = agent.faults.report(agent.context.sandboxes.specs(), [], agent.context.inventory.parent_of())
    assert drains(sent_tasks) == []
    assert [(c["kind"], c["sandbox"], c["gpu"]) for c in changes] == [("xid", 7, mig_gpu.uuid)]
    assert "the GPU is fine" in changes[0]["message"]


def test_an_application_xid_on_a_shared_gpu_alerts_every_sandbox_on_it(
    tmp_path: Path, sent_tasks: Any
) -> None:
    agent, backend = host(tmp_path, "H100-80GB:1")
    gpu = agent.context.inventory.gpus[0].uuid
    run_on(agent, "a1", 7, gpu)
    run_on(agent, "a2", 8, gpu)
    backend.inject_xid(gpu, 13)
    changes = agent.faults.report(agent.context.sandboxes.specs(), [], agent.context.inventory.parent_of())
    assert drains(sent_tasks) == [] and sorted(c["sandbox"] or 0 for c in changes) == [7, 8]


def test_the_alert_policys_temperature_rule_is_the_one_that_drains(
    tmp_path: Path, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, backend = host(tmp_path, "H100-80GB:2")
    hot, cool = (g.uuid for g in agent.context.inventory.gpus)
    agent.set_alert_policy({"version": "v", "fleet": {"temp_high_c": 70, "temp_clear_c": 60, "hold_s": 2}})
    backend.inject_overheat(hot, 78.0)  # under the old fixed 90 °C limit: over the policy's 70 °C
    clock = {"now": 1_000_000}
    monkeypatch.setattr(sampler_module, "now_ms", lambda: clock["now"])
    layer = FakeLayer()

    async def ticks(n: int) -> None:
        client = AsyncRedis.from_url(settings.REDIS_URL)
        for tick in range(n):
            await agent.sampler.publish_all(layer, tick, client)
            clock["now"] += 1000
        await client.aclose()

    asyncio.run(ticks(2))
    assert drains(sent_tasks) == []  # held under 2 s: nothing yet
    asyncio.run(ticks(3))
    assert drains(sent_tasks) == [(hot, "overheat")]  # once, with the rule's alert
    alerts = [m for g, m in layer.sent if g == "host.h.fleet" and m["type"] == "alert.changed"]
    assert [(m["kind"], m["gpu"]) for m in alerts] == [("temperature", hot)]
    asyncio.run(ticks(3))
    assert drains(sent_tasks) == [(hot, "overheat")] and cool not in {u for u, _ in drains(sent_tasks)}


def test_a_lost_gpu_is_reported_once_and_the_rest_of_the_host_keeps_streaming(
    tmp_path: Path, sent_tasks: Any
) -> None:
    agent, backend = host(tmp_path, "H100-80GB:2")
    lost, kept = (g.uuid for g in agent.context.inventory.gpus)
    run_on(agent, "a1", 7, lost)
    run_on(agent, "a2", 8, kept)
    layer = FakeLayer()

    async def tick(n: int) -> None:
        client = AsyncRedis.from_url(settings.REDIS_URL)
        await agent.sampler.publish_all(layer, n, client)
        await client.aclose()

    asyncio.run(tick(1))
    backend.mark_lost(lost)
    layer.sent.clear()
    asyncio.run(tick(2))  # before the fix: the tick raised at the lost GPU, nothing after it ran
    asyncio.run(tick(3))
    assert drains(sent_tasks) == [(lost, "gpu_lost")]
    assert [g.uuid for g in agent.context.inventory.gpus] == [kept]
    samples = {m["gpu"] for g, m in layer.sent if m["type"] == "gpu.sample"}
    assert samples == {kept}  # the kept GPU and its sandbox's group, every tick
    assert sum(1 for g, _ in layer.sent if g == "host.h.sandbox.8") == 2
    alerts = [
        (m["kind"], m["state"]) for g, m in layer.sent if g == "host.h.fleet" and m["type"] == "alert.changed"
    ]
    assert alerts == [("gpu_lost", "raised")]  # and it stays open: nothing the agent sees clears it


# Modules under workers/host that may: none is a part reading its own settings.
READ_THE_ENVIRONMENT = {
    "workers.host.agent_settings": "AgentSettings.from_env, the one place settings are read",
    "workers.host.checkpoint": "hands the agent's environment on to the operator's hook",
    "workers.host.selftest": "its shell entry (python -m workers.host.selftest), not the agent",
}


def test_the_agents_parts_read_no_environment() -> None:
    """Settings are read once (AgentSettings.from_env, in get_agent) and passed down."""
    for module in [workers.agent, *(_parts())]:
        if module.__name__ in READ_THE_ENVIRONMENT:
            continue
        source = inspect.getsource(module)
        for needle in ("os.environ", "env_int(", "env_str(", "env_bool(", "getenv("):
            assert needle not in source, f"{module.__name__} reads the environment ({needle})"


def test_no_class_in_the_agent_module_is_over_200_lines() -> None:
    tree = ast.parse(inspect.getsource(workers.host.agent))
    sizes = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.ClassDef)}  # type: ignore[operator]
    assert sizes and max(sizes.values()) <= 200, sizes


def _parts() -> list[Any]:
    import importlib

    names = [p.stem for p in Path(workers.host.__file__).parent.glob("*.py") if p.stem != "__init__"]
    return [importlib.import_module(f"workers.host.{name}") for name in sorted(names)]


def test_a_real_gpu_host_makes_the_device_nodes_of_every_gpu_and_mig_instance(tmp_path: Path) -> None:
    """Review §5: /dev/nvidia-uvm and a new MIG instance's caps nodes exist only once
    something asks; inside bwrap nothing can, so the agent asks at start and after MIG
    changes (the process driver then fails a launch loudly if one is still missing)."""
    agent, _ = host(tmp_path)
    assert agent.device_nodes is None  # simulated GPUs have no nodes to make

    class Recorder:
        asked: list[str] = []

        def create_missing(self, uuids: list[str]) -> list[list[str]]:
            self.asked += uuids
            return []

    agent.device_nodes = Recorder()  # type: ignore[assignment]
    agent.make_device_nodes()
    gpus = agent.context.inventory.gpus
    assert Recorder.asked == [g.uuid for g in gpus] + [m.uuid for g in gpus for m in g.mig_devices]


def test_a_gpu_reported_lost_by_an_event_is_no_longer_sampled(tmp_path: Path, sent_tasks: Any) -> None:
    agent, backend = host(tmp_path, "H100-80GB:2")
    lost, kept = (g.uuid for g in agent.context.inventory.gpus)
    backend.mark_lost(lost)  # its event is queued before any sample of it fails
    agent.faults.report({}, [], agent.context.inventory.parent_of())
    assert drains(sent_tasks) == [(lost, "gpu_lost")] and [g.uuid for g in agent.context.inventory.gpus] == [
        kept
    ]
