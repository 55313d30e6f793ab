"""Every control task a sender names is one the control worker registered, under that name.

Senders call ``wire.messages.to_control`` (mypy checks them against ``ControlTasks``) and beat
names its tasks in ``wire/celery.py``; the control worker registers ``ControlTasks`` over the
handlers of ``portal/control/tasks.py``. Here a real control worker's module is imported (its
role chosen by the environment, as ``celery worker`` does) and its Celery app asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from wire.celery import app
from wire.messages import control_task_names, to_control

PROBE = """
import json
from wire.celery import app
import workers.control
print(json.dumps({
    name: {"max_retries": task.max_retries, "soft": task.soft_time_limit, "hard": task.time_limit}
    for name, task in app.tasks.items() if name.startswith("workers.")
}))
"""


def registered_in_a_control_worker() -> dict[str, dict[str, int | None]]:
    env = {**os.environ, "GPUSHARE_ROLE": "control"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    tasks: dict[str, dict[str, int | None]] = json.loads(done.stdout.strip().splitlines()[-1])
    return tasks


def test_the_control_worker_registers_every_declared_task_and_only_those() -> None:
    registered = registered_in_a_control_worker()
    declared = {f"workers.control.{name}" for name in control_task_names()}
    assert set(registered) == declared
    # What beat sends is among them, by the same names as before (agents and portals of the
    # previous version send these too).
    assert {entry["task"] for entry in app.conf.beat_schedule.values()} <= declared
    assert {
        "workers.control.agent_heartbeats",
        "workers.control.sandbox_launched",
        "workers.control.telemetry_host_rollups",
        "workers.control.invoice_tick",
        "workers.control.deliver_webhook",
        "workers.control.email_notifications",
    } <= declared
    # The mail and webhook tasks keep their own retry count and time limits.
    assert registered["workers.control.deliver_webhook"] == {"max_retries": None, "soft": 30, "hard": 40}
    mail = registered["workers.control.email_notifications"]
    assert mail == {"max_retries": None, "soft": 100, "hard": 120}
    assert registered["workers.control.invoice_tick"]["hard"] == 300


def test_each_typed_send_goes_by_the_tasks_name(sent_tasks: list[tuple[str, str, tuple[Any, ...]]]) -> None:
    to_control.sandbox_stopped("key-1", 1_700_000_000_000)
    to_control.schedule_cycle()
    assert sent_tasks == [
        ("control", "sandbox_stopped", ("key-1", 1_700_000_000_000)),
        ("control", "schedule_cycle", ()),
    ]
