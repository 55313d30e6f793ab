"""The resume contract end to end, on a real bubblewrap sandbox: a batch that checkpoints
to its folder is preempted (its tier queues it again), runs again as attempt 2 told why the
first ended, and picks up from its checkpoint. The portal makes each launch message as it
does for an agent; the process driver runs it on real storage, as the agent would."""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.catalog.models import Storage
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.factories import PriorityClassFactory, TierFactory
from tests.portal.helpers import place_all, request
from tests.portal.sandboxes.test_graceful_preemption import assert_starts, report_stopped, urgent_request
from tests.workers.engines import require_engine
from tests.workers.test_driver_storage import storage_dir  # noqa: F401 - fixture
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers.process import ProcessDriver, bwrap_available

pytestmark = [pytest.mark.django_db, pytest.mark.bwrap, pytest.mark.usefixtures("on_commit_runs")]

# Counts steps in its checkpoint folder, one every 0.1 s, saying where it started from.
CHECKPOINTING = (
    'd=$GPUSHARE_CHECKPOINT_DIR; n=$(cat "$d/step" 2>/dev/null || echo 0); '
    'echo "attempt $GPUSHARE_ATTEMPT resumed=$GPUSHARE_RESUMED" "last=${GPUSHARE_LAST_END:-none}" '
    '"from step $n"; '
    'echo "why: ${GPUSHARE_LAST_END_MESSAGE:-}"; '
    'while true; do n=$((n+1)); echo $n > "$d/step.new" && mv "$d/step.new" "$d/step"; sleep 0.1; done'
)


def wait_for(driver: ProcessDriver, handle: SandboxHandle, text: str, timeout_s: float = 30) -> str:
    deadline, out = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        out = driver.read_output(handle, 0, 1 << 16).data.decode(errors="replace")
        if text in out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {out!r}")


def launched(sent_tasks: Any, sandbox: Sandbox) -> SandboxSpec:
    """The newest launch message the portal sent for the sandbox, on no real GPU here."""
    specs = [SandboxSpec.from_json(a[0]) for _, t, a in sent_tasks if t == "launch_sandbox"]
    spec = [s for s in specs if s.sandbox_id == sandbox.pk][-1]
    return dataclasses.replace(spec, real_gpu=False, device_uuids=())


def test_a_preempted_batch_resumes_from_its_checkpoint_as_attempt_two(
    people: Any,
    catalog: Any,
    fleet: Any,
    sent_tasks: Any,
    storage_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
    tier: Any = TierFactory(
        slug="batch",
        sharing_mode="dedicated",
        priority_class=PriorityClassFactory(name="batch", value=10, preemptible=True),
        preempt_after=timedelta(0),
        preempt_grace=timedelta(0),
        requeue_on_preemption=True,
    )
    tier.storages.set(
        [Storage.objects.create(name="work", kind="project", directory="projects", mount_path="/work")]
    )
    # The fleet's four dedicated GPUs, each taken by a checkpointing batch; every one runs.
    drivers: dict[str, ProcessDriver] = {}
    handles: dict[int, SandboxHandle] = {}
    command = ("sh", "-c", CHECKPOINTING)
    batches = [
        request(people["owner"], people["project"], tier, catalog["image"], command=command) for _ in range(4)
    ]
    place_all()
    for sandbox in batches:
        sandbox.refresh_from_db()
        spec = launched(sent_tasks, sandbox)
        driver = drivers.setdefault(
            spec.host, ProcessDriver(tmp_path / spec.host, host=spec.host, storage_dir=storage_dir)
        )
        handles[sandbox.pk] = driver.launch(spec)
        actions.do_mark_running(spec.allocation_key, dict(handles[sandbox.pk].to_json()), timezone.now())
    try:
        for sandbox in batches:
            wait_for(
                drivers[launched(sent_tasks, sandbox).host],
                handles[sandbox.pk],
                "attempt 1 resumed=0 last=none from step 0",
            )
        time.sleep(0.5)  # a few steps checkpointed

        # A request of a higher class: one batch is preempted, its host stops it.
        urgent = urgent_request(people, catalog)
        [victim] = Sandbox.objects.filter(preempted_for=urgent)
        drivers[launched(sent_tasks, victim).host].stop(handles[victim.pk], grace_s=5)
        step_at_stop = int((storage_dir / "projects" / str(people["project"].pk) / ".gpushare" / "checkpoints"
                            / f"sandbox-{victim.pk}" / "step").read_text())  # fmt: skip
        assert step_at_stop >= 3
        victim = report_stopped(victim, "stopped by its host")
        assert victim.state == "queued"

        # The urgent one runs and ends; the victim is placed again and its host runs attempt 2.
        actions.do_mark_running(urgent.allocation_key, {"driver": "process", "ref": "u"}, timezone.now())
        actions.do_request_stop(urgent.pk, people["outsider"])
        urgent.refresh_from_db()
        report_stopped(urgent)
        assert_starts(victim)
        victim.refresh_from_db()
        again = launched(sent_tasks, victim)
        driver = drivers.setdefault(
            again.host, ProcessDriver(tmp_path / again.host, host=again.host, storage_dir=storage_dir)
        )
        handles[victim.pk] = driver.launch(again)
        out = wait_for(driver, handles[victim.pk], "why: ")
        assert f"attempt 2 resumed=1 last=preempted from step {step_at_stop}" in out, out
        assert f"why: preempted for sandbox {urgent.pk}" in out, out
    finally:
        for driver in drivers.values():
            for handle in driver.list_owned():
                driver.stop(handle, grace_s=0)
