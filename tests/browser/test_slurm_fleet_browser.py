"""The fleet in Chromium with a Slurm cluster in front (issue 39): the web server, a control
worker, the Slurm gateway and a monitor on each node against the real daemons of
tests/slurm/cluster.py. The Slurm nodes show as hosts with their GPUs and their live figures
(the monitors'); a job submitted with sbatch outside gpushare shows its GPUs held, with the
job and its user; a sandbox on a Slurm node has its live chart, as on a host of gpushare's.
Screenshots go to docs/screenshots/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from portal.fleet.models import Gpu, Host
from portal.sandboxes.models import Sandbox
from tests.browser.pages import shot, sign_in, wait_until
from tests.e2e.platform import wait_for
from tests.portal.helpers import request
from tests.slurm.cluster import SlurmCluster
from tests.slurm.platform import slurm_platform

pytestmark = [
    pytest.mark.browser, pytest.mark.slurm, pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]  # fmt: skip


def test_the_fleet_shows_slurm_nodes_and_an_outside_jobs_gpus_held(
    cluster: SlurmCluster, people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    page = browser_page
    with slurm_platform(cluster, tmp_path) as platform:
        wait_for(
            lambda: (
                Host.objects.filter(name__startswith=platform.host, state="up").count() == len(cluster.nodes)
            ),
            60,
            lambda: "the Slurm nodes to come up\n" + platform.logs(),
        )
        job_id = cluster.run(
            "sbatch", "--parsable", "-w", "n1", "--gres=gpu:h100:2", "-o", "/dev/null", "--wrap", "sleep 300"
        ).strip()  # fmt: skip
        try:
            held = Gpu.objects.filter(host__name=f"{platform.host}n1", unavailable_reason__contains=job_id)
            wait_for(lambda: held.count() == 2, 30, lambda: "n1's GPUs to be held\n" + platform.logs())
            sign_in(page, f"http://127.0.0.1:{platform.port}", "ada", "/console/fleet/")
            text = page.locator("main").inner_text()
            for node in ("n1", "n2", "n3"):
                assert f"{platform.host}{node}" in text
            assert f"held by Slurm job {job_id} (root), submitted outside gpushare" in text
            live = page.locator(f'[data-live-gpu="SLURM-{platform.host}n1-GPU0"]')
            wait_for(
                lambda: "°C" in live.inner_text(),
                30,
                lambda: "n1's figures from its monitor\n" + platform.logs(),
            )
            shot(page, "console-fleet-slurm")
        finally:
            cluster.run("scancel", job_id)
        # A sandbox on a Slurm node: its page's chart moves with its job's figures.
        sandbox = request(
            people["owner"], people["project"], catalog["dedicated"], catalog["image"], "process"
        )
        running = Sandbox.objects.filter(pk=sandbox.pk, state="running")
        wait_for(running.exists, 60, lambda: "the sandbox to run on a Slurm node\n" + platform.logs())
        page.context.clear_cookies()
        sign_in(page, f"http://127.0.0.1:{platform.port}", "olivia", f"/sandboxes/{sandbox.pk}/")
        wait_until(
            page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 5", timeout=30_000
        )
        status = page.locator("#chart-status").inner_text()
        assert "Live: connected" in status and "simulated GPU" in status, status
        connect = page.locator("#connect").inner_text()  # what Slurm, not gpushare, confines
        assert "the GPUs Slurm bound to its job" in connect and "Slurm does not confine" in connect, connect
        shot(page, "sandbox-slurm")
