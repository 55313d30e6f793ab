"""gpushare in front of a real Slurm cluster, end to end (issue 39): the web server, a control
worker, beat and the Slurm gateway as their own processes, the cluster of
tests/slurm/cluster.py, and the command-line client. A scenario of steps: the nodes come up
as hosts; a sandbox requested through ``gpushare request`` becomes a Slurm job on the node
gpushare chose and runs; its shell says hi; a batch's output shows on its page; a stop
cancels the job and closes the ledger; a job submitted outside gpushare holds its GPUs; a
node Slurm sets down is lost."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.billing.models import UsageRecord
from portal.fleet.models import Gpu, Host
from portal.sandboxes.models import Sandbox
from portal.telemetry.models import Alert
from tests.e2e.platform import ROOT, Platform, wait_for
from tests.slurm.cluster import TENANT, SlurmCluster
from tests.slurm.platform import slurm_platform
from workers.slurm.model import expand_hostlist

pytestmark = [pytest.mark.slurm, pytest.mark.e2e, pytest.mark.slow]
GPUSHARE = str(ROOT / ".venv" / "bin" / "gpushare")


@pytest.fixture(scope="class")
def platform(
    cluster: SlurmCluster, world: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    with slurm_platform(cluster, tmp_path_factory.mktemp("slurm-platform")) as platform:
        yield platform


def gpushare(home: Path, *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / "config"),
        "LANG": "C.UTF-8",
    }
    return subprocess.run(
        [GPUSHARE, *argv], input=stdin, capture_output=True, text=True, env=env, cwd=home, timeout=180
    )


def job_of(cluster: SlurmCluster, sandbox: Sandbox) -> dict[str, Any]:
    """Slurm's record of the sandbox's job, by the name the gateway gives it."""
    jobs = json.loads(cluster.run("squeue", "--json", "--states=all"))["jobs"]
    [found] = [j for j in jobs if j["name"] == f"gpushare-{sandbox.allocation_key}"]
    return dict(found)


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestSandboxesRunAsSlurmJobs:
    def test_01_every_node_comes_up_as_a_host_with_its_gpus(self, platform: Platform) -> None:
        names = [f"{platform.host}{n}" for n in ("n1", "n2", "n3")]
        wait_for(
            lambda: Host.objects.filter(name__in=names, state="up", driver="slurm").count() == 3,
            60,
            lambda: "the Slurm nodes to come up\n" + platform.logs(),
        )
        assert Gpu.objects.filter(host__name__in=names).count() == 12
        assert set(Gpu.objects.filter(host__name=names[0]).values_list("model", flat=True)) == {"H100-80GB"}

    def test_02_a_request_becomes_a_slurm_job_on_the_chosen_node(
        self, platform: Platform, cluster: SlurmCluster, world: Any, tmp_path_factory: pytest.TempPathFactory,
        state: dict[str, Any],
    ) -> None:  # fmt: skip
        home = state["home"] = tmp_path_factory.mktemp("home")
        _, key = ApiToken.issue(
            world["owner"], "laptop", ["read:usage", "write:sandboxes"], timezone.now() + timedelta(days=1)
        )
        login = gpushare(
            home, "login", f"http://127.0.0.1:{platform.port}", "--token-stdin", stdin=key + "\n"
        )
        assert login.returncode == 0, login.stderr
        started = time.monotonic()
        done = gpushare(
            home, "request", "--project", "vision", "--tier", "dedicated", "--image", "busybox",
            "--gpus", "1", "--isolation", "process", "--wait", "--timeout", "60",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr + platform.logs()
        state["request_to_running_s"] = time.monotonic() - started
        sandbox = Sandbox.objects.get(pk=int(done.stdout.strip()))
        state["sandbox"] = sandbox.pk
        assert sandbox.state == "running" and sandbox.host is not None
        job = job_of(cluster, sandbox)
        assert job["job_state"] == "RUNNING" and job["user_name"] == TENANT
        assert job["nodes"] == sandbox.host.name.removeprefix(platform.host)  # the node gpushare chose
        assert job["tres_per_node"].startswith("gres:gpu:")
        # The GPU gpushare books is the one Slurm bound (its choice, learned from the job).
        [detail] = job["gres_detail"]
        [index] = sandbox.allocations.filter(active=True).values_list("gpu__index", flat=True)
        assert detail.endswith(f"(IDX:{index})"), (detail, index)

    def test_02b_its_gpu_figures_come_from_the_nodes_monitor(
        self, platform: Platform, world: Any, state: dict[str, Any]
    ) -> None:
        """The node's monitor samples the GPU and names the job's processes; the gateway
        publishes them as the sandbox's own, and /metrics shows the GPU with its holder."""
        sandbox = Sandbox.objects.get(pk=state["sandbox"])
        [uuid] = sandbox.allocations.filter(active=True).values_list("gpu__uuid", flat=True)
        admin = Client()
        admin.force_login(world["admin"])

        def scraped() -> str:
            return admin.get("/metrics").content.decode()

        def own_memory() -> float:
            """The sandbox's own GPU memory: its job's processes', as the monitor named them."""
            mine = [
                x for x in scraped().splitlines()
                if x.startswith("gpushare_sandbox_gpu_memory_used_bytes{") and f'sandbox="{sandbox.pk}"' in x
            ]  # fmt: skip
            return float(mine[0].rsplit(" ", 1)[1]) if mine else 0.0

        wait_for(lambda: own_memory() > 0, 30, lambda: f"sandbox {sandbox.pk}'s memory\n{platform.logs()}")
        [device] = [x for x in scraped().splitlines() if x.startswith("DCGM_FI_DEV_FB_USED{") and uuid in x]
        assert f'pod="sandbox-{sandbox.pk}"' in device and float(device.rsplit(" ", 1)[1]) > 0, device

    def test_03_its_shell_says_hi(self, state: dict[str, Any]) -> None:
        done = gpushare(state["home"], "shell", str(state["sandbox"]), "-c", "echo hi")
        assert done.returncode == 0 and done.stdout == "hi\n", (done.stdout, done.stderr)

    def test_04_a_stop_cancels_the_job_and_closes_the_ledger(
        self, platform: Platform, cluster: SlurmCluster, state: dict[str, Any]
    ) -> None:
        done = gpushare(state["home"], "stop", str(state["sandbox"]))
        assert done.returncode == 0, done.stderr
        sandbox = Sandbox.objects.get(pk=state["sandbox"])
        wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state == "stopped", 30, lambda: platform.logs())
        wait_for(lambda: job_of(cluster, sandbox)["job_state"] == "CANCELLED", 30, "Slurm to cancel the job")
        records = UsageRecord.objects.filter(sandbox=sandbox)
        assert records.exists() and not records.filter(ended_at__isnull=True).exists()

    def test_05_a_batchs_output_shows_on_its_page(
        self, platform: Platform, cluster: SlurmCluster, world: Any, state: dict[str, Any]
    ) -> None:
        done = gpushare(
            state["home"], "request", "--project", "vision", "--tier", "dedicated", "--image", "busybox",
            "--gpus", "1", "--isolation", "process",
            "--command", "sh -c 'echo from-slurm-$SLURM_JOB_ID; sleep 2'", "--wait", "--timeout", "60",
        )  # fmt: skip
        # It runs two seconds: --wait sees it running (a batch that ended first exits 6).
        assert done.returncode == 0, done.stderr
        sandbox = Sandbox.objects.get(pk=int(done.stdout.strip()))
        job_id = job_of(cluster, sandbox)["job_id"]
        wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state in ("stopped", "failed"), 60, platform.logs)
        client = Client()
        client.force_login(world["owner"])
        wanted = f"from-slurm-{job_id}"
        wait_for(
            lambda: wanted in client.get(f"/sandboxes/{sandbox.pk}/output.txt").content.decode(),
            30,
            lambda: f"{wanted} on the output page\n" + platform.logs(),
        )

    @pytest.mark.parametrize(
        ("tier", "extra", "nodes", "gres"),
        [
            ("timeslice", {}, ("n1", "n2"), "shard:1"),  # shard GRES: 2 a GPU, so 2 replicas a GPU
            ("mps", {"mps_memory_gib": "8", "mps_thread_pct": "30"}, ("n3",), "mps:30"),  # n3 alone has mps
        ],
    )
    def test_05b_a_share_requested_in_the_portal_runs_on_a_node_with_its_gres(
        self, platform: Platform, cluster: SlurmCluster, world: Any,
        tier: str, extra: dict[str, str], nodes: tuple[str, ...], gres: str,
    ) -> None:  # fmt: skip
        client = Client()
        client.force_login(world["owner"])
        form = {
            "project": str(world["project"].pk), "tier": str(world[tier].pk), "image": str(world["image"].pk),
            "isolation": "process", "gpu_count": "1", "duration_hours": "1", "run": "interactive", **extra,
        }  # fmt: skip
        answer = client.post("/sandboxes/new/", form)
        assert answer.status_code == 302, answer.content.decode()[:2000]
        sandbox = Sandbox.objects.filter(owner=world["owner"], tier=world[tier]).latest("pk")
        wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state == "running", 60, lambda: platform.logs())
        sandbox.refresh_from_db()
        assert sandbox.host is not None and sandbox.host.name.removeprefix(platform.host) in nodes
        job = job_of(cluster, sandbox)
        assert job["job_state"] == "RUNNING" and job["tres_per_node"] == f"gres:{gres}"
        assert client.post(f"/sandboxes/{sandbox.pk}/stop/").status_code in (200, 302)
        wait_for(lambda: job_of(cluster, sandbox)["job_state"] == "CANCELLED", 30, "Slurm to cancel the job")

    def test_05c_a_two_node_request_runs_as_one_job_across_two_nodes(
        self, platform: Platform, cluster: SlurmCluster, world: Any, state: dict[str, Any]
    ) -> None:
        said = "echo rank=$RANK of $WORLD_SIZE meets at $MASTER_ADDR:$MASTER_PORT; sleep 2"
        done = gpushare(
            state["home"], "request", "--project", "vision", "--tier", "dedicated", "--image", "busybox",
            "--gpus", "1", "--nodes", "2", "--isolation", "process", "--command", f"sh -c '{said}'",
            "--wait", "--timeout", "60",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr + platform.logs()
        sandbox = Sandbox.objects.get(pk=int(done.stdout.strip()))
        hosts = set(sandbox.allocations.values_list("gpu__host__name", flat=True))
        assert len(hosts) == 2 and sandbox.host is not None and sandbox.host.name in hosts
        job = job_of(cluster, sandbox)
        assert expand_hostlist(job["nodes"]) == sorted(h.removeprefix(platform.host) for h in hosts)
        client = Client()
        client.force_login(world["owner"])
        # Rank 0 runs on the job's first node, Slurm's batch host, whichever host gpushare
        # lists the sandbox on (its placement's first).
        first = expand_hostlist(job["nodes"])[0]
        wanted = [f"{rank}: rank={rank} of 2 meets at {first}:" for rank in (0, 1)]
        wait_for(
            lambda: all(
                w in client.get(f"/sandboxes/{sandbox.pk}/output.txt").content.decode() for w in wanted
            ),
            30,
            lambda: "both ranks on the output page\n" + platform.logs(),
        )
        # Its end reported before the next step takes a node down (its ledger would end at the loss).
        wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state == "stopped", 30, platform.logs)

    def test_06_an_outside_job_holds_its_gpus_and_a_down_node_is_lost(
        self, platform: Platform, cluster: SlurmCluster, world: Any
    ) -> None:
        n1 = f"{platform.host}n1"
        job_id = cluster.run(
            "sbatch", "--parsable", "-w", "n1", "--gres=gpu:h100:4", "-o", "/dev/null", "--wrap", "sleep 300"
        ).strip()  # fmt: skip
        try:
            wait_for(
                lambda: (
                    Gpu.objects.filter(
                        host__name=n1, unavailable_reason__contains=f"Slurm job {job_id}"
                    ).count()
                    == 4
                ),
                30,
                lambda: "n1's GPUs to be held\n" + platform.logs(),
            )
            client = Client()
            client.force_login(world["admin"])
            assert f"held by Slurm job {job_id}" in client.get("/console/fleet/").content.decode()
            cluster.run("scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=e2e")
            wait_for(
                lambda: Host.objects.get(name=f"{platform.host}n2").state == "lost",
                30,
                lambda: platform.logs(),
            )
        finally:
            cluster.run("scancel", job_id)
            cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")
        wait_for(lambda: Host.objects.get(name=f"{platform.host}n2").state == "up", 30, "n2 back up")

    def test_07_every_jobs_accounting_agrees_with_the_ledger(
        self, platform: Platform, cluster: SlurmCluster
    ) -> None:
        """slurmdbd's elapsed time and GRES of every gpushare job, against the ledger: read here
        from both sides, and checked by the control worker, which raised no alert."""
        token = cluster.token()
        jobs = cluster.rest("GET", "/slurmdb/v0.0.38/jobs", token).json()["jobs"]
        keys = set(Sandbox.objects.values_list("allocation_key", flat=True))  # this scenario's
        ours = [j for j in jobs if j["name"].removeprefix("gpushare-") in keys]
        assert len(ours) >= 4  # the shell, the two shares, the batch
        for job in ours:
            key = job["name"].removeprefix("gpushare-")
            [interval] = UsageRecord.objects.filter(allocation_key=key)
            assert interval.ended_at is not None
            billed = (interval.ended_at - interval.started_at).total_seconds()
            assert abs(billed - job["time"]["elapsed"]) <= 1.0, (job["job_id"], billed, job["time"])
            gres = {t["name"]: t["count"] for t in job["tres"]["allocated"] if t["type"] == "gres"}
            assert set(gres) & {"gpu", "shard", "mps"}, gres
        control_log = platform.log_dir / "control.log"
        wait_for(
            lambda: control_log.read_text().count("agrees with the ledger") >= len(ours),
            60,
            lambda: "the control worker's checks\n" + platform.logs(),
        )
        assert not Alert.objects.filter(kind=Alert.Kind.ACCOUNTING).exists()
