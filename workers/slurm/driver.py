"""A sandbox as a Slurm job on the node gpushare's cycle chose (issue 39).

launch = a batch job pinned to the node (``--nodelist``), with the GRES of the placement
(whole GPUs of the node's model, ``shard`` for a time-slice replica, ``mps`` for an MPS
share), the tier's CPUs and memory, the project's Slurm account, run as the owner's user
(``GPUSHARE_SLURM_RUN_AS``), named ``gpushare-<allocation key>`` so that ``list_owned`` and
reconcile find it again after any restart; stop = cancel; the preemption warning = SIGTERM
to the job; batch output = the job's output file; the terminal = a pty on
``srun --jobid … --overlap --pty``, as the job's user.

Submission goes through ``sbatch``: slurmrestd 22.05 (API v0.0.38) refuses a node list in a
submitted job ("Disabled key: required_nodes"), and gpushare, not Slurm, chooses the node.
Everything else (the job's state, the node's, cancel, signal) goes through slurmrestd.
Slurm binds the devices itself: which of the node's GPUs a job got is learned from the job
(``SlurmJob.gpu_indices``), not told to it.
"""

from __future__ import annotations

import contextlib
import math
import os
import pwd
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from wire.relay import Terminal
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers.base import DriverError, SandboxStatus
from workers.drivers.output import OutputChunk
from workers.drivers.process_terminal import ProcessTerminal
from workers.slurm.gpus import gpu_uuid, host_of
from workers.slurm.model import COMMENT_PREFIX, JOB_NAME_PREFIX, SlurmJob
from workers.slurm.rest import SlurmError, SlurmRest
from workers.slurm.settings import SlurmSettings
from workers.slurm.view import ClusterView

SUBMIT_TIMEOUT_S = 30.0
# What an allocation key may be here (the portal makes uuid4 hex): it names a file.
ALLOCATION_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
FORGET_STOP_S = 3600.0
STATE_POLL_S = 0.05
# How a job that ended looks to the platform: its exit (Slurm's own words for the rest).
ENDED_REASONS = {
    "CANCELLED": "cancelled", "TIMEOUT": "reached its Slurm time limit",
    "OUT_OF_MEMORY": "out of memory", "NODE_FAIL": "its Slurm node failed",
    "PREEMPTED": "preempted by Slurm", "BOOT_FAIL": "its node did not boot",
    "DEADLINE": "reached its deadline", "FAILED": "failed",
}  # fmt: skip


def gres_request(spec: SandboxSpec, gpu_model: str, shards_per_gpu: int, nodes: int = 1) -> str:
    """The ``--gres`` of a placement, per node: ``gpu:<model>:<n>`` for whole GPUs (a gang's
    are spread evenly over its ``nodes``), ``shard:<n>`` for a time-slice replica (the GPU's
    shards over its replicas), ``mps:<threads %>`` for an MPS share; "" for a CPU-only one."""
    if not spec.device_uuids:
        return ""
    if spec.mps is not None:
        return f"mps:{spec.mps.thread_pct}"
    share = spec.memory_share
    if share is not None and share.kind == "timeslice":
        if not shards_per_gpu:
            raise DriverError("this Slurm node offers no shard GRES, so no time-slice replica of its GPUs")
        return f"shard:{max(1, shards_per_gpu // max(1, share.replicas))}"
    typed = f"gpu:{gpu_model}" if gpu_model else "gpu"
    return f"{typed}:{len(spec.device_uuids) // nodes}"


def job_script(spec: SandboxSpec, nodes: int = 1) -> str:
    """The batch script: the sandbox's command, run by exec so that Slurm's signals reach it.
    Across several nodes, one task a node (``srun``), each told its rank and where to meet:
    ``MASTER_ADDR`` (the first node) and ``MASTER_PORT`` (one per job), ``WORLD_SIZE``,
    ``RANK``, ``NODE_RANK`` and ``LOCAL_RANK``, as torchrun and most launchers read them."""
    command = spec.command or ("sleep", "infinity")
    lines = [
        "#!/bin/sh",
        'export PATH="${PATH:-/usr/local/bin:/usr/bin:/bin}"',  # none when the user's login env is not loaded
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())),
    ]
    if nodes <= 1:
        return "\n".join([*lines, f"exec {shlex.join(command)}", ""])
    rank = (
        'export RANK="$SLURM_PROCID" NODE_RANK="$SLURM_NODEID" LOCAL_RANK="$SLURM_LOCALID" '
        'WORLD_SIZE="$SLURM_NTASKS"; exec "$@"'
    )
    return "\n".join(
        [
            *lines,
            'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            'MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"',
            "export MASTER_ADDR MASTER_PORT",
            # --export=ALL: the job was submitted with NONE, which its steps inherit otherwise.
            f"exec srun --export=ALL --label --kill-on-bad-exit=1 --ntasks-per-node=1 /bin/sh -c "
            f"{shlex.quote(rank)} gpushare-rank {shlex.join(command)}",
            "",
        ]
    )


