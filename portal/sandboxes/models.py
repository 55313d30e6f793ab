"""Sandboxes, what they hold (allocations) and their history (events)."""

from __future__ import annotations

import shlex
from datetime import datetime

from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.accounts.models import Project
from portal.catalog.models import IsolationLevel, SandboxImage, Tier
from portal.durations import duration_text
from portal.fleet.models import Gpu, Host, MigInstance
from wire.sizes import human_size


class SandboxState(models.TextChoices):
    """Lifecycle; every transition goes through ``portal.sandboxes.actions``::

        requested -> queued -> placing -> starting -> running -> stopping -> stopped
                         \\         \\          \\          \\
                          `---------`----------`----------`--> failed | preempted | expired

    A sandbox moved by a defragmentation plan goes running -> stopping -> placing (on its
    new slot) -> starting -> running, or stopping -> queued when it has no slot to go to.
    """

    REQUESTED = "requested", "Requested"
    QUEUED = "queued", "Queued"
    PLACING = "placing", "Placing"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"
    PREEMPTED = "preempted", "Preempted"
    EXPIRED = "expired", "Expired"


LIVE_STATES = (
    SandboxState.REQUESTED,
    SandboxState.QUEUED,
    SandboxState.PLACING,
    SandboxState.STARTING,
    SandboxState.RUNNING,
    SandboxState.STOPPING,
)
ENDED_STATES = (SandboxState.STOPPED, SandboxState.FAILED, SandboxState.PREEMPTED, SandboxState.EXPIRED)
# What is kept of the scheduler's reason for a wait: the cycle compares it with the stored one.
# Room for a placement's reason and the GPU model limits that kept the request off some models.
PENDING_REASON_MAX = 400
MAX_NODES = 16  # the most hosts one sandbox spans (a multi-node Slurm job)


class StopCause(models.TextChoices):
    """Why a sandbox went to ``stopping``: what its end is called and who is told, kept as a
    field (set with the transition) rather than read back from an event's words."""

    ASKED = "asked", "Asked by a person"
    CULLED = "culled", "Culled as idle"
    EXPIRED = "expired", "Reached its time limit"
    PREEMPTED = "preempted", "Preempted"
    EXITED = "exited", "Exited by itself"
    OVER_SHARE = "over_share", "Over its GPU memory share"


