"""Personas (owner, member, outsider, admin), a demo catalog and a fleet for every test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings

from portal.fleet.inventory import do_sync_inventory
from tests.factories import ImageFactory, MembershipFactory, ProjectFactory, TierFactory, UserFactory
from workers.config import ensure_embedded_redis
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

PASSWORD = "correct-horse-battery"


@pytest.fixture(scope="session", autouse=True)
def _redis_for_tests() -> None:
    """Start the embedded Redis when REDIS_URL is unset, and empty the test database.

    Tests own the Redis database they are given (make test and .ci/run pick one that
    nothing else uses), so stale queue messages from an earlier run cannot leak in.
    """
    ensure_embedded_redis()
    client = redis.Redis.from_url(settings.REDIS_URL)
    if settings.EMBEDDED_REDIS_DIR is None and client.connection_pool.connection_kwargs.get("db", 0) == 0:
        pytest.exit(
            "REDIS_URL must name a Redis database other than 0 for tests (e.g. /15): the suite empties it",
            returncode=2,
        )
    client.flushdb()


@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing() -> Iterator[None]:
    """Users made in this process get one-iteration PBKDF2 hashes (tests/hashers.py).
    override_settings, not an assignment: its setting_changed empties Django's hasher caches."""
    from django.test import override_settings

    fast = override_settings(PASSWORD_HASHERS=["tests.hashers.FastPBKDF2PasswordHasher"])
    fast.enable()
    yield
    fast.disable()


@pytest.fixture(autouse=True)
def _a_channel_layer_per_test() -> Iterator[None]:
    """Each test gets its own channel layer. Tests drive consumers with ``asyncio.run``, one
    event loop each, while Channels caches the layer per process: a receive left waiting when
    an earlier test's loop ended keeps the layer's lock held, bound to that dead loop, and
    every later receive fails ("bound to a different event loop"; seen on the embedded pass)."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture(autouse=True)
def _scheduling_state_of_this_test_only() -> Iterator[None]:
    """The control worker's kept policy and the state it publishes for previews describe one
    test's database: a later test must neither place with what it learned nor preview
    against its fleet."""
    from portal.sandboxes import digest, policy, preview

    policy.forget()
    digest.clear()
    preview._fallbacks.clear()  # warmed from another test's requests
    yield


@pytest.fixture
def people(db: Any) -> dict[str, Any]:
    project = ProjectFactory(slug="vision", name="Vision")
    other = ProjectFactory(slug="nlp", name="NLP")
    owner = UserFactory(username="olivia")
    member = UserFactory(username="mark")
    outsider = UserFactory(username="oscar")
    admin = UserFactory(username="ada", is_staff=True, is_superuser=True)
    MembershipFactory(user=owner, project=project, role="manager")
    MembershipFactory(user=member, project=project, role="member")
    MembershipFactory(user=outsider, project=other, role="manager")
    return {
        "project": project,
        "other_project": other,
        "owner": owner,
        "member": member,
        "outsider": outsider,
        "admin": admin,
    }


@pytest.fixture
def catalog(db: Any) -> dict[str, Any]:
    return {
        "dedicated": TierFactory(slug="dedicated"),
        "mig": TierFactory(slug="mig", price_per_gpu_hour_micros=700_000),
        "mps": TierFactory(slug="mps", price_per_gpu_hour_micros=400_000),
        "timeslice": TierFactory(slug="timeslice", price_per_gpu_hour_micros=210_000),
        "image": ImageFactory(),
    }


def seed_host(
    name: str,
    spec: str,
    sharing: dict[int, str] | None = None,
    driver: str = "docker",
    backend: str = "simulated",
) -> None:
    """A host in the database, as if its agent had reported its inventory (simulated GPUs,
    which ``backend`` may call real)."""
    from portal.fleet.models import Gpu

    gpus = SimulatedBackend(name, parse_sim_spec(spec)).list_gpus()
    do_sync_inventory(name, backend, driver, [g.to_json() for g in gpus])
    for index, mode in (sharing or {}).items():
        Gpu.objects.filter(host__name=name, index=index).update(sharing_mode=mode)


@pytest.fixture
def fleet(db: Any) -> None:
    """Two hosts whose admin pinned every GPU not in MIG mode: each serves one mode only
    (h100: two MIG GPUs, two dedicated; a100: two dedicated, one MPS, one time-slice)."""
    seed_host("h100", "H100-80GB:4:mig=0,1", {2: "dedicated", 3: "dedicated"})
    seed_host("a100", "A100-80GB:4", {0: "dedicated", 1: "dedicated", 2: "mps", 3: "timeslice"})


@pytest.fixture
def auto_fleet(db: Any) -> None:
    """The same hosts as agents report them: every GPU not in MIG mode follows demand."""
    seed_host("h100", "H100-80GB:4:mig=0,1")
    seed_host("a100", "A100-80GB:4")


@pytest.fixture
def sent_tasks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, tuple[Any, ...]]]:
    """Capture messages to workers instead of sending them (unit tests)."""
    sent: list[tuple[str, str, tuple[Any, ...]]] = []
    from workers import dispatch

    monkeypatch.setattr(dispatch, "to_host", lambda host, task, *a: sent.append((f"host.{host}", task, a)))
    monkeypatch.setattr(dispatch, "to_control", lambda task, *a: sent.append(("control", task, a)))
    return sent