class SlurmDriver:
    """The sandboxes of one Slurm node (``node``; ``host`` is gpushare's name for it)."""

    name = "slurm"

    def __init__(
        self,
        host: str,
        node: str,
        settings: SlurmSettings,
        rest: SlurmRest,
        view: ClusterView,
        sbatch: Callable[[list[str], str], str] | None = None,
    ) -> None:
        self.host = host
        self.node = node
        self.settings = settings
        self.rest = rest
        self.view = view
        self._sbatch = sbatch or run_sbatch
        self._submitted: dict[str, int] = {}  # allocation key -> job id, until the view lists it
        # Stopped here: their ended jobs are no longer listed (as a stopped container is gone).
        # Allocation key -> when; forgotten once slurmctld has forgotten the job as well.
        self._stopped: dict[str, float] = {}
        self._ended_ms: dict[str, int] = {}  # allocation key -> its job's end, seen by ``stop``

    @property
    def storage_dir(self) -> Path | None:
        return None  # storage on a Slurm cluster is its file systems', not gpushare's

    def prepare(self, spec: SandboxSpec, report: Callable[[str], None]) -> None:
        return None

    # --- launch -------------------------------------------------------------------------

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        job_id = self._existing(spec.allocation_key)
        if job_id is None:
            job_id = self._submit(spec)
            self._submitted[spec.allocation_key] = job_id
        job = self._wait_running(job_id)
        if job.state != "RUNNING":
            self._cancel_quietly(job_id)
            raise DriverError(
                f"Slurm did not start job {job_id} on {self.node} within {self.settings.start_wait_s:.0f} s "
                f"({job.state}: {job.reason}); cancelled"
            )
        return SandboxHandle(self.name, spec.allocation_key, spec.sandbox_id, str(job_id), self.granted(job))

    def granted(self, job: SlurmJob) -> tuple[str, ...]:
        """The GPUs Slurm bound to ``job`` (any part of them), as gpushare names them."""
        prefix = self.host.removesuffix(self.node)
        return tuple(
            gpu_uuid(f"{prefix}{node}", index) for node in job.nodes for index in job.gpu_indices(node)
        )

    def _existing(self, allocation_key: str) -> int | None:
        if allocation_key in self._submitted:
            return self._submitted[allocation_key]
        job = self.view.job_for(allocation_key)
        return job.job_id if job is not None else None

    def _submit(self, spec: SandboxSpec) -> int:
        node = self.view.node(self.node)
        if node is None:
            raise DriverError(f"Slurm lists no node {self.node}")
        user = self.settings.user_for(spec.owner)
        try:
            account = pwd.getpwnam(user)
        except KeyError:
            raise DriverError(
                f"no Unix user {user!r} on the gateway to run the job as (GPUSHARE_SLURM_RUN_AS)"
            ) from None
        nodes = self._nodes(spec)
        output = self._output_file(spec.allocation_key, account.pw_uid, account.pw_gid)
        workdir = account.pw_dir if os.path.isdir(account.pw_dir) else "/tmp"  # noqa: S108 - a user without a home
        options = [
            f"--job-name={JOB_NAME_PREFIX}{spec.allocation_key}",
            # The node whose host the sandbox is on leads: a gang's job is that host's alone.
            f"--comment={COMMENT_PREFIX} {self.node} sandbox {spec.sandbox_id} of {spec.owner} in "
            f"{spec.project}",
            f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}", "--ntasks-per-node=1",
            f"--cpus-per-task={max(1, math.ceil(spec.cpu_limit))}",
            f"--mem={spec.memory_limit_mib}M",
            f"--account={self.settings.account_for(spec.project)}",
            f"--uid={account.pw_uid}", f"--gid={account.pw_gid}",
            f"--output={output}", "--open-mode=append", f"--chdir={workdir}",
            "--export=NONE", "--no-requeue",
        ]  # fmt: skip
        shards_per_gpu = node.shards // node.gpus if node.gpus else 0
        gres = gres_request(spec, node.gpu_model, shards_per_gpu, len(nodes))
        if gres:
            options.append(f"--gres={gres}")
        if self.settings.partition:
            options.append(f"--partition={self.settings.partition}")
        said = self._sbatch(options, job_script(spec, len(nodes)))
        try:
            return int(said.strip().split(";")[0])
        except ValueError:
            raise DriverError(f"sbatch answered {said!r}, not a job id") from None

    def _nodes(self, spec: SandboxSpec) -> list[str]:
        """The Slurm nodes of the placement, this one first (the batch script's): a gang's GPUs
        are on several hosts of this gateway, each ``<prefix><node>``."""
        prefix = self.host.removesuffix(self.node)
        try:
            hosts = {host_of(uuid) for uuid in spec.device_uuids} - {self.host}
        except ValueError as exc:
            raise DriverError(f"the placement names a GPU that is no Slurm node's: {exc}") from None
        strangers = sorted(h for h in hosts if not h.startswith(prefix))
        if strangers:
            raise DriverError(
                f"the placement spans hosts this Slurm gateway does not serve: {', '.join(strangers)}"
            )
        return [self.node, *sorted(h.removeprefix(prefix) for h in hosts)]

    def _output_file(self, allocation_key: str, uid: int, gid: int) -> Path:
        """The job's output file, made here before the job exists, owned by the job's user in
        a folder only the gateway writes: the job appends to it, and cannot swap it for a
        link to a file of the gateway's (which reads it as root)."""
        folder = self.settings.output_dir
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)
        path = self._output_path(allocation_key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DriverError(f"cannot make the job's output file {path}: {exc.strerror}") from exc
        try:
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
        return path

    def _output_path(self, allocation_key: str) -> Path:
        """A job's output file in the output folder; an allocation key that could name
        anything else (a ``/``, ``..``) is refused: it comes from a message, and the gateway
        writes and reads the file as root."""
        if not ALLOCATION_KEY.fullmatch(allocation_key):
            raise DriverError(f"allocation key {allocation_key[:80]!r} is not one gpushare makes")
        return self.settings.output_dir / f"{allocation_key}.out"

    def _wait_running(self, job_id: int) -> SlurmJob:
        deadline = time.monotonic() + self.settings.start_wait_s
        while True:
            job = self._job(job_id)
            if job.state not in ("PENDING", "CONFIGURING") or time.monotonic() > deadline:
                return job
            time.sleep(STATE_POLL_S)

    # --- the rest of the seam -----------------------------------------------------------

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        """As of the gateway's last read for a job it listed then (every report asks this of
        every job: a request each would grow with the cluster), else asked now."""
        job_id = int(handle.ref)
        job = self.view.job(job_id)
        key = handle.allocation_key
        if job is None or key in self._submitted or key in self._stopped:
            try:
                job = self.rest.job(job_id)
            except SlurmError as exc:
                raise DriverError(str(exc)) from exc
        if job is None:
            return SandboxStatus("missing")
        started = job.start_s * 1000 if job.start_s else None
        if job.state in ("PENDING", "CONFIGURING"):
            return SandboxStatus("created")
        if job.active:
            return SandboxStatus("running", started_at_ms=started)
        reason = ENDED_REASONS.get(job.state, job.state.lower())
        ended = job.end_s * 1000 if job.end_s else None
        return SandboxStatus(
            "exited", exit_code=job.exit_code, started_at_ms=started, reason=reason, ended_at_ms=ended
        )

    def ended_at_ms(self, handle: SandboxHandle) -> int | None:
        """Slurm's end time of a job ``stop`` saw end (what slurmdbd accounts); None when it did
        not see one."""
        return self._ended_ms.pop(handle.allocation_key, None)

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        """Cancel the job (SIGTERM, then SIGKILL after the cluster's KillWait) and wait for it
        to end, at most ``grace_s`` and the KillWait beyond."""
        job_id = int(handle.ref)
        self._submitted.pop(handle.allocation_key, None)
        self._stopped[handle.allocation_key] = time.monotonic()
        try:
            self.rest.cancel(job_id)
        except SlurmError as exc:
            raise DriverError(str(exc)) from exc
        deadline = time.monotonic() + grace_s + 30
        while time.monotonic() < deadline:
            job = self.rest.job(job_id)
            if job is None or not job.active:
                if job is not None and job.end_s:  # for the stop's report (ended_at_ms)
                    self._ended_ms[handle.allocation_key] = job.end_s * 1000
                return
            time.sleep(0.2)

    def warn(self, handle: SandboxHandle) -> str:
        try:
            self.rest.signal(int(handle.ref), "SIGTERM")
        except SlurmError as exc:
            raise DriverError(str(exc)) from exc
        return f"sent SIGTERM to Slurm job {handle.ref}"

    def list_owned(self) -> list[SandboxHandle]:
        """gpushare's jobs on this node as of the gateway's last read (its newest for each
        allocation), and those submitted since. An ended job stays listed, with its exit, until
        it is stopped (as an exited container is, until it is removed) or slurmctld forgets
        it (MinJobAge): reconcile learns how a batch ended from it."""
        found: dict[str, SandboxHandle] = {}
        on_node = self.view.jobs_on(self.node)
        self._forget_stops({j.allocation_key for j in on_node if j.allocation_key is not None})
        for job in sorted(on_node, key=lambda j: j.job_id):
            key = job.allocation_key
            if job.lead_node not in ("", self.node):
                continue  # a gang's, on its lead node's host
            if key is not None and (job.active or key not in self._stopped):
                found[key] = SandboxHandle(self.name, key, 0, str(job.job_id))
        for key, job_id in list(self._submitted.items()):
            listed = found.get(key)
            if listed is not None and int(listed.ref) == job_id:
                self._submitted.pop(key, None)  # the view lists it now, and answers for it
            else:
                found[key] = SandboxHandle(self.name, key, 0, str(job_id))
        return list(found.values())

    def _forget_stops(self, listed: set[str]) -> None:
        """Stops of jobs slurmctld no longer lists (MinJobAge), kept a while in case the
        stopped job is not listed yet, so the record does not grow with every sandbox."""
        cutoff = time.monotonic() - FORGET_STOP_S
        for key, when in list(self._stopped.items()):
            if when < cutoff and key not in listed:
                del self._stopped[key]

    def exec_terminal(self, handle: SandboxHandle) -> Terminal:
        job = self._job(int(handle.ref))
        if job.state != "RUNNING":
            raise DriverError(f"Slurm job {handle.ref} is {job.state.lower()}, not running")
        argv = ["runuser", "-u", job.user, "--", "srun", f"--jobid={job.job_id}", "--overlap", "--pty",
                "/bin/sh", "-l"]  # fmt: skip
        # A session of its own: the pty's hang-up reaches srun, which ends the step.
        return ProcessTerminal.spawn(argv, f"Slurm job {job.job_id}", start_new_session=True)

    def open_app(self, handle: SandboxHandle) -> Terminal:
        raise DriverError("web apps are not served from Slurm jobs")

    def open_ssh(self, handle: SandboxHandle, authorized_keys: list[str]) -> Terminal:
        raise DriverError("SSH through the portal does not reach Slurm jobs: use their terminal")

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        path = self._output_path(handle.allocation_key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return OutputChunk(start=offset, data=b"", total=offset)
        except OSError as exc:
            raise DriverError(f"cannot read the job's output {path}: {exc.strerror}") from exc
        with os.fdopen(fd, "rb") as out:
            total = os.fstat(out.fileno()).st_size
            out.seek(min(offset, total))
            data = out.read(limit) if offset < total else b""
        return OutputChunk(start=min(offset, total), data=data, total=total)

    # --- helpers ------------------------------------------------------------------------

    def _job(self, job_id: int) -> SlurmJob:
        try:
            job = self.rest.job(job_id)
        except SlurmError as exc:
            raise DriverError(str(exc)) from exc
        if job is None:
            raise DriverError(f"Slurm no longer knows job {job_id}")
        return job

    def _cancel_quietly(self, job_id: int) -> None:
        with contextlib.suppress(SlurmError):
            self.rest.cancel(job_id)


def run_sbatch(options: list[str], script: str) -> str:
    """``sbatch --parsable`` with the script on its standard input; its answer (the job id)."""
    try:
        done = subprocess.run(  # noqa: S603
            ["sbatch", "--parsable", *options], input=script, capture_output=True, text=True,  # noqa: S607
            timeout=SUBMIT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DriverError(f"sbatch: {exc}") from exc
    if done.returncode != 0:
        raise DriverError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout
