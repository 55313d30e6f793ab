"""slurmdbd's account of each gpushare job that ended, sent to the control plane
(``slurm_accounted``), which checks its ledger against it (portal/control/slurm_accounting.py).

slurmdbd learns of a job's end from slurmctld a moment after it happens, so an ended job is
asked for again each poll until its record has an end (at most ``GIVE_UP_S``). A restarted
gateway sends again what slurmctld still lists: the check is idempotent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from wire.messages import SlurmAccounting, to_control
from workers.slurm.rest import SlurmError, SlurmRest
from workers.slurm.view import ClusterView

log = logging.getLogger(__name__)
GIVE_UP_S = 300.0
SHARING_GRES = ("gpu", "shard", "mps")


def accounting_record(job_id: int, data: dict[str, Any]) -> SlurmAccounting | None:
    """The parts of slurmdbd's job record the ledger is checked against; None until it has
    the job's end."""
    times = data.get("time") or {}
    if not times.get("end") or not times.get("start"):
        return None
    allocated = (data.get("tres") or {}).get("allocated") or ()
    gres = {
        str(t["name"]): int(t.get("count") or 0)
        for t in allocated
        if t.get("type") == "gres" and t.get("name") in SHARING_GRES
    }
    return SlurmAccounting(
        job_id=job_id, start_s=int(times["start"]), end_s=int(times["end"]),
        elapsed_s=int(times.get("elapsed") or int(times["end"]) - int(times["start"])), gres=gres,
    )  # fmt: skip


class AccountingWatch:
    def __init__(self, rest: SlurmRest, view: ClusterView) -> None:
        self.rest = rest
        self.view = view
        self._done: set[int] = set()  # job ids sent (or given up on)
        self._waiting: dict[int, float] = {}  # job id -> when it was first seen ended

    def round(self) -> None:
        """Each gpushare job the view shows ended: its record sent once slurmdbd has it."""
        listed = {job.job_id for job in self.view.jobs}
        self._done &= listed  # slurmctld forgot them (MinJobAge): they will not come back
        self._waiting = {job_id: t for job_id, t in self._waiting.items() if job_id in listed}
        for job in self.view.jobs:
            key = job.allocation_key
            if key is None or job.active or job.job_id in self._done:
                continue
            first = self._waiting.setdefault(job.job_id, time.monotonic())
            try:
                found = self.rest.accounted(job.job_id)
            except SlurmError as exc:
                log.warning("slurmdbd's record of job %s not read: %s", job.job_id, exc)
                return  # slurmrestd is away: the next round asks again
            record = accounting_record(job.job_id, found) if found is not None else None
            if record is not None:
                to_control.slurm_accounted(key, record)
            elif time.monotonic() - first < GIVE_UP_S:
                continue
            else:
                log.warning("slurmdbd has no end for job %s after %.0f s: not checked", job.job_id, GIVE_UP_S)
            self._done.add(job.job_id)
            self._waiting.pop(job.job_id, None)