class Sandbox(models.Model):
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="sandboxes")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="sandboxes")
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="sandboxes")
    image = models.ForeignKey(SandboxImage, on_delete=models.PROTECT, related_name="sandboxes")
    isolation = models.CharField(max_length=16, choices=IsolationLevel.choices)
    name = models.CharField(max_length=60, blank=True)
    # What was asked for: exactly one of these applies, by the tier's sharing mode.
    gpu_count = models.PositiveSmallIntegerField(default=1)
    # Whole-GPU tiers: the hosts it spans, gpu_count GPUs on each (one Slurm job across nodes);
    # ``host`` is the first, where the job's batch script runs.
    nodes = models.PositiveSmallIntegerField(default=1)
    mig_profile = models.CharField(max_length=16, blank=True)
    # The GPU model asked for (one of its tier's); blank: any model the tier offers.
    gpu_model = models.CharField(max_length=40, blank=True)
    mps_memory_mib = models.PositiveIntegerField(default=0)
    mps_thread_pct = models.PositiveSmallIntegerField(default=0)
    max_duration = models.DurationField()
    # Interactive: the image's own command (a shell or a service) runs until stopped or out of
    # time. Batch: ``command`` runs and the sandbox ends when it exits, with its exit code.
    batch = models.BooleanField(default=False)
    command = models.JSONField(default=list, blank=True)

    state = models.CharField(max_length=16, choices=SandboxState.choices, default=SandboxState.REQUESTED)
    pending_reason = models.CharField(max_length=PENDING_REASON_MAX, blank=True)
    failure = models.TextField(blank=True)
    # While it starts: what its host is doing that takes time (pulling its image), and when
    # it last said so (a launch that reports is alive: its launch is not sent again).
    launch_progress = models.CharField(max_length=300, blank=True)
    launch_progress_at = models.DateTimeField(null=True, blank=True)
    host = models.ForeignKey(Host, on_delete=models.PROTECT, null=True, blank=True, related_name="sandboxes")
    # Idempotency key of the current placement: drivers label what they launch with it.
    allocation_key = models.CharField(max_length=40, blank=True)
    # Its launches so far (``Attempt``): 0 until placed, 2 once queued again and placed again.
    attempt = models.PositiveSmallIntegerField(default=0)
    # Placed above its project's guarantee: another project's guaranteed work may reclaim it.
    borrowed = models.BooleanField(default=False)
    # Set on a victim of preemption: the request it makes room for (which waits meanwhile).
    preempted_for = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="preempted"
    )
    # A victim warned before its stop (its tier's preemption grace): when the stop is due.
    # It runs on until then, already promised away: no other request may preempt it.
    preempt_at = models.DateTimeField(null=True, blank=True)
    handle = models.JSONField(null=True, blank=True)
    stop_cause = models.CharField(max_length=10, choices=StopCause.choices, blank=True)
    # Set while a defragmentation plan moves it (stop, checkpoint, relaunch elsewhere):
    # reconciliation leaves it to the plan, and the plan's report decides where it goes.
    moving_plan = models.ForeignKey(
        "fleet.FleetPlan", on_delete=models.SET_NULL, null=True, blank=True, related_name="moving"
    )
    # Mean GPU utilization over the agent's window (UTIL_WINDOW_S), for idle culling.
    gpu_util_pct = models.FloatField(null=True, blank=True)
    gpu_util_window_s = models.FloatField(null=True, blank=True)
    gpu_util_at = models.DateTimeField(null=True, blank=True)
    # Idle culling: since when its utilization has stayed under the tier's threshold, and
    # when its owner was warned (both cleared when it gets busy again).
    idle_since = models.DateTimeField(null=True, blank=True)
    idle_warned_at = models.DateTimeField(null=True, blank=True)
    # When its owner was told it nears its time limit (cleared when it is extended).
    expiry_warned_at = models.DateTimeField(null=True, blank=True)
    # On a shared GPU, its agent's last report that it held more memory than its share
    # (``portal.sandboxes.over_share``): since when (null again once it is back within), what
    # it held and the share it was held to. Kept after a stop for that reason: its page says why.
    over_share_since = models.DateTimeField(null=True, blank=True)
    over_share_mib = models.PositiveIntegerField(default=0)
    memory_share_mib = models.PositiveIntegerField(default=0)

    requested_at = models.DateTimeField(default=timezone.now)
    placed_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at"]
        indexes = [
            # The scheduling cycle polls the queue: a partial index keeps it small.
            models.Index(
                fields=["requested_at"],
                name="sandbox_queue_idx",
                condition=models.Q(state="queued"),
            ),
            # "My sandboxes" and project pages list by project, newest first.
            models.Index(fields=["project", "-requested_at"], name="sandbox_project_idx"),
            # Every report of a host's about a sandbox names it by its placement's key, and the
            # control worker checks who may send it by the host holding that key.
            models.Index(fields=["allocation_key"], name="sandbox_allocation_key_idx"),
            # Placed sandboxes by host: each scheduling cycle reads the CPU-only ones (they
            # hold no allocation, yet take their host's CPU and memory), and a lost host's.
            models.Index(
                fields=["host"],
                name="sandbox_placed_idx",
                condition=models.Q(state__in=["placing", "starting", "running", "stopping"]),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(gpu_count__gte=1, gpu_count__lte=8),
                name="%(app_label)s_%(class)s_gpu_count_1_to_8",
                violation_error_message="A sandbox takes 1 to 8 GPUs.",
            ),
            models.CheckConstraint(
                condition=models.Q(nodes__gte=1, nodes__lte=MAX_NODES),
                name="%(app_label)s_%(class)s_nodes_1_to_16",
                violation_error_message="A sandbox spans 1 to 16 nodes.",
            ),
            models.CheckConstraint(
                condition=models.Q(mps_thread_pct__lte=100),
                name="%(app_label)s_%(class)s_mps_threads_at_most_100",
                violation_error_message="An MPS share takes at most 100% of the threads.",
            ),
        ]

    def __str__(self) -> str:
        return f"sandbox {self.pk} ({self.state})"

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def over_share_stop_at(self) -> datetime | None:
        """When it is stopped if it stays over its GPU memory share (None: not over, or its
        tier only warns)."""
        if self.over_share_since is None or self.tier.over_share != "stop":
            return None
        return self.over_share_since + self.tier.over_share_grace

    @property
    def over_share_for(self) -> str:
        """How long it had been over its share when it was stopped for it ("" if unknown)."""
        if self.over_share_since is None or self.stop_requested_at is None:
            return ""
        return duration_text(max(0, int((self.stop_requested_at - self.over_share_since).total_seconds())))

    @property
    def over_share_figures(self) -> str:
        """ "23.1 GiB of its 20.0 GiB": what it held at the last report against its share."""
        held, share = (human_size(mib * 1024**2) for mib in (self.over_share_mib, self.memory_share_mib))
        return f"{held} of its {share}"

    @property
    def command_line(self) -> str:
        """The batch command as a shell would read it back: each argv item quoted where it
        needs it, so ``["sh", "-c", "exit 0"]`` shows as ``sh -c 'exit 0'``, not ``sh -c exit 0``."""
        return shlex.join(self.command)

    @property
    def request_summary(self) -> str:
        mode = self.tier.sharing_mode
        if mode == "cpu":
            return f"CPU only · {self.tier.cpu_limit:g} CPU, {self.tier.memory_limit_mib} MiB"
        on = f" on {self.gpu_model}" if self.gpu_model else ""
        if mode == "mig":
            return f"MIG {self.mig_profile}{on}"
        if mode == "mps":
            return f"MPS {self.mps_memory_mib // 1024} GiB, {self.mps_thread_pct}% threads{on}"
        if mode == "timeslice":
            return f"1 time-slice replica{on}"
        gpus = f"{self.gpu_count} {self.gpu_model or 'GPU'}" + ("s" if self.gpu_count > 1 else "")
        return f"{gpus} on each of {self.nodes} nodes" if self.nodes > 1 else gpus


