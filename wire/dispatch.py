"""Sending tasks by name, so a sender never imports the receiver's code.

The portal enqueues agent tasks without importing ``workers.agent``; agents report to the
control queue without importing the ORM-backed ``workers.control``.
"""

from __future__ import annotations

from typing import Any

from wire.celery import CONTROL_QUEUE, app, host_queue


def to_host(host: str, task: str, *args: Any) -> None:
    app.send_task(f"workers.agent.{task}", args=list(args), queue=host_queue(host))


def to_control(task: str, *args: Any) -> None:
    app.send_task(f"workers.control.{task}", args=list(args), queue=CONTROL_QUEUE)
