"""gpushare's ledger for sandboxes that ran as Slurm jobs, checked against Slurm's own
accounting (issue 39): a Slurm gateway sends what slurmdbd accounted for each gpushare job
that ended (``slurm_accounted``), and the sandbox's usage intervals must agree with it, in
time within ``TOLERANCE_S`` and in GRES exactly. A difference is raised as an alert for
admins (``Alert.Kind.ACCOUNTING``), on the job's host, once per job: the ledger is what
invoices are made from, and Slurm's accounting is what the lab already trusts.

Both ends of a Slurm sandbox's interval are Slurm's clock: its start is the job's start
(the launch's report), its end the job's end (``KeepsEndTimes``), so the two agree to the
second unless something went wrong (a stop reported for a job that ran on, a requeue, a job
that held other GRES than its placement).
"""

from __future__ import annotations

import logging
from collections import Counter

from portal.billing.models import UsageRecord
from portal.control.retry import Retry
from portal.sandboxes.models import Allocation, Sandbox
from portal.telemetry.alerts import do_raise_control_alert
from portal.telemetry.models import Alert
from wire.messages import SlurmAccounting

log = logging.getLogger(__name__)
TOLERANCE_S = 1.0
LEDGER_WAIT_S = 5.0  # the job's end may reach the ledger after slurmdbd's record reaches us


def expected_gres(allocations: list[Allocation]) -> dict[str, int]:
    """The GRES the Slurm driver asks for a placement (workers.slurm.driver.gres_request): a
    whole GPU is ``gpu``, a time-slice replica one ``shard`` (a Slurm GPU's replicas are its
    shards: GpuInfo.engine_replicas), an MPS share its thread percentage of ``mps``."""
    gres: Counter[str] = Counter()
    for allocation in allocations:
        if allocation.kind == Allocation.Kind.EXCLUSIVE:
            gres["gpu"] += 1
        elif allocation.kind == Allocation.Kind.TIMESLICE:
            gres["shard"] += 1
        elif allocation.kind == Allocation.Kind.MPS:
            gres["mps"] += allocation.mps_thread_pct
    return dict(gres)


def do_check_accounting(allocation_key: str, record: SlurmAccounting) -> Retry | None:
    sandbox = Sandbox.objects.filter(allocation_key=allocation_key).select_related("host").first()
    if sandbox is None or sandbox.host is None:
        log.info("Slurm job %s: no sandbox holds %s", record.get("job_id"), allocation_key)
        return None
    intervals = list(UsageRecord.objects.filter(allocation_key=allocation_key).order_by("started_at"))
    if not intervals or any(r.ended_at is None for r in intervals):
        return Retry(LEDGER_WAIT_S)  # the stop or the exit is on its way to the ledger
    differences = []
    billed_s = sum((r.ended_at - r.started_at).total_seconds() for r in intervals if r.ended_at)
    if abs(billed_s - record["elapsed_s"]) > TOLERANCE_S:
        differences.append(f"billed {billed_s:.1f} s, Slurm accounted {record['elapsed_s']} s")
    started = intervals[0].started_at.timestamp()
    if abs(started - record["start_s"]) > TOLERANCE_S:
        differences.append(f"the ledger starts {started - record['start_s']:+.1f} s from Slurm's start")
    placed = expected_gres(list(sandbox.allocations.all()))
    accounted = {name: count for name, count in record["gres"].items() if count}
    if placed != accounted:
        differences.append(f"placed {placed or 'no GRES'}, Slurm accounted {accounted or 'no GRES'}")
    if not differences:
        log.info("Slurm job %s agrees with the ledger of sandbox %s", record["job_id"], sandbox.pk)
        return None
    message = f"Slurm job {record['job_id']} (sandbox {sandbox.pk}): " + "; ".join(differences)
    log.warning("accounting mismatch: %s", message)
    do_raise_control_alert(
        Alert.Kind.ACCOUNTING, sandbox.host, f"accounting:{sandbox.host.name}:{record['job_id']}", message,
        sandbox_id=sandbox.pk, value=billed_s - record["elapsed_s"],
    )  # fmt: skip
    return None
