"""The heartbeat's report of what a host runs: a report that fails or hangs is logged, and the
host keeps beating (a silent one left a removed container unnoticed for 90 s in CI)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.workers.test_agent import RecordingDriver, agent, spec
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers.base import SandboxStatus
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
    a.context.driver = ListingDriver(listing)  # type: ignore[assignment]
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
    assert [task for _, task, _ in sent_tasks].count("agent_heartbeats") == 2


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
    beats_sent = [sent for _, task, ([sent],) in sent_tasks if task == "agent_heartbeats"]
    assert len(beats_sent) == 3 and all(sent["owned"] is None for sent in beats_sent)


def entry(allocation: str, state: str = "running", util: tuple[float, float] = (50.0, 1.0)) -> Any:
    return {"allocation_key": allocation, "state": state, "tracked": True, "util": util}


def test_every_report_goes_from_a_real_hosts_agent() -> None:
    gate = reports.ReportGate("h", 0.0)
    assert all(gate.passes([entry("a")]) for _ in range(3))


def test_an_unchanged_report_waits_for_the_full_report_and_a_changed_one_does_not() -> None:
    now = [1000.0]
    gate = reports.ReportGate("node-7", 60.0, clock=lambda: now[0])
    assert gate.passes([entry("a")])  # the first
    first_due = now[0] + random.Random("node-7").uniform(0, 60.0)  # staggered by the host's name
    now[0] += 1
    assert not gate.passes([entry("a", util=(10.0, 1.0))])  # utilization alone is no change
    assert gate.passes([entry("a", state="exited")])  # a change goes at once
    now[0] += 1
    assert not gate.passes([entry("a", state="exited")])
    now[0] += 60
    assert gate.passes([entry("a", state="exited")])  # a full report is due
    assert first_due < now[0]
    now[0] += 59
    assert not gate.passes([entry("a", state="exited")])
    now[0] += 1
    assert gate.passes([entry("a", state="exited")])


def test_a_fleet_started_together_reports_in_full_spread_over_the_period() -> None:
    now = [0.0]
    gates = [reports.ReportGate(f"node-{i}", 60.0, clock=lambda: now[0]) for i in range(600)]
    for gate in gates:
        gate.passes([])
    due_by_second: Counter[int] = Counter()
    for second in range(60):
        now[0] = second + 1.0
        due_by_second[second] = sum(gate.passes([]) for gate in gates)
    assert sum(due_by_second.values()) == 600  # each once in the period
    assert max(due_by_second.values()) < 30  # about 10 a second, never the fleet at once


class EndedDriver(RecordingDriver):
    """Lists what it launched; each has ended (a batch's command returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.listed: list[SandboxHandle] = []

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        handle = super().launch(spec)
        self.listed.append(handle)
        return handle

    def list_owned(self) -> list[SandboxHandle]:
        return list(self.listed)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        return SandboxStatus(state="exited", exit_code=0, started_at_ms=1)


def test_a_report_in_which_a_sandbox_ended_goes_at_once_not_with_the_next_beat(
    tmp_path: Path, sent_tasks: Any
) -> None:
    a, _, device = agent(tmp_path)
    a.context.driver = EndedDriver()  # type: ignore[assignment]
    a.launch(replace(spec(device), mps=None))
    a.reports.build()  # on the builder thread in production, started by a beat
    [(_, _, ([beat],))] = [sent for sent in sent_tasks if sent[1] == "agent_heartbeats"]
    assert [(e["allocation_key"], e["state"]) for e in beat["owned"] or []] == [("a1", "exited")]
    a.reports.build()  # the same end again: it waits for the next beat, as any report does
    assert len([sent for sent in sent_tasks if sent[1] == "agent_heartbeats"]) == 1


def test_a_process_serving_many_hosts_keeps_an_ended_sandbox_for_its_round_of_beats(
    tmp_path: Path, sent_tasks: Any
) -> None:
    a, _, device = agent(tmp_path)
    a.context.driver = EndedDriver()  # type: ignore[assignment]
    a.reports.gate.period = 60.0  # as the agent pool's hosts: their beats go in one message a round
    a.launch(replace(spec(device), mps=None))
    a.reports.build()
    assert not [sent for sent in sent_tasks if sent[1] == "agent_heartbeats"]
    assert a.reports.ready is not None  # for the pool's next round
