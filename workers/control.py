"""Tasks on the ``control`` queue: the only worker that changes fleet state (uses the ORM).

The Celery entry point into ``portal.control``: every task ``wire/messages.py`` declares is
registered here as ``workers.control.<name>`` (the name agents, beat and the portal send;
older agents and portals send the same) over its handler in ``portal/control/tasks.py``,
with that task's Celery options. Nothing else is written here but the control worker's own
heartbeat thread, started with the worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import django
from celery import Task, signals

django.setup()

from portal.control import provenance, tasks  # noqa: E402
from portal.fleet import credentials  # noqa: E402
from wire import signing  # noqa: E402
from wire.celery import app  # noqa: E402
from wire.messages import ControlTasks, control_task_names  # noqa: E402

log = logging.getLogger(__name__)

# mypy checks here that every handler takes what the declaration says its senders send.
HANDLERS: ControlTasks = tasks


def _register(name: str, handler: Callable[..., object]) -> Task[Any, None]:
    told_attempt = name in tasks.TOLD_ATTEMPT

    def run(task: Task[Any, None], *args: Any) -> None:
        extra = {"attempt": task.request.retries + 1} if told_attempt else {}
        answer = handler(*args, **extra)
        if isinstance(answer, tasks.Retry):
            raise task.retry(args=answer.args, countdown=answer.countdown_s)

    run.__name__ = run.__qualname__ = name
    run.__doc__ = handler.__doc__
    options = tasks.CELERY_OPTIONS.get(name, {})
    registered: Task[Any, None] = app.task(
        bind=True, name=f"workers.control.{name}", ignore_result=True, **options
    )(run)
    return registered


def _believed(task: Task[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Every message this worker takes, Celery's canvas tasks' too, is judged by who signed it
    and what it claims before it runs (a dropped one is logged and alerted)."""
    return provenance.admit(task.name.removeprefix("workers.control."), task, args)


signing.install_verifier(_believed)

# By the task's name without the prefix; tests run a message through the worker's own task.
TASKS = {name: _register(name, getattr(HANDLERS, name)) for name in control_task_names()}


# --- the control worker's own liveness -----------------------------------------------------

_stop = threading.Event()


@signals.worker_ready.connect
def _start_heartbeat(**_: Any) -> None:
    threading.Thread(target=tasks.beat_forever, args=(_stop,), name="control-heartbeat", daemon=True).start()


@signals.worker_ready.connect
def _reapply_host_credentials(**_: Any) -> None:
    """A Redis that restarted without its ACL file lost the hosts' users: give them back."""
    try:
        applied = credentials.reconcile()
    except Exception:  # the worker still runs; agents with their own users wait for the next start
        log.exception("re-applying the hosts' Redis users failed")
        return
    if applied:
        log.info("re-applied %d hosts' Redis users", applied)


@signals.worker_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    _stop.set()
