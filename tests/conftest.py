"""Personas (owner, member, outsider, admin), a demo catalog and a fleet for every test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
from django.conf import settings

from portal.fleet.inventory import do_sync_inventory
from tests.factories import ImageFactory, MembershipFactory, ProjectFactory, TierFactory, UserFactory
from tests.slurm.cluster import SlurmCluster, missing_tools, running_cluster
from tests.workers.engines import require_engine
from wire.config import ensure_embedded_redis
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
    against its fleet, nor find its cycle already asked for or its thresholds already sent."""
    from portal.scheduling import digest, policy, preview

    policy.forget()
    from portal.control import hosts
    from portal.sandboxes import nudge, unread

    digest.clear()
    preview._fallbacks.clear()  # warmed from another test's requests
    hosts._policy_sent.clear()  # thresholds "sent" to another test's agents
    nudge.cycle_begins()  # a cycle asked for by another test's request
    unread.forget_everyone()  # counted for another test's user of the same id
    yield


def make_people() -> dict[str, Any]:
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


def make_catalog() -> dict[str, Any]:
    return {
        "dedicated": TierFactory(slug="dedicated"),
        "mig": TierFactory(slug="mig", price_per_gpu_hour_micros=700_000),
        "mps": TierFactory(slug="mps", price_per_gpu_hour_micros=400_000),
        "timeslice": TierFactory(slug="timeslice", price_per_gpu_hour_micros=210_000),
        "image": ImageFactory(),
    }


@pytest.fixture
def people(db: Any) -> dict[str, Any]:
    return make_people()


@pytest.fixture
def catalog(db: Any) -> dict[str, Any]:
    return make_catalog()


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
    from wire import dispatch

    monkeypatch.setattr(dispatch, "to_host", lambda host, task, *a: sent.append((f"host.{host}", task, a)))
    monkeypatch.setattr(dispatch, "to_control", lambda task, *a: sent.append(("control", task, a)))
    return sent


