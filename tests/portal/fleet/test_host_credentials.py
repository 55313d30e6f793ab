"""A GPU host's own Redis user (issue 38): what host A's credentials can and cannot reach, on
the suite's real Redis. Needs Redis 7 (selectors); the embedded Redis 6.2 is skipped."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.management import CommandError, call_command

from portal.fleet import credentials
from portal.fleet.models import HostCredential
from wire import broker_acl, liveness, relay, signing, telemetry
from wire.celery import CONTROL_QUEUE, host_queue, unacked_keys

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin() -> redis.Redis:
    client = redis.Redis.from_url(settings.REDIS_URL)
    if not broker_acl.supports_selectors(client):
        pytest.skip("Redis 6 has no ACL selectors (the embedded Redis): per-host users need Redis 7")
    return client


@pytest.fixture
def hosts(admin: redis.Redis) -> Iterator[tuple[str, str]]:
    """Two enrolled hosts, named uniquely: ACL users belong to the whole Redis server."""
    tag = uuid.uuid4().hex[:8]
    names = (f"a-{tag}", f"b-{tag}")
    yield names
    for name in names:
        admin.execute_command("ACL", "DELUSER", broker_acl.username(name))


def as_host(url: str) -> Any:
    """A client as the host's agent holds one (``Any``: redis-py's sync and async types mix)."""
    return redis.Redis.from_url(url, socket_timeout=5)


def group(name: str) -> str:
    """The Redis channel of a channel-layer group."""
    return broker_acl.CHANNEL_GROUP.format(group=name)


def refused(call: Any, *args: Any) -> bool:
    try:
        call(*args)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_a_host_reaches_its_own_keys_and_pushes_to_control_only(
    admin: redis.Redis, hosts: tuple[str, str]
) -> None:
    a, b = hosts
    url_a = credentials.issue(a).redis_url
    credentials.issue(b)
    assert broker_acl.username(a) in url_a and "@" in url_a
    host_a = as_host(url_a)
    admin.lpush(host_queue(b), b"launch spec of b")
    try:
        # Its own: queue, in-flight bookkeeping, liveness, latest telemetry, relay streams.
        assert host_a.llen(host_queue(a)) == 0
        host_a.hset(unacked_keys(a)["unacked_key"], "tag", b"x")
        host_a.set(liveness.KEY.format(host=a), 1, ex=10)
        host_a.hset(telemetry.latest_key(a), "GPU-1", b"{}")
        host_a.xadd(relay.out_stream(a, "s1"), {"type": "opened"})
        # A Slurm node's monitor hands its samples over in its own key, its gateway reads them.
        host_a.set(telemetry.node_samples_key(a), b"{}", ex=10)
        assert host_a.mget([telemetry.node_samples_key(a)]) == [b"{}"]
        # A lock's release script, loaded on a Redis that has not seen it (kombu's mutex).
        assert host_a.script_load("return 1")
        # Live figures, alerts and output on its own groups (wire.telemetry names them by host).
        host_a.publish(group(telemetry.gpu_group(a, "GPU-1")), b"sample")
        host_a.publish(group(telemetry.fleet_group(a)), b"sample")
        # The control queue: push and count, nothing else.
        assert host_a.lpush(CONTROL_QUEUE, b"report") >= 1
        assert host_a.llen(CONTROL_QUEUE) >= 1
        for call, args in [
            (host_a.lrange, (CONTROL_QUEUE, 0, -1)),
            (host_a.rpop, (CONTROL_QUEUE,)),
            (host_a.delete, (CONTROL_QUEUE,)),
            (host_a.expire, (CONTROL_QUEUE, 1)),
            # Another host's queue, relay streams, liveness and telemetry.
            (host_a.lrange, (host_queue(b), 0, -1)),
            (host_a.brpop, ([host_queue(b)], 1)),
            (host_a.lpush, (host_queue(b), b"forged")),
            (host_a.xread, ({relay.in_stream(b, "s2"): "0"},)),
            (host_a.xadd, (relay.in_stream(b, "s2"), {"type": "input"})),
            (host_a.set, (liveness.KEY.format(host=b), 1)),
            (host_a.hset, (telemetry.latest_key(b), "GPU-2", b"{}")),
            (host_a.set, (telemetry.node_samples_key(b), b"{}")),
            (host_a.mget, ([telemetry.node_samples_key(b)],)),
            (host_a.script_flush, ()),
            # Another host's live groups, a sandbox page's own, the old shared names.
            (host_a.publish, (group(telemetry.gpu_group(b, "GPU-2")), b"x")),
            (host_a.publish, (group(telemetry.host_sandbox_group(b, 7)), b"x")),
            (host_a.publish, (group(telemetry.sandbox_group(7)), b"x")),
            (host_a.publish, ("asgi__group__fleet", b"x")),
            # Everyone's in-flight messages, key listings, the server.
            (host_a.hgetall, ("unacked",)),
            (host_a.hgetall, (unacked_keys(b)["unacked_key"],)),
            (host_a.keys, ("*",)),
            (host_a.scan, (0,)),
            (host_a.flushall, ()),
            (host_a.config_get, ("*",)),
            (host_a.publish, ("/0.celery.pidbox", b"shutdown")),
            (host_a.get, ("gpushare:control:heartbeat",)),
        ]:
            assert refused(call, *args), f"{call.__name__}{args} was allowed"
        assert admin.lrange(host_queue(b), 0, -1) == [b"launch spec of b"]
    finally:
        admin.delete(host_queue(b), CONTROL_QUEUE, unacked_keys(a)["unacked_key"])
        admin.delete(liveness.KEY.format(host=a), telemetry.latest_key(a), relay.out_stream(a, "s1"))
        admin.delete(telemetry.node_samples_key(a))
        host_a.close()


def test_a_revoked_host_is_cut_off_and_a_rotated_password_replaces_the_old(
    admin: redis.Redis, hosts: tuple[str, str]
) -> None:
    a, _ = hosts
    issued = credentials.issue(a)
    first = issued.redis_url
    with pytest.raises(credentials.CredentialError, match="already has a credential"):
        credentials.issue(a)
    connected = as_host(first)
    assert connected.ping()
    assert credentials.public_key_of(signing.host_signer(a)) == signing.public_text(
        signing.private_key(issued.host_key)
    )
    rotated = credentials.rotate(a)
    second = rotated.redis_url
    # A new key too: what the old one signs is no longer believed.
    assert rotated.host_key != issued.host_key
    assert credentials.public_key_of(signing.host_signer(a)) == signing.public_text(
        signing.private_key(rotated.host_key)
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        connected.ping()  # its connection was cut
    with pytest.raises(redis.exceptions.AuthenticationError):
        as_host(first).ping()
    agent = as_host(second)
    assert agent.ping()
    credentials.revoke(a)
    with pytest.raises(redis.exceptions.ConnectionError):
        agent.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        as_host(second).ping()
    assert not HostCredential.objects.get(host=a).active
    assert credentials.public_key_of(signing.host_signer(a)) is None
    with pytest.raises(credentials.CredentialError, match="no active credential"):
        credentials.revoke(a)


def test_a_redis_that_lost_its_users_gets_them_back(admin: redis.Redis, hosts: tuple[str, str]) -> None:
    a, b = hosts
    url = credentials.issue(a).redis_url
    credentials.issue(b)
    credentials.revoke(b)
    admin.execute_command("ACL", "DELUSER", broker_acl.username(a))  # a restart without an ACL file
    with pytest.raises(redis.exceptions.AuthenticationError):
        as_host(url).ping()
    assert credentials.reconcile() >= 1
    assert as_host(url).ping()
    users = {u.decode() for u in admin.execute_command("ACL", "USERS")}
    assert broker_acl.username(b) not in users


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("redis://127.0.0.1:6379/3", "redis://gpushare-host-gpu01:p%2Fw@127.0.0.1:6379/3"),
        ("rediss://:admin@redis.lab:6380/0", "rediss://gpushare-host-gpu01:p%2Fw@redis.lab:6380/0"),
        ("unix:///var/run/redis.sock?db=2", "unix://gpushare-host-gpu01:p%2Fw@/var/run/redis.sock?db=2"),
    ],
)
def test_the_agents_url_is_the_control_planes_with_the_hosts_user(base: str, expected: str) -> None:
    assert credentials.agent_url(base, "gpushare-host-gpu01", "p/w") == expected


@pytest.mark.parametrize("name", ["", "a b", "x" * 64, "a*", "a:b"])
def test_a_host_name_that_could_widen_an_acl_pattern_is_refused(name: str) -> None:
    with pytest.raises(credentials.CredentialError, match="is not a host name"):
        credentials.issue(name)


def test_the_command_writes_the_agents_credentials_for_the_host_alone_and_renews_them(
    admin: redis.Redis, hosts: tuple[str, str], tmp_path: Any
) -> None:
    a, _ = hosts
    out = tmp_path / "credentials"
    call_command("host_credential", "issue", a, "--out", str(out), stdout=io.StringIO())
    # The three files the agent's unit loads (LoadCredential=), secrets kept to root.
    assert sorted(p.name for p in out.iterdir()) == ["control_key.pub", "host_key", "redis_url"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in out.iterdir())
    first = (out / "redis_url").read_text().strip()
    assert as_host(first).ping()
    assert (out / "control_key.pub").read_text().strip() == credentials.control_public_key()
    key = (out / "host_key").read_text().strip()
    assert credentials.public_key_of(signing.host_signer(a)) == signing.public_text(signing.private_key(key))
    # A link planted where a file goes is replaced, never written through.
    (out / "host_key").unlink()
    (out / "host_key").symlink_to(tmp_path / "elsewhere")
    renewed = io.StringIO()
    call_command("host_credential", "rotate", a, "--out", str(out), stdout=io.StringIO())
    assert not (tmp_path / "elsewhere").exists() and not (out / "host_key").is_symlink()
    call_command("host_credential", "renew", a, stdout=renewed)  # what make run does each start
    with pytest.raises(redis.exceptions.AuthenticationError):
        as_host(first).ping()
    env = dict(line.split("=", 1) for line in renewed.getvalue().splitlines())
    assert sorted(env) == ["GPUSHARE_CONTROL_PUBLIC_KEY", "GPUSHARE_HOST_KEY", "REDIS_URL"]
    assert as_host(env["REDIS_URL"]).ping()
    listed = io.StringIO()
    call_command("host_credential", "list", stdout=listed)
    assert f"{a}\tactive" in listed.getvalue()
    with pytest.raises(CommandError, match="already has a credential"):
        call_command("host_credential", "issue", a, stdout=io.StringIO())
    with pytest.raises(CommandError, match="needs a host name"):
        call_command("host_credential", "revoke", stdout=io.StringIO())


def test_an_agent_pool_reaches_the_hosts_under_its_prefix_and_no_other(
    admin: redis.Redis, hosts: tuple[str, str]
) -> None:
    a, b = hosts  # "a-<tag>", "b-<tag>": the pool takes the "a-" side
    prefix = a[: a.index("-") + 1] + a.split("-", 1)[1][:4]
    pool = as_host(credentials.issue(prefix, pool=True).redis_url)
    try:
        assert pool.llen(host_queue(a)) == 0
        assert pool.set(liveness.KEY.format(host=a), 1, ex=10)
        assert refused(pool.llen, host_queue(b))
        assert refused(pool.set, liveness.KEY.format(host=b), 1)
        assert refused(pool.lrange, CONTROL_QUEUE, 0, -1)
    finally:
        admin.delete(liveness.KEY.format(host=a))
        admin.execute_command("ACL", "DELUSER", broker_acl.pool_username(prefix))
