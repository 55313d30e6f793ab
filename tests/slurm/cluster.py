"""A real Slurm cluster on loopback, for tests (issue 39): Debian's Slurm 22.05 daemons as
plain processes, each on its own port, nothing of the machine's own configuration touched.

``SlurmCluster`` starts, in a folder of its own: munged on a private socket (the packaged
key), a private MariaDB, slurmdbd on it, slurmctld, one slurmd per simulated node (``slurmd
-N <node>``, all on 127.0.0.1) and slurmrestd (JWT over TCP). Nodes' GPUs are fake: character
devices made with ``mknod`` (``/dev/null``'s numbers) that ``gres.conf`` names, so Slurm
allocates, binds and accounts ``gpu``, ``shard`` and ``mps`` GRES as it would real ones.
The recipe and its surprises are ``../shared/reviews/slurm-spike.md``'s (a feasibility run
outside the project): ``DefMemPerCPU`` or every job takes a node's whole memory;
``batch_sched_delay=0`` or every submission waits 3 s; slurmdbd reads its file beside
``SLURM_CONF`` and wants it 0600; slurmrestd refuses to run as root.

Needs root (mknod, the daemons' users) and the packages ``make setup-test`` installs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

TENANT = "nobody"  # the Unix user the tests' sandboxes run as
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "slurmrestd")
REST_VERSION = "v0.0.38"  # what slurmrestd 22.05 serves (openapi/v0.0.38, dbv0.0.38)


@dataclass(frozen=True)
class Node:
    """A simulated node: its GPUs (model, count) and which sharing GRES it offers."""

    name: str
    gpu_model: str
    gpus: int
    shards: int = 0  # time-slice replicas over its GPUs (Slurm's ``shard``)
    mps: int = 0  # MPS units over its GPUs (100 a GPU)
    cpus: int = 4
    memory_mib: int = 4000


DEFAULT_NODES = (
    Node("n1", "h100", 4, shards=8),
    Node("n2", "a100", 4, shards=8),
    Node("n3", "a100", 4, mps=400),
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def missing_tools() -> list[str]:
    needed = [
        "munged",
        "mariadbd",
        "mariadb-install-db",
        "slurmdbd",
        "slurmctld",
        "slurmd",
        "slurmrestd",
        "sbatch",
    ]
    return [tool for tool in needed if shutil.which(tool) is None]


@dataclass
class SlurmCluster:
    root: Path
    nodes: tuple[Node, ...] = DEFAULT_NODES
    name: str = "gpushare-test"
    account: str = "lab-vision"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def jwt_key(self) -> Path:
        """The cluster's JWT key (AuthAltParameters): what a gateway mints its tokens with."""
        return self.etc / "jwt_hs256.key"

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['rest']}"

    def env(self) -> dict[str, str]:
        """What a Slurm client (sbatch, sinfo, scontrol) of this cluster needs."""
        return {**os.environ, "SLURM_CONF": str(self.etc / "slurm.conf")}

    # --- start and stop -------------------------------------------------------------------

    def start(self) -> None:
        for folder in ("etc", "log", "state", "spool", "run", "dev", "mysql"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # noqa: S103 - slurmrestd (nobody) and MariaDB (mysql) read below it
        self.ports = {name: free_port() for name in ("ctld", "slurmd", "dbd", "db", "rest")}
        self.ports |= {f"node:{n.name}": free_port() for n in self.nodes}
        self._fake_devices()
        (self.etc / "jwt_hs256.key").write_bytes(secrets.token_bytes(32))
        os.chmod(self.etc / "jwt_hs256.key", 0o600)
        self._write_config()
        self._start_munge()
        self._start_mariadb()
        self._start_slurmdbd()
        self._run("sacctmgr", "-i", "add", "cluster", self.name)
        self._run("sacctmgr", "-i", "add", "account", self.account)
        self._run("sacctmgr", "-i", "add", "user", "root", f"Account={self.account}")
        # Sandboxes' jobs run as a user of their own, never root (GPUSHARE_SLURM_RUN_AS).
        self._run("sacctmgr", "-i", "add", "user", TENANT, f"Account={self.account}")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for node in self.nodes:
            (self.root / "spool" / node.name).mkdir(exist_ok=True)
            self._spawn(f"slurmd-{node.name}", ["slurmd", "-D", "-N", node.name])
        self._wait(lambda: self._idle_nodes() == len(self.nodes), 60, "every node to be idle")
        self._start_rest()

    def stop(self) -> None:
        """Every job cancelled, then every daemon, newest first (slurmrestd … munged), TERM then
        KILL, then any job step slurmd left running (a slurmstepd outlives its slurmd)."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.cancel_jobs()
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        self._kill_leftover_steps()

    def cancel_jobs(self, name_prefix: str = "", timeout: float = 30) -> None:
        """Cancel every job (those whose name starts with ``name_prefix``) and wait until
        none of them is left running: what a test that started a platform leaves behind."""
        listed = [line.split("|", 1) for line in self._run("squeue", "-h", "-o", "%i|%j").splitlines()]
        jobs = [job for job, name in listed if name.startswith(name_prefix)]
        if not jobs:
            return
        self._run("scancel", *jobs)
        self._wait(
            lambda: not set(jobs) & set(self._run("squeue", "-h", "-o", "%i").split()), timeout, "jobs to end"
        )

    def _kill_leftover_steps(self) -> None:
        """slurmstepd processes of this cluster's jobs (found by the SLURM_CONF they run
        with) and everything under them: killed, so that a test run leaves no job behind."""
        ours = f"SLURM_CONF={self.etc / 'slurm.conf'}".encode()
        doomed: list[int] = []
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                step = proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"slurmstepd")
                if step and ours in (proc / "environ").read_bytes().split(b"\0"):
                    doomed.append(int(proc.name))
        while doomed:
            pid = doomed.pop()
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    doomed += [int(c) for c in (task / "children").read_text().split()]
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def logs(self, lines: int = 40) -> str:
        """Each daemon's last lines, for a failed wait."""
        out = []
        for path in sorted(self.log.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    # --- clients --------------------------------------------------------------------------

    def run(self, *argv: str) -> str:
        """A Slurm command against this cluster; its standard output."""
        return self._run(*argv)

    def token(self, user: str = "root", lifespan_s: int = 3600) -> str:
        """A JWT for slurmrestd (``scontrol token``)."""
        out = self._run("scontrol", "token", f"username={user}", f"lifespan={lifespan_s}")
        return out.strip().removeprefix("SLURM_JWT=")

    def rest(self, method: str, path: str, token: str, **kwargs: Any) -> requests.Response:
        headers = {"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": token}
        return requests.request(method, f"{self.rest_url}{path}", headers=headers, timeout=10, **kwargs)

    # --- parts ----------------------------------------------------------------------------

    def _fake_devices(self) -> None:
        index = 0
        for node in self.nodes:
            for _ in range(node.gpus):
                device = self.root / "dev" / f"nvidia{index}"
                if not device.exists():
                    os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))  # S_IFCHR, /dev/null's numbers
                index += 1

    def _device_range(self, first: int, count: int) -> str:
        return str(
            self.root / "dev" / (f"nvidia[{first}-{first + count - 1}]" if count > 1 else f"nvidia{first}")
        )

    def _write_config(self) -> None:
        host = socket.gethostname()
        node_lines, gres_lines, first = [], ["AutoDetect=off"], 0
        for node in self.nodes:
            gres = [f"gpu:{node.gpu_model}:{node.gpus}"]
            gres += [f"shard:{node.shards}"] if node.shards else []
            gres += [f"mps:{node.mps}"] if node.mps else []
            node_lines.append(
                f"NodeName={node.name} NodeHostname={host} NodeAddr=127.0.0.1 "
                f"Port={self.ports[f'node:{node.name}']} CPUs={node.cpus} RealMemory={node.memory_mib} "
                f"Gres={','.join(gres)} State=UNKNOWN"
            )
            devices = self._device_range(first, node.gpus)
            gres_lines.append(f"NodeName={node.name} Name=gpu Type={node.gpu_model} File={devices}")
            if node.shards:
                gres_lines.append(f"NodeName={node.name} Name=shard Count={node.shards}")
            if node.mps:
                gres_lines.append(f"NodeName={node.name} Name=mps Count={node.mps} File={devices}")
            first += node.gpus
        munge = f"socket={self.root / 'run' / 'munge.sock'}"
        jwt = f"jwt_key={self.etc / 'jwt_hs256.key'}"
        nodes = ",".join(n.name for n in self.nodes)
        slurm_conf = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            f"SlurmctldPort={self.ports['ctld']}",
            f"SlurmdPort={self.ports['slurmd']}",
            "AuthType=auth/munge",
            f"AuthInfo={munge}",
            "AuthAltTypes=auth/jwt",
            f"AuthAltParameters={jwt}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            "DefMemPerCPU=500",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "GresTypes=gpu,shard,mps",
            "JobAcctGatherType=jobacct_gather/linux",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.ports['dbd']}",
            # The munge socket for talking to slurmdbd (AuthInfo covers the rest).
            f"AccountingStoragePass={self.root / 'run' / 'munge.sock'}",
            "AccountingStorageTRES=gres/gpu,gres/shard,gres/mps",
            "JobCompType=jobcomp/none",
            "KillWait=5",
            "SlurmdParameters=config_overrides",
            *node_lines,
            f"PartitionName=gpu Nodes={nodes} Default=YES MaxTime=INFINITE State=UP",
        ]
        (self.etc / "slurm.conf").write_text("\n".join(slurm_conf) + "\n")
        (self.etc / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        self.db_password = secrets.token_urlsafe(16)
        dbd = [
            "AuthType=auth/munge",
            f"AuthInfo={munge}",
            "AuthAltTypes=auth/jwt",
            f"AuthAltParameters={jwt}",
            "DbdAddr=127.0.0.1",
            f"DbdPort={self.ports['dbd']}",
            "SlurmUser=root",
            f"LogFile={self.log / 'slurmdbd.log'}",
            f"PidFile={self.root / 'run' / 'slurmdbd.pid'}",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={self.ports['db']}",
            "StorageUser=slurm",
            f"StoragePass={self.db_password}",
            "StorageLoc=slurm_acct_db",
        ]
        dbd_path = self.etc / "slurmdbd.conf"
        dbd_path.write_text("\n".join(dbd) + "\n")
        os.chmod(dbd_path, 0o600)

    def _start_munge(self) -> None:
        sock = self.root / "run" / "munge.sock"
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force", f"--socket={sock}", "--key-file=/etc/munge/munge.key",
                f"--pid-file={self.root / 'run' / 'munged.pid'}",
                f"--seed-file={self.root / 'run' / 'munged.seed'}",
                f"--log-file={self.log / 'munged.log'}",
            ],
        )  # fmt: skip
        self._wait(sock.exists, 15, "munged's socket")

    def _start_mariadb(self) -> None:
        data = self.root / "mysql" / "data"
        shutil.chown(self.root / "mysql", "mysql", "mysql")
        sock = self.root / "mysql" / "mysqld.sock"
        if not data.exists():
            made = subprocess.run(
                ["mariadb-install-db", "--user=mysql", f"--datadir={data}",
                 "--auth-root-authentication-method=socket", "--skip-test-db"],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            if made.returncode != 0:
                raise RuntimeError(
                    f"mariadb-install-db: exit {made.returncode}: {made.stderr or made.stdout}"
                )
        self._spawn(
            "mariadbd",
            [
                "mariadbd", "--no-defaults", "--user=mysql", f"--datadir={data}", f"--socket={sock}",
                f"--port={self.ports['db']}", "--bind-address=127.0.0.1", "--skip-name-resolve",
                f"--pid-file={self.root / 'mysql' / 'mariadbd.pid'}", "--innodb-buffer-pool-size=64M",
                f"--log-error={self.log / 'mariadbd.log'}",
            ],
        )  # fmt: skip
        self._wait(sock.exists, 60, "MariaDB's socket")
        grant = (
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{self.db_password}';"
            "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
        )
        self._wait(
            lambda: (
                subprocess.run(
                    ["mariadb", f"--socket={sock}", "-u", "root", "-e", grant], capture_output=True
                ).returncode
                == 0
            ),
            30,
            "MariaDB to take the slurm user",
        )

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait(lambda: subprocess.run(["sacctmgr", "-n", "list", "cluster"], env=self.env(),
                                          capture_output=True).returncode == 0, 60, "slurmdbd")  # fmt: skip

    def _start_rest(self) -> None:
        address = f"127.0.0.1:{self.ports['rest']}"
        argv = [
            "slurmrestd",
            "-u",
            "nobody",
            "-a",
            "rest_auth/jwt",
            "-s",
            f"openapi/{REST_VERSION},openapi/db{REST_VERSION}",
            address,
        ]
        self._spawn("slurmrestd", argv, SLURM_JWT="daemon")
        token = self.token()
        self._wait(lambda: self._pings(token), 30, "slurmrestd")

    def _pings(self, token: str) -> bool:
        try:
            return self.rest("GET", f"/slurm/{REST_VERSION}/ping", token).status_code == 200
        except requests.RequestException:
            return False

    def _idle_nodes(self) -> int:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True, text=True
        )
        return sum(1 for line in done.stdout.splitlines() if line.split()[-1:] == ["idle"])

    def _spawn(self, name: str, argv: list[str], **extra: str) -> None:
        out = (self.log / f"{name}.out").open("ab")
        self.procs[name] = subprocess.Popen(
            argv, env={**self.env(), **extra}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _run(self, *argv: str) -> str:
        done = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
            )
        return done.stdout

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}\n{self.logs()}"
                    )
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")


@contextlib.contextmanager
def running_cluster(nodes: tuple[Node, ...] = DEFAULT_NODES) -> Iterator[SlurmCluster]:
    """A cluster in a fresh folder under /tmp, removed after: not pytest's tmp_path, which is
    root's alone (0700), where MariaDB (as mysql) and slurmrestd (as nobody) cannot reach."""
    root = Path(tempfile.mkdtemp(prefix="gpushare-slurm-"))
    cluster = SlurmCluster(root, nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
