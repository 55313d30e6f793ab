"""One agent process serving many simulated hosts (workers/host/agent_pool.py): the hosts file,
a task routed to the host whose queue it came in on, a round of beats and the first
inventories sent together."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from django.conf import settings

from wire import liveness
from wire.env import ConfigError
from workers import agent as agent_module
from workers.host import inventory as inventory_module
from workers.host.agent import announce
from workers.host.agent_pool import AgentPool, read_hosts_file
from workers.host.agent_settings import AgentSettings

HOSTS = "name,gpus,cpus,memory_gib\nnode-a,V100M32:8,96,512\nnode-b,T4:2,32,128\ncpu-c,,64,256\n"


def hosts_file(tmp_path: Path, text: str = HOSTS) -> Path:
    path = tmp_path / "hosts.csv"
    path.write_text(text)
    return path


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[AgentPool]:
    hosts = read_hosts_file(hosts_file(tmp_path))
    built = agent_module.build_pool(hosts, AgentSettings(host="pool"), tmp_path / "var")
    yield built
    built.shutdown()


def test_the_hosts_file_gives_each_host_its_gpus_cpus_and_memory(tmp_path: Path) -> None:
    a, b, c = read_hosts_file(hosts_file(tmp_path))
    assert (a.name, a.gpus, a.cpus, a.memory_mib) == ("node-a", "V100M32:8", 96, 512 * 1024)
    assert (b.gpus, c.gpus) == ("T4:2", "")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("name,gpus,cpus,memory_gib\nn1,V100M32:8,many,512\n", "line 2"),
        ("name,gpus,cpus,memory_gib\nn1,X999:8,96,512\n", "unknown GPU model 'X999'"),
        ("name,gpus,cpus,memory_gib\nn1,T4,8,64\nn1,T4,8,64\n", "line 3: host name 'n1' empty or twice"),
        ("name,gpus\nn1,T4\n", "columns: name,gpus,cpus,memory_gib"),
        ("name,gpus,cpus,memory_gib\n", "names no host"),
    ],
)
def test_a_bad_hosts_file_says_where(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        read_hosts_file(hosts_file(tmp_path, text))


def test_a_missing_hosts_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        read_hosts_file(tmp_path / "absent.csv")


def test_each_host_is_its_own_agent_with_simulated_gpus_and_the_state_only_driver(pool: AgentPool) -> None:
    a, b, c = (pool.agents[name] for name in ("node-a", "node-b", "cpu-c"))
    assert (
        len(a.context.backend.list_gpus()) == 8
        and len(b.context.backend.list_gpus()) == 2
        and c.context.backend.list_gpus() == []
    )
    assert {agent.context.driver.name for agent in pool.agents.values()} == {"simulated"}
    assert a.context.settings.sim_host_cpus == 96 and c.context.settings.sim_host_memory_mib == 256 * 1024
    assert a.context.settings.full_report_s == 60  # reports only when changed, and a full one a minute


def test_a_task_goes_to_the_host_whose_queue_it_came_in_on(
    pool: AgentPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUSHARE_HOSTS_FILE", str(hosts_file(tmp_path)))
    monkeypatch.setattr(agent_module, "_pool", pool)

    def task_from(queue: str) -> Any:
        return SimpleNamespace(request=SimpleNamespace(delivery_info={"routing_key": queue}))

    assert agent_module.agent_for(task_from("host.node-b")) is pool.agents["node-b"]
    with pytest.raises(LookupError, match=r"no host for the queue 'host\.elsewhere'"):
        agent_module.agent_for(task_from("host.elsewhere"))


def test_a_round_of_beats_goes_as_one_message_with_one_time_and_the_hosts_alive(
    pool: AgentPool, sent_tasks: Any
) -> None:
    pool.beat_round()
    [(queue, _task, (beats,))] = [t for t in sent_tasks if t[1] == "agent_heartbeats"]
    assert queue == "control" and sorted(b["host"] for b in beats) == ["cpu-c", "node-a", "node-b"]
    [t_ms] = {b["t_ms"] for b in beats}
    client = redis.Redis.from_url(settings.REDIS_URL)
    assert liveness.alive_since(client, ["node-a", "node-b", "cpu-c"], t_ms) == {"node-a", "node-b", "cpu-c"}


def test_the_process_consumes_every_hosts_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wire.celery import app

    monkeypatch.setenv("GPUSHARE_HOSTS_FILE", str(hosts_file(tmp_path)))
    monkeypatch.setitem(app.conf, "task_queues", None)
    agent_module._consume_every_hosts_queue()
    assert [q.name for q in app.conf.task_queues] == ["host.node-a", "host.node-b", "host.cpu-c"]


def test_the_pools_first_inventories_go_together_a_hundred_hosts_a_message(
    pool: AgentPool, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the openb size (1,213 hosts) one message per host held the first heartbeats back
    for tens of seconds (BENCHMARKS.md, the cold start): they go in messages of
    ``INVENTORIES_PER_MESSAGE``, each host's marked as its first since the start."""
    monkeypatch.setattr(inventory_module, "INVENTORIES_PER_MESSAGE", 2)
    announce(list(pool.agents.values()))
    sent = [args for _queue, task, args in sent_tasks if task == "agent_inventories"]
    assert [len(reports) for (reports,) in sent] == [2, 1]
    reports = {report["host"]: report for (batch,) in sent for report in batch}
    assert set(reports) == {"node-a", "node-b", "cpu-c"} and all(r["started"] for r in reports.values())
    assert len(reports["node-a"]["gpus"]) == 8 and reports["cpu-c"]["gpus"] == []
    assert reports["node-b"]["facts"] == {"cpu_cores": 32, "memory_mib": 128 * 1024}
    assert not [t for t in sent_tasks if t[1] not in ("agent_inventories",)]  # nothing per host


def test_a_host_asked_for_its_inventory_sends_a_batch_of_one(pool: AgentPool, sent_tasks: Any) -> None:
    pool.agents["node-b"].report_inventory()  # the portal asks a host back from lost
    [(queue, _task, ([report],))] = [t for t in sent_tasks if t[1] == "agent_inventories"]
    assert queue == "control" and report["host"] == "node-b" and report["started"] is False


def test_a_pool_enrolled_under_a_prefix_refuses_a_host_outside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its Redis user reaches only hosts under the prefix (issue 38): one outside would be
    placed on and never answer, so the pool does not start."""
    monkeypatch.setenv("GPUSHARE_POOL_PREFIX", "node-")
    agent_module.pool_hosts.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"outside the pool's prefix 'node-'.*cpu-c"):
            agent_module.pool_hosts(hosts_file(tmp_path))
        within = tmp_path / "within"
        within.mkdir()
        assert [
            h.name for h in agent_module.pool_hosts(hosts_file(within, HOSTS.replace("cpu-c", "node-c")))
        ] == [
            "node-a",
            "node-b",
            "node-c",
        ]
    finally:
        agent_module.pool_hosts.cache_clear()
