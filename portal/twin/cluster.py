"""The twin's control plane and fleet as processes: a control worker, celery beat, and one
agent process serving every simulated host of the trace (``workers.host.agent_pool``), each
with its log under the run's folder. Production runs these as separate services; here
they share the machine with the twin that drives them.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from portal.fleet.credentials import Enrolment
from portal.launcher import AGENT_WORKER_FLAGS, celery_command
from scheduler.research.trace import NodeSpec

# The twin's telemetry rate (0.2 Hz): 6,212 simulated GPUs sampled every second would be
# most of this machine's CPU, for figures nobody reads at that rate.
SAMPLE_INTERVAL_MS = 5000
# Full reports once a minute; a changed one goes at once (BENCHMARKS.md, heartbeats).
FULL_REPORT_S = 60


def write_hosts_file(nodes: list[NodeSpec], path: Path) -> None:
    """The agent pool's hosts file (``name,gpus,cpus,memory_gib``) for the trace's nodes."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["name", "gpus", "cpus", "memory_gib"])
        for node in nodes:
            gpus = f"{node.model}:{node.gpus}" if node.gpus else ""
            writer.writerow([node.name, gpus, node.cpu_milli // 1000, node.memory_mib / 1024])


@dataclass
class Services:
    """The processes the twin started; ``stop`` ends them (SIGTERM, then SIGKILL)."""

    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, hosts_file: Path, pool: tuple[str, Enrolment], control_threads: int = 4) -> None:
        """``pool``: the agent pool's name prefix and what it was enrolled with (``manage.py
        host_credential issue --pool``): its Redis user and signing key."""
        self.logs.mkdir(parents=True, exist_ok=True)
        var = self.logs.parent / "var"
        var.mkdir(exist_ok=True)
        base = {
            **os.environ,
            "GPUSHARE_VAR_DIR": str(var),
            "LOG_LEVEL": os.environ.get("LOG_LEVEL", "warning"),
        }
        control = [
            "worker",
            "-Q",
            "control",
            "-n",
            "control@twin",
            "-P",
            "threads",
            "-c",
            str(control_threads),
        ]
        self._spawn("control", celery_command(*control), {**base, "GPUSHARE_ROLE": "control"})
        self._spawn(
            "beat",
            celery_command("beat", "-s", str(var / "celerybeat-schedule")),
            {**base, "GPUSHARE_ROLE": "beat"},
        )
        self._spawn(
            "agents",
            celery_command("worker", "-n", "pool@twin", "-P", "threads", "-c", "8", *AGENT_WORKER_FLAGS),
            {
                **base, "GPUSHARE_ROLE": "agent", "GPUSHARE_HOSTS_FILE": str(hosts_file),
                "SAMPLE_INTERVAL_MS": str(SAMPLE_INTERVAL_MS), "AGENT_FULL_REPORT_S": str(FULL_REPORT_S),
                "GPUSHARE_POOL_PREFIX": pool[0], **pool[1].env(),
            },
        )  # fmt: skip

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(  # noqa: S603 - our own argv, no shell
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def dead(self) -> list[str]:
        """Those that exited, with their code."""
        return [f"{name} (exit {p.returncode})" for name, p in self.procs.items() if p.poll() is not None]

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
