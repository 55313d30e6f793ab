"""Hosts, their GPUs and MIG instances, as the agents report them."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from wire import broker_acl


class GpuMode(models.TextChoices):
    """How a GPU is shared. Not a tier's ``SharingMode`` (what a request asks for): only a
    GPU follows demand. A non-MIG GPU follows demand unless an admin pins it; a GPU in MIG
    mode is shared by MIG slices, which only a GPU reset changes (re-layout plans reshape
    the slices). The values are the scheduler's (``scheduler.cluster``)."""

    AUTO = "auto", "Follows demand"  # idle, it takes a dedicated, MPS or time-slice placement
    DEDICATED = "dedicated", "Pinned: dedicated"
    MPS = "mps", "Pinned: MPS"
    TIMESLICE = "timeslice", "Pinned: time-slice"
    MIG = "mig", "MIG"


# What an admin may set on a non-MIG GPU.
SETTABLE_MODES = (GpuMode.AUTO, GpuMode.DEDICATED, GpuMode.MPS, GpuMode.TIMESLICE)
# GPU backends whose GPUs are not real: simulated ones, and a test Slurm cluster's GRES on fake
# device files (workers.slurm.gpus). SLURM_BACKENDS: the nodes of a Slurm cluster's gateway.
SIMULATED_BACKENDS = ("simulated", "slurm-sim")
SLURM_BACKENDS = ("slurm", "slurm-sim")
# What an engine in front of its hosts (Slurm) may offer of a GPU (Gpu.engine_modes).
ENGINE_MODES = (GpuMode.DEDICATED.value, GpuMode.MPS.value, GpuMode.TIMESLICE.value)
TIMESLICE_REPLICAS = 4  # a time-sliced GPU's replicas until an admin (or its engine) says otherwise


class Host(models.Model):
    class State(models.TextChoices):
        UP = "up", "Up"
        LOST = "lost", "Lost"  # missed heartbeats
        DRAINING = "draining", "Draining"

    name = models.SlugField(max_length=63, unique=True)  # also its Celery queue: host.<name>
    backend = models.CharField(max_length=16, help_text="GPU backend the agent runs: nvml or simulated.")
    driver = models.CharField(max_length=16, blank=True, help_text="Sandbox driver: docker or process.")
    state = models.CharField(max_length=16, choices=State.choices, default=State.UP)
    cpu_cores = models.PositiveIntegerField(default=0)
    memory_mib = models.PositiveIntegerField(default=0)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def simulated(self) -> bool:
        return self.backend in SIMULATED_BACKENDS

    @property
    def slurm_node(self) -> bool:
        """A Slurm node: its figures come from the monitor on the node (docs/slurm.md)."""
        return self.backend in SLURM_BACKENDS

    @property
    def simulated_sandboxes(self) -> bool:
        """Its agent's driver keeps state only: its sandboxes run nothing (the cluster twin)."""
        return self.driver == "simulated"

    @property
    def queue(self) -> str:
        return f"host.{self.name}"


class Gpu(models.Model):
    class State(models.TextChoices):
        AVAILABLE = "available", "Available"
        DRAINED = "drained", "Drained"
        # host lost, GPU vanished, or its agent sees it but cannot offer it (not_ready)
        UNAVAILABLE = "unavailable", "Unavailable"

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=100)
    model = models.CharField(max_length=40, blank=True)
    memory_mib = models.PositiveIntegerField()
    mig_enabled = models.BooleanField(default=False)
    # Following demand, pinned by an admin, or MIG (see GpuMode); agents' new GPUs follow demand.
    sharing_mode = models.CharField(max_length=16, choices=GpuMode.choices, default=GpuMode.AUTO)
    # Replicas it offers when time-sliced: pinned to time-slice, or following demand into it.
    timeslice_replicas = models.PositiveSmallIntegerField(default=TIMESLICE_REPLICAS)
    # The sharing modes the engine that binds it offers (a Slurm node's GRES: "dedicated",
    # "mps", "timeslice"); empty when its agent hands it out itself, in every mode.
    engine_modes = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.AVAILABLE)
    drain_reason = models.CharField(max_length=200, blank=True)
    # Why it is unavailable ("host … lost", "its agent no longer sees it", or the agent's
    # reason, e.g. "NVLink fabric not ready: …"); empty in any other state. Unlike a drain,
    # unavailability ends by itself when the agent offers the GPU again.
    unavailable_reason = models.CharField(max_length=200, blank=True)
    # Where it sits on its host, as its agent reads it (scheduler.topology): the NUMA node of
    # its nearest CPUs, and its link to each other GPU of the host by that GPU's index
    # ({"1": "nvlink", "4": "system"}). Null and {}: not known (an agent from before, a
    # VM's GPUs), which makes no preference among the host's GPUs.
    numa_node = models.PositiveSmallIntegerField(null=True, blank=True)
    links = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["host__name", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["host", "index"],
                name="%(app_label)s_%(class)s_one_per_host_index",
                violation_error_message="A host has one GPU per index.",
            ),
            models.CheckConstraint(
                condition=~models.Q(mig_enabled=True) | models.Q(sharing_mode=GpuMode.MIG),
                name="%(app_label)s_%(class)s_mig_gpus_share_by_mig",
                violation_error_message="A GPU in MIG mode is shared by MIG slices.",
            ),
            models.CheckConstraint(
                condition=models.Q(mig_enabled=True) | ~models.Q(sharing_mode=GpuMode.MIG),
                name="%(app_label)s_%(class)s_only_mig_gpus_share_by_mig",
                violation_error_message="A GPU not in MIG mode cannot be shared by MIG slices.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.host.name}/gpu{self.index} ({self.model or self.name})"


class MigInstance(models.Model):
    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="mig_instances")
    uuid = models.CharField(max_length=64, unique=True)
    profile = models.CharField(max_length=16)
    start = models.PositiveSmallIntegerField()
    memory_slices = models.PositiveSmallIntegerField()
    memory_mib = models.PositiveIntegerField()
    gpu_instance_id = models.PositiveSmallIntegerField()
    compute_instance_id = models.PositiveSmallIntegerField()

    class Meta:
        ordering = ["gpu", "start"]
        constraints = [
            models.UniqueConstraint(
                fields=["gpu", "start"],
                name="%(app_label)s_%(class)s_one_per_start",
                violation_error_message="Two MIG instances cannot start at the same slice.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.profile}@{self.start} on {self.gpu}"


class FleetEvent(models.Model):
    """Something that happened to a host or GPU (``portal.fleet.actions`` writes one per state
    change): lost, regained, a drain, an undrain, a fault.

    A fault's drain is an ``info`` event: the fault's alert is the agent's
    (``portal.telemetry.models.Alert``). ``alert`` severity is on rows written before.
    """

    class Severity(models.TextChoices):
        INFO = "info", "Info"
        ALERT = "alert", "Alert"

    at = models.DateTimeField(default=timezone.now)
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="events")
    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, null=True, blank=True, related_name="events")
    # host_lost, host_regained, drained, undrained, unavailable, available, mode, or a fault:
    # xid, app_xid, ecc_dbe, gpu_lost, overheat, remap_failed, remap_pending, retirement_pending
    kind = models.CharField(max_length=32)
    severity = models.CharField(max_length=8, choices=Severity.choices, default=Severity.INFO)
    message = models.CharField(max_length=300)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    acknowledged_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["severity", "acknowledged_at"], name="fleetevent_open_alerts_idx")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.kind}: {self.message}"


