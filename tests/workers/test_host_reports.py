"""The heartbeat's report of what a host runs: a report that fails or hangs is logged, and the
host keeps beating (a silent one left a removed container unnoticed for 90 s in CI)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.workers.test_agent import RecordingDriver, agent
from workers.drivers.base import SandboxHandle
from workers.host import reports


class ListingDriver(RecordingDriver):
    """Lists by calling ``listing``: raise, block, or return handles."""

    def __init__(self, listing: Any) -> None:
        super().__init__()
        self.listing = listing

    def list_owned(self) -> list[SandboxHandle]:
        return list(self.listing())


def beats(tmp_path: Path, listing: Any) -> Any:
    a, _, _ = agent(tmp_path)
    a.reports.driver = ListingDriver(listing)  # type: ignore[assignment]
    return a.reports


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_report_that_raises_is_logged_and_the_next_beat_tries_again(
    tmp_path: Path, sent_tasks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def listing() -> list[SandboxHandle]:
        calls.append(1)
        raise RuntimeError("the engine answered nonsense")

    def failures() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "the sandbox report failed" in r.getMessage()]

    host_reports = beats(tmp_path, listing)
    with caplog.at_level(logging.ERROR, logger="workers.host.reports"):
        host_reports.heartbeat()
        wait_until(lambda: len(failures()) == 1, "the failed report to be logged")
        host_reports.heartbeat()
        wait_until(lambda: len(failures()) == 2, "the next beat's report to fail and be logged")
    assert len(calls) == 2  # each beat after a failed report starts another
    exc_info = failures()[0].exc_info
    assert exc_info is not None and "the engine answered nonsense" in str(exc_info[1])
    assert [task for _, task, _ in sent_tasks].count("agent_heartbeat") == 2


def test_a_report_stuck_in_the_driver_is_logged_with_where_it_waits(
    tmp_path: Path, sent_tasks: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reports, "REPORT_STUCK_S", 0.05)
    release = threading.Event()

    def listing() -> list[SandboxHandle]:
        release.wait(10)
        return []

    host_reports = beats(tmp_path, listing)
    try:
        with caplog.at_level(logging.WARNING, logger="workers.host.reports"):
            host_reports.heartbeat()
            time.sleep(0.2)
            host_reports.heartbeat()
            host_reports.heartbeat()  # logged once per stuck report
    finally:
        release.set()
    [stuck] = [r for r in caplog.records if "has been building" in r.getMessage()]
    assert "listing" in stuck.getMessage()  # the stack shows the driver call it waits in
    # Every beat still went out, carrying no report while the listing hung.
    beats_sent = [args for _, task, args in sent_tasks if task == "agent_heartbeat"]
    assert len(beats_sent) == 3 and all(args[4] is None for args in beats_sent)
