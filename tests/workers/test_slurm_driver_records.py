"""What the Slurm driver and the accounting watch keep between rounds (workers/slurm/):
bounded by what slurmctld still lists, and no file named by a key that could reach
elsewhere. No Slurm daemon: the view is a stand-in with the jobs given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wire.spec import SandboxHandle
from workers.drivers.base import DriverError
from workers.slurm import driver as driver_module
from workers.slurm.accounting import AccountingWatch
from workers.slurm.driver import SlurmDriver
from workers.slurm.model import SlurmJob
from workers.slurm.settings import SlurmSettings


class _View:
    def __init__(self, jobs: list[SlurmJob]) -> None:
        self.jobs = jobs

    def jobs_on(self, node: str) -> list[SlurmJob]:
        return [j for j in self.jobs if node in j.nodes]


class _Rest:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def cancel(self, job_id: int) -> None:
        return None

    def job(self, job_id: int) -> None:
        return None  # slurmctld forgot it: the stop returns at once

    def accounted(self, job_id: int) -> None:
        self.asked.append(job_id)
        return None  # slurmdbd has no record yet


def ended(job_id: int, key: str) -> SlurmJob:
    return SlurmJob(job_id=job_id, name=f"gpushare-{key}", state="CANCELLED", user="nobody", account="lab",
                    nodes=("n1",), end_s=5)  # fmt: skip


def make_driver(tmp_path: Path, view: _View) -> SlurmDriver:
    settings = SlurmSettings(url="http://127.0.0.1:1", output_dir=tmp_path / "output")
    return SlurmDriver("slurm-n1", "n1", settings, _Rest(), view)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["../../etc/passwd", "a/b", ".hidden", "", "x" * 65, "ok\nno"])
def test_an_output_file_is_named_by_allocation_keys_only(tmp_path: Path, key: str) -> None:
    driver = make_driver(tmp_path, _View([]))
    with pytest.raises(DriverError, match="is not one gpushare makes"):
        driver.read_output(SandboxHandle("slurm", key, 1, "7"), 0, 10)
    with pytest.raises(DriverError, match="is not one gpushare makes"):
        driver._output_file(key, 0, 0)
    assert not (tmp_path / "output").exists() or not any((tmp_path / "output").iterdir())


def test_a_stop_is_forgotten_once_slurm_forgot_its_job(tmp_path: Path, monkeypatch: Any) -> None:
    view = _View([ended(7, "abc")])
    driver = make_driver(tmp_path, view)
    driver.stop(SandboxHandle("slurm", "abc", 1, "7"), grace_s=0)
    assert driver.list_owned() == []  # stopped: its ended job is not listed
    monkeypatch.setattr(driver_module, "FORGET_STOP_S", -1.0)
    assert driver.list_owned() == [] and "abc" in driver._stopped
    view.jobs = []
    driver.list_owned()
    assert driver._stopped == {}


def test_the_accounting_watch_forgets_jobs_slurm_forgot() -> None:
    view = _View([ended(7, "abc"), ended(8, "def")])
    rest = _Rest()
    watch = AccountingWatch(rest, view)  # type: ignore[arg-type]
    watch.round()
    assert set(watch._waiting) == {7, 8}
    view.jobs = [ended(8, "def")]
    watch.round()
    assert set(watch._waiting) == {8}
    watch._done.add(8)
    view.jobs = []
    watch.round()
    assert watch._done == set() and watch._waiting == {}