class FleetPlan(models.Model):
    """A defragmentation plan being carried out: a MIG re-layout of one host's GPUs, or
    shared-GPU consolidation (MPS shares and time-slice replicas moved off the emptiest GPUs).

    ``plan`` holds what the scheduler planned, as JSON, plus the GPUs it touches: while the
    plan runs those take no new placements, so nothing lands on a slot the plan is about to
    destroy or fill. Every step taken is a ``PlanStep``.
    """

    class Kind(models.TextChoices):
        MIG_RELAYOUT = "mig_relayout", "MIG re-layout"
        CONSOLIDATION = "consolidation", "Shared-GPU consolidation"

    class State(models.TextChoices):
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    state = models.CharField(max_length=8, choices=State.choices, default=State.RUNNING)
    purpose = models.CharField(max_length=200)
    plan = models.JSONField(default=dict)
    touched_gpus = models.JSONField(default=list)  # GPU uuids that take no placement meanwhile
    hosts_pending = models.JSONField(default=list)  # hosts whose agents have not reported yet
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["state"], name="fleetplan_running_idx", condition=models.Q(state="running"))
        ]

    def __str__(self) -> str:
        return f"plan {self.pk}: {self.get_kind_display()} ({self.state})"


def running_plan_gpus() -> set[str]:
    """GPUs touched by a plan still running: the scheduling cycle places nothing on them."""
    touched: set[str] = set()
    for gpus in FleetPlan.objects.filter(state=FleetPlan.State.RUNNING).values_list(
        "touched_gpus", flat=True
    ):
        touched.update(gpus)
    return touched


class PlanStep(models.Model):
    """One thing a plan did, in order: planned, checkpoint, stop, destroy, create, keep,
    relaunch, requeue, left running, done, failed."""

    plan = models.ForeignKey(FleetPlan, on_delete=models.CASCADE, related_name="steps")
    at = models.DateTimeField(default=timezone.now)
    action = models.CharField(max_length=16)
    ok = models.BooleanField(default=True)
    host = models.CharField(max_length=63, blank=True)
    gpu_uuid = models.CharField(max_length=64, blank=True)
    device_uuid = models.CharField(max_length=64, blank=True)  # the MIG instance or GPU acted on
    sandbox = models.ForeignKey(
        "sandboxes.Sandbox", on_delete=models.SET_NULL, null=True, blank=True, related_name="plan_steps"
    )
    message = models.CharField(max_length=300)

    class Meta:
        ordering = ["at", "pk"]

    def __str__(self) -> str:
        return f"plan {self.plan_id} {self.action}: {self.message}"


class HostCredential(models.Model):
    """A GPU host's own Redis user (``wire.broker_acl``) and message-signing key
    (``wire.signing``), as the control plane issued them: only the password's SHA-256 and the
    key's public half are kept. The hash is what Redis takes back (``#<hash>``) when its users
    are re-applied after a restart (``portal.fleet.credentials.reconcile``). By host name, not
    a ``Host``: a host is enrolled before its agent first reports."""

    host = models.SlugField(max_length=63, unique=True)
    # An agent pool's (one process serving many simulated hosts): ``host`` is then the prefix
    # every host of its file starts with, and the user may act for any of them.
    pool = models.BooleanField(default=False)
    password_sha256 = models.CharField(max_length=64)
    # The public half of the key its agent signs messages with (``wire.signing``, text form);
    # the private half went to the host once, at issue or rotation.
    signing_key = models.CharField(max_length=64, blank=True)
    issued_at = models.DateTimeField(default=timezone.now)
    rotated_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["host"]

    def __str__(self) -> str:
        return f"{self.host} ({'revoked' if self.revoked_at else 'active'})"

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @property
    def username(self) -> str:
        return broker_acl.pool_username(self.host) if self.pool else broker_acl.username(self.host)