class Allocation(models.Model):
    """One device a placed sandbox holds. Released (active=False) when it ends."""

    class Kind(models.TextChoices):
        EXCLUSIVE = "exclusive", "Whole GPU"
        MIG = "mig", "MIG instance"
        MPS = "mps", "MPS share"
        TIMESLICE = "timeslice", "Time-slice replica"

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="allocations")
    gpu = models.ForeignKey(Gpu, on_delete=models.PROTECT, related_name="allocations")
    # SET_NULL: an instance destroyed by a re-layout leaves released allocations behind;
    # ``device_uuid`` still says which instance they held.
    mig_instance = models.ForeignKey(
        MigInstance, on_delete=models.SET_NULL, null=True, blank=True, related_name="allocations"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    device_uuid = models.CharField(max_length=64)  # what the sandbox sees: GPU-… or MIG-…
    milli_gpu = models.PositiveIntegerField(help_text="Share of the GPU in thousandths, for pricing.")
    mps_memory_mib = models.PositiveIntegerField(default=0)
    mps_thread_pct = models.PositiveSmallIntegerField(default=0)
    replica = models.PositiveSmallIntegerField(null=True, blank=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["gpu"],
                condition=models.Q(active=True, kind="exclusive"),
                name="%(app_label)s_%(class)s_one_live_per_exclusive_gpu",
                violation_error_message="This GPU is already held by a sandbox.",
            ),
            models.UniqueConstraint(
                fields=["mig_instance"],
                condition=models.Q(active=True),
                name="%(app_label)s_%(class)s_one_live_per_mig_instance",
                violation_error_message="This MIG instance is already held by a sandbox.",
            ),
            models.UniqueConstraint(
                fields=["gpu", "replica"],
                condition=models.Q(active=True, kind="timeslice"),
                name="%(app_label)s_%(class)s_one_live_per_replica",
                violation_error_message="This time-slice replica is already held.",
            ),
            models.CheckConstraint(
                condition=models.Q(milli_gpu__gte=1, milli_gpu__lte=1000),
                name="%(app_label)s_%(class)s_share_within_one_gpu",
                violation_error_message="An allocation holds between 0.001 and 1 GPU.",
            ),
        ]
        indexes = [
            # Placement snapshots read the live allocations of every GPU.
            models.Index(fields=["gpu"], name="allocation_live_idx", condition=models.Q(active=True)),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.device_uuid} for sandbox {self.sandbox_id}"


class Attempt(models.Model):
    """One launch of a sandbox, from its placement to why it ended. A sandbox queued again
    (preempted, its host lost, moved with no slot) or moved by a fleet plan runs again as its
    next attempt; the sandbox is told which one and why the last ended (the resume contract,
    ``portal.sandboxes.resume``), and ``gpushare logs`` shows each with its output."""

    class End(models.TextChoices):
        PREEMPTED = "preempted", "Preempted"
        LOST = "lost", "Lost to a fault"
        MOVED = "moved", "Moved by a fleet plan"
        ENDED = "ended", "Ended"

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveSmallIntegerField()
    allocation_key = models.CharField(max_length=40, db_index=True)
    host_name = models.CharField(max_length=255)
    placed_at = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)
    end = models.CharField(max_length=10, choices=End.choices, blank=True)
    end_message = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["sandbox", "number"]
        constraints = [
            models.UniqueConstraint(fields=["sandbox", "number"], name="sandboxes_attempt_one_per_number"),
        ]

    def __str__(self) -> str:
        return f"sandbox {self.sandbox_id}, attempt {self.number}"


