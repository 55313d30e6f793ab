"""The ``on_commit_runs`` fixture (tests/conftest.py) runs on-commit callbacks when a real
commit would, so the plain ``django_db`` tests that use it see what production does."""

from __future__ import annotations

import pytest
from django.db import transaction

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def test_callbacks_run_at_the_outermost_commit_never_after_a_rollback() -> None:
    ran: list[str] = []
    transaction.on_commit(lambda: ran.append("autocommit"))
    assert ran == ["autocommit"]  # no block open: at once, as in autocommit

    with transaction.atomic():
        transaction.on_commit(lambda: ran.append("outer"))
        with transaction.atomic():
            transaction.on_commit(lambda: ran.append("inner"))
        assert ran == ["autocommit"]  # a savepoint released is no commit
    assert ran == ["autocommit", "outer", "inner"]

    with transaction.atomic():
        transaction.on_commit(lambda: ran.append("rolled back"))
        transaction.set_rollback(True)
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        transaction.on_commit(lambda: ran.append("raised"))
        _ = 1 / 0
    with transaction.atomic():
        with transaction.atomic():
            transaction.on_commit(lambda: ran.append("inner rolled back"))
            transaction.set_rollback(True)
        transaction.on_commit(lambda: ran.append("kept"))
    assert ran == ["autocommit", "outer", "inner", "kept"]


def test_a_callback_that_commits_runs_its_own_callbacks_in_order() -> None:
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        with transaction.atomic():
            transaction.on_commit(lambda: ran.append("first's own"))

    with transaction.atomic():
        transaction.on_commit(first)
        transaction.on_commit(lambda: ran.append("second"))
    assert ran == ["first", "first's own", "second"]  # as run_and_clear_commit_hooks orders them
