"""The Celery app: one ``control`` queue, one ``host.<name>`` queue per GPU host.

The role (GPUSHARE_ROLE) decides which task modules a process loads: ``control`` loads
the ORM-backed ``workers.control``; ``agent`` loads only ``workers.agent``, which never
touches the database, so a GPU host needs only the broker URL.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from celery import Celery, signals

from wire import config, signing
from wire.env import ConfigError, env_choice, env_int

CONTROL_QUEUE = "control"
ROLES = ("control", "agent", "beat", "client")


def host_queue(host: str) -> str:
    return f"host.{host}"


def unacked_keys(host: str) -> dict[str, str]:
    """kombu's transport options that give a host's agent in-flight bookkeeping of its own.
    Its default ``unacked`` hash is one for every consumer and holds every message taken and
    not yet acknowledged, other hosts' launch specs included: an agent's Redis user may not
    read it (``wire.broker_acl``)."""
    queue = host_queue(host)
    return {
        "unacked_key": f"unacked.{queue}",
        "unacked_index_key": f"unacked_index.{queue}",
        "unacked_mutex_key": f"unacked_mutex.{queue}",
    }


ROLE = env_choice("GPUSHARE_ROLE", ROLES, "client")
_TASK_MODULES = {"control": ["workers.control"], "agent": ["workers.agent"]}

# Every task, Celery's own canvas tasks included, runs a message only once this worker's
# verifier believes who signed it (wire/signing.py).
app = Celery("gpushare", include=_TASK_MODULES.get(ROLE, []), task_cls=signing.SignedTask)
app.conf.update(
    broker_url=config.celery_broker_url(config.redis_url()),
    broker_connection_retry_on_startup=True,
    # Tasks re-run after a worker dies mid-task (acks_late); every task is idempotent.
    broker_transport_options={"visibility_timeout": 300},
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_default_queue=CONTROL_QUEUE,
    task_time_limit=120,
    task_soft_time_limit=100,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    timezone="UTC",
    beat_schedule={
        "control-tick": {
            "task": "workers.control.tick",
            "schedule": float(env_int("CYCLE_INTERVAL_S", 2, minimum=1)),
            "options": {"queue": CONTROL_QUEUE, "expires": 10},
        },
        # Invoice drafts refreshed, past months finalized after their grace period.
        "invoice-tick": {
            "task": "workers.control.invoice_tick",
            "schedule": 300.0,
            "options": {"queue": CONTROL_QUEUE, "expires": 240},
        },
        "purge-idempotency-keys": {
            "task": "workers.control.purge_idempotency_keys",
            "schedule": 3600.0,
            "options": {"queue": CONTROL_QUEUE, "expires": 600},
        },
        # Webhook deliveries whose retry message was lost with a worker are sent again.
        "sweep-webhooks": {
            "task": "workers.control.sweep_webhooks",
            "schedule": 120.0,
            "options": {"queue": CONTROL_QUEUE, "expires": 100},
        },
    },
)


def pool_unacked_host(prefix: str) -> str:
    """The name an agent pool's (``GPUSHARE_POOL_PREFIX``) in-flight keys are made from: its
    Redis user's patterns (``wire.broker_acl.pool_rules``) cover it."""
    return f"{prefix}pool"


if ROLE == "agent":
    # Remote control, like gossip, mingle and worker heartbeats (off on the agent's command
    # line), goes through channels and uuid-named reply queues shared by every worker, which
    # no per-host Redis user can be confined to; nothing here uses it.
    app.conf.worker_enable_remote_control = False
    _host = os.environ.get("GPUSHARE_HOST", "").strip()
    if config.serves_many_hosts():  # a pool or a gateway: its own keys only if enrolled as one
        _host = pool_unacked_host(config.pool_prefix()) if config.pool_prefix() else ""
    if _host:
        app.conf.broker_transport_options = {**app.conf.broker_transport_options, **unacked_keys(_host)}


@functools.cache
def process_signer() -> signing.Signer:
    """Who this process's messages are signed by: an agent by its host's (or its pool's) key,
    every other process (web, control worker, beat, manage.py) by the control plane's."""
    if ROLE != "agent":
        return signing.Signer(signing.CONTROL, signing.control_private_key(config.secret_key()))
    key = config.host_key()
    if key is None:
        raise ConfigError(
            "GPUSHARE_HOST_KEY_FILE (or GPUSHARE_HOST_KEY) is unset: an agent signs what it reports "
            "with its host's key (manage.py host_credential issue <host> --out DIR writes it)"
        )
    if config.serves_many_hosts():
        if not config.pool_prefix():
            raise ConfigError(
                "an agent pool or a Slurm gateway signs as the prefix it was enrolled under: set "
                "GPUSHARE_POOL_PREFIX"
            )
        name = signing.pool_signer(config.pool_prefix())
    else:
        name = signing.host_signer(os.environ.get("GPUSHARE_HOST", "").strip())
    try:
        return signing.Signer(name, signing.private_key(key))
    except signing.KeyFormatError as exc:
        raise ConfigError(f"GPUSHARE_HOST_KEY: {exc}") from exc


signing.install(process_signer)


@signals.before_task_publish.connect
def _sign(
    sender: str | None = None, body: Any = None, headers: dict[str, Any] | None = None, **_: Any
) -> None:
    """Every message this process sends is signed (``wire/signing.py``): the body is Celery's
    protocol 2 ``(args, kwargs, embed)``."""
    if sender is None or headers is None or not isinstance(body, (tuple, list)):
        return
    headers.update(signing.current().headers(sender, str(headers.get("id", "")), body[0], body[1]))


# Celery logs every task received and succeeded, and beat every message it sends, at INFO:
# several lines a second that bury the banner, the warnings and the sandbox transitions.
# They stay available with LOG_LEVEL=debug (--loglevel=DEBUG).
CHATTY_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


@signals.after_setup_logger.connect
def _quiet_task_lines(loglevel: int | str = logging.INFO, **_: Any) -> None:
    level = logging.getLevelName(loglevel) if isinstance(loglevel, str) else loglevel
    if not isinstance(level, int) or level > logging.DEBUG:
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


if ROLE == "control":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