class SandboxEvent(models.Model):
    """Append-only history of a sandbox: one row per transition."""

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    message = models.CharField(max_length=300, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "pk"]

    def __str__(self) -> str:
        return f"{self.sandbox_id}: {self.from_state or '∅'} → {self.to_state}"


class Notification(models.Model):
    """An in-app message to one user: a sandbox started, waits, was preempted or culled,
    a quota is nearly used up. Shown under the bell in the top bar until read."""

    class Kind(models.TextChoices):
        STARTED = "started", "Started"
        QUEUED = "queued", "Queued"
        PREEMPTED = "preempted", "Preempted"
        IDLE = "idle", "Idle warning"
        CULLED = "culled", "Culled"
        EXPIRING = "expiring", "Expiring"
        ENDED = "ended", "Ended"
        FAILED = "failed", "Failed"
        DRAINED = "drained", "GPU drained"
        QUOTA = "quota", "Quota"
        ALERT = "alert", "Alert"
        STORAGE = "storage", "Storage"
        OVER_SHARE = "over_share", "GPU memory over its share"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications")
    sandbox = models.ForeignKey(
        Sandbox, on_delete=models.CASCADE, null=True, blank=True, related_name="notifications"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    message = models.CharField(max_length=300)
    created_at = models.DateTimeField(default=timezone.now)
    read_at = models.DateTimeField(null=True, blank=True)
    # Set when a worker takes its mail to send (a conditional UPDATE, so two never both do),
    # and kept once the SMTP server accepted it; null again when the send failed. Null for
    # notifications nobody asked to have mailed (``portal.notifications.emails``).
    emailed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        indexes = [
            models.Index(
                fields=["user", "-created_at"],
                name="notification_unread_idx",
                condition=models.Q(read_at=None),
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} for {self.user}: {self.message}"


class EmailChoice(models.Model):
    """Whether one kind of notification also arrives by email for one user. A kind without a
    row takes its default (``portal.notifications.emails.DEFAULT_EMAIL_KINDS``); the settings
    page writes a row for every kind it shows, so a later change of defaults leaves what a
    user chose alone."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="email_choices")
    kind = models.CharField(max_length=16, choices=Notification.Kind.choices)
    by_email = models.BooleanField()

    class Meta:
        constraints = [
            # Also the index of the mail task's lookup: the choices of a few users at once.
            models.UniqueConstraint(
                fields=["user", "kind"],
                name="%(app_label)s_%(class)s_one_per_kind",
                violation_error_message="A user chooses once per kind of notification.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} by email for {self.user_id}: {self.by_email}"


class OutputChunk(models.Model):
    """A piece of a batch sandbox's output (stdout and stderr together), as its agent read it.

    ``start`` and ``end`` are offsets into everything that allocation printed; a sandbox keeps
    the newest ``BATCH_OUTPUT_MAX_BYTES`` (older chunks are deleted as new ones arrive), and a
    start past the previous chunk's end marks bytes the host dropped. Written by
    ``portal.sandboxes.output.do_store_output`` only."""

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="output_chunks")
    allocation_key = models.CharField(max_length=40)
    start = models.BigIntegerField()
    end = models.BigIntegerField()
    data = models.BinaryField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["allocation_key", "start"],
                name="%(app_label)s_%(class)s_one_per_offset",
                violation_error_message="This piece of output is stored already.",
            ),
            models.CheckConstraint(
                condition=models.Q(end__gt=models.F("start"), start__gte=0),
                name="%(app_label)s_%(class)s_not_empty",
                violation_error_message="A piece of output holds at least one byte.",
            ),
        ]
        indexes = [
            # output_tail() and trimming: one allocation's chunks by offset, newest last.
            models.Index(fields=["allocation_key", "end"], name="output_by_allocation_end"),
        ]

    def __str__(self) -> str:
        return f"output of sandbox {self.sandbox_id} [{self.start}, {self.end})"
