"""Every task the portal sends a host is one its agent registered, with the same arguments.

The portal sends through ``wire.messages.to_host(host)``, which mypy checks against
``AgentTasks``; the agent's handlers (``workers/agent.py``) are Celery tasks bound to their
request, which mypy cannot hold to a Protocol. So a real agent's module is imported here (its
role chosen by the environment, as ``celery worker`` does) and each registered task's
parameters, names and annotations, compared with the declaration's.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Any

from wire.messages import AgentTasks, agent_task_names, to_host

PROBE = """
import inspect, json
from wire.celery import app
import workers.agent
print(json.dumps({
    name.removeprefix("workers.agent."): [
        [p.name, str(p.annotation)] for p in inspect.signature(task.run).parameters.values()
    ]
    for name, task in app.tasks.items() if name.startswith("workers.agent.")
}))
"""


def registered_in_an_agent() -> dict[str, list[list[str]]]:
    env = {**os.environ, "GPUSHARE_ROLE": "agent", "GPUSHARE_HOST": "h-declared"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    tasks: dict[str, list[list[str]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return tasks


def declared(name: str) -> list[list[str]]:
    parameters = list(inspect.signature(getattr(AgentTasks, name)).parameters.values())[1:]  # self
    return [[p.name, str(p.annotation)] for p in parameters]


def test_the_agent_registers_every_declared_task_with_its_declared_arguments() -> None:
    registered = registered_in_an_agent()
    assert sorted(registered) == sorted(agent_task_names())
    for name in agent_task_names():
        assert registered[name] == declared(name), name


def test_each_typed_send_goes_to_the_hosts_queue_by_the_tasks_name(
    sent_tasks: list[tuple[str, str, tuple[Any, ...]]],
) -> None:
    to_host("h1").stop_sandbox("alloc-1", 7, None)
    to_host("h2").report_inventory()
    assert sent_tasks == [
        ("host.h1", "stop_sandbox", ("alloc-1", 7, None)),
        ("host.h2", "report_inventory", ()),
    ]