@pytest.fixture
def on_commit_runs(db: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``transaction.on_commit`` callbacks run when they would in production, in a plain
    ``django_db`` test: when the outermost atomic block the code under test opens exits
    (none if it rolled back), or at once when registered outside any block.

    A plain ``django_db`` test runs inside a transaction that is rolled back at its end, so
    its callbacks would never run; ``transaction=True`` runs them by committing for real, at
    the price of emptying every table after each test. Tests that only need the callbacks
    (placing, launching, stopping and webhooks send through them) use this instead. Unlike
    ``django_capture_on_commit_callbacks``, each callback runs at its own commit point, before
    the test's next statement, as it would after a real commit."""
    import logging

    from django.db import DEFAULT_DB_ALIAS, connections, transaction

    connection = connections[DEFAULT_DB_ALIAS]  # this thread's: other threads commit for real
    base = len(connection.atomic_blocks)  # the test's own blocks (pytest-django's)
    if not base:
        yield  # a transactional test: commits are real
        return

    def call(func: Any, robust: bool) -> None:
        if not robust:
            func()
            return
        try:
            func()
        except Exception as exc:
            logging.getLogger("django.db.backends.base").error(
                f"Error calling {func.__qualname__} in on_commit() ({exc})", exc_info=True
            )

    def run_pending() -> None:  # as run_and_clear_commit_hooks does after a real commit
        pending, connection.run_on_commit = connection.run_on_commit, []
        while pending:
            _, func, robust = cast("tuple[set[str], Any, bool]", pending.pop(0))  # stubs: 2 items
            call(func, robust)

    original_on_commit = connection.on_commit

    def on_commit(func: Any, robust: bool = False) -> None:
        if len(connection.atomic_blocks) == base:  # in "autocommit": no block of the code's own
            if not callable(func):
                raise TypeError("on_commit()'s callback must be a callable.")
            call(func, robust)
        else:
            original_on_commit(func, robust)

    original_exit = transaction.Atomic.__exit__

    def exit_and_commit(self: Any, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        result = original_exit(self, exc_type, exc_value, traceback)
        if (
            exc_type is None
            and transaction.get_connection(self.using) is connection
            and len(connection.atomic_blocks) == base
            and not connection.needs_rollback
        ):
            run_pending()  # the outermost block of the code under test "committed"
        return result

    run_pending()  # whatever fixtures set up before this one had committed by now
    connection.on_commit = on_commit  # type: ignore[method-assign]
    monkeypatch.setattr(transaction.Atomic, "__exit__", exit_and_commit)
    try:
        yield
    finally:
        del connection.on_commit


# --- Scenarios in steps -------------------------------------------------------------------
# A long browser or e2e scenario is a class marked ``steps``: one test per user-visible step,
# run in file order, sharing a started platform through class-scoped fixtures (the database
# through ``scenario_db``), so a failure names the step. Once a step fails, the later steps of
# its scenario are skipped with a message naming it (they would fail for its reason). Run a
# scenario whole: a step alone lacks what the earlier ones did.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "steps: the tests of this class or module are the ordered steps of one scenario"
    )


def _scenario(item: pytest.Item) -> pytest.Collector | None:
    """The class or module whose ``steps`` marker makes ``item`` a step, if any."""
    for node in (item.getparent(pytest.Class), item.getparent(pytest.Module)):
        if node is not None and any(m.name == "steps" for m in node.own_markers):
            return node
    return None


_FAILED_STEP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    scenario = _scenario(item)
    if scenario is not None and _FAILED_STEP in scenario.stash:
        pytest.skip(f"an earlier step of this scenario failed: {scenario.stash[_FAILED_STEP]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    scenario = _scenario(item)
    if scenario is not None and report.failed:
        scenario.stash.setdefault(_FAILED_STEP, item.name)
        # What the platform's processes said, as running_platform prints when a test fails.
        for value in getattr(item, "funcargs", {}).values():
            logs = getattr(value, "logs", None)
            if callable(logs) and hasattr(value, "procs"):
                report.sections.append(("platform logs", logs()))
    return report


# The database the settings name, read before any test database replaces it.
_CONFIGURED_DB_NAME = settings.DATABASES["default"]["NAME"]


@pytest.fixture(scope="class")
def scenario_db(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    """The test database for a scenario's steps (a class: ``usefixtures("scenario_db")``, so
    that every step counts as touching the database): what a step writes stays for the next
    (each write commits, so the platform's processes see it), and every table is emptied after
    the scenario, as after a ``transaction=True`` test. A step takes no ``db`` fixture or
    ``django_db`` marker of its own: that would roll back or empty the tables between steps."""
    from django.core.management import call_command
    from django.db import connections
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        created = None
        if connections["default"].settings_dict["NAME"] == _CONFIGURED_DB_NAME:
            # Still the configured database, not a test one: no test of the session asked
            # pytest-django for it (it sets up only what marked tests and db fixtures need),
            # so these steps alone were selected. (Once set up, NAME is the test database's.)
            created = setup_databases(verbosity=0, interactive=False, aliases=dict.fromkeys(["default"]))
        try:
            yield
        finally:
            connections.close_all()
            call_command("flush", verbosity=0, interactive=False, database="default")
            connections.close_all()
            if created is not None:
                teardown_databases(created, verbosity=0)


# A scenario's shared fixtures (its steps are one class: ``steps`` below): the people and
# catalog its platform serves, committed for the class, and what a step found that a later
# one uses. A scenario needing more of either defines its own.
@pytest.fixture(scope="class")
def world(scenario_db: None) -> dict[str, Any]:
    return {**make_people(), **make_catalog()}


@pytest.fixture(scope="class")
def state() -> dict[str, Any]:
    return {}


@pytest.fixture(scope="session")
def cluster() -> Iterator[SlurmCluster]:
    """A Slurm cluster on loopback (tests/slurm/cluster.py), started once for every test that
    asks for it (about ten seconds). Tests leave it as they found it: their jobs cancelled,
    nodes resumed."""
    require_engine(not missing_tools() and os.geteuid() == 0, f"Slurm's daemons as root ({missing_tools()})")
    with running_cluster() as running:
        yield running
