"""Test-process environment, loaded with ``-p tests.testenv`` so it runs before
pytest-django reads the settings (a conftest would be too late).

Tests run with production defaults (DEBUG off) and a throwaway key; everything else
comes from the environment (DATABASE_URL, REDIS_URL) as in ``make test``.
"""

import os
import signal
from pathlib import Path

import pytest

# Long and varied enough for production's start-up check (DEBUG is off in tests).
os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production-0123456789abcdef")
# Test clients speak plain HTTP; test_security.py turns the redirect back on where it checks it.
os.environ.setdefault("SECURE_SSL_REDIRECT", "false")
os.environ.setdefault("SESSION_COOKIE_SECURE", "false")
os.environ.setdefault("CSRF_COOKIE_SECURE", "false")
os.environ.setdefault("ALLOWED_HOSTS", "localhost,127.0.0.1,testserver")
os.environ.setdefault("STATIC_MANIFEST", "false")
# Connections opened by consumer threads must close, or the test database cannot be dropped.
os.environ.setdefault("DB_CONN_MAX_AGE", "0")


# The embedded pass of `make test` (scripts/run-tests.sh, GPUSHARE_TEST_BACKEND=embedded) runs
# again, on SQLite with the embedded Redis, every test that touches the database; the rest
# (the scheduler core, drivers, pure helpers) does not depend on the backend and ran once.
_DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "live_server",
        "django_db_setup",  # what a module-scoped database fixture (conftest's scenario_db) takes
    }
)


def _touches_database(item: object) -> bool:
    marker = getattr(item, "get_closest_marker", lambda name: None)("django_db")
    return marker is not None or bool(_DATABASE_FIXTURES & set(getattr(item, "fixturenames", ())))


# GPUSHARE_TEST_PART splits a pass for `make test` (scripts/run-tests.sh): "background" keeps
# the database tests that start no processes, engines or browser and race no threads, which
# run niced beside the rest; "foreground" keeps the rest. Tests with these markers watch
# timing (processes, engines, a browser, threads racing for rows) and must not be starved.
FOREGROUND_MARKERS = frozenset({"e2e", "browser", "docker", "libvirt", "bwrap", "slurm", "races"})


def _background(item: object) -> bool:
    names = {mark.name for mark in getattr(item, "iter_markers", lambda: ())()}
    return _touches_database(item) and not (names & FOREGROUND_MARKERS)


def pytest_collection_modifyitems(config: object, items: list[object]) -> None:
    wanted = []
    if os.environ.get("GPUSHARE_TEST_BACKEND") == "embedded":
        wanted.append(_touches_database)
    part = os.environ.get("GPUSHARE_TEST_PART", "")
    if part == "background":
        wanted.append(_background)
    elif part == "foreground":
        wanted.append(lambda item: not _background(item))
    elif part:
        raise ValueError(f"GPUSHARE_TEST_PART={part!r}: expected background or foreground")
    keep = [item for item in items if all(want(item) for want in wanted)]
    dropped = [item for item in items if not all(want(item) for want in wanted)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)  # type: ignore[attr-defined]
        items[:] = keep


# The embedded Redis a run starts (conftest's session fixture, or portal.asgi when a test
# module imports it; it daemonizes) is stopped when the run ends, interrupted or not, so a
# run leaves no server behind. One that already answered (a `make run` on the same var dir)
# is left alone.
_STARTED_REDIS = pytest.StashKey[Path]()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (run-tests.sh's exit trap, a CI timeout) stops a run as Ctrl-C does: fixtures
    # tear down (a platform's processes, in sessions of their own, stop) and the Redis below.
    signal.signal(signal.SIGTERM, _interrupt)
    from wire.config import embedded_redis_dir
    from wire.embedded_redis import is_running

    embedded = embedded_redis_dir()
    if embedded is not None and not is_running(embedded):
        config.stash[_STARTED_REDIS] = embedded


def pytest_unconfigure(config: pytest.Config) -> None:
    embedded = config.stash.get(_STARTED_REDIS, None)
    if embedded is not None:
        from wire.embedded_redis import stop

        stop(embedded)
