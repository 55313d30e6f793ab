"""What users may ask for: tiers (sharing mode, isolation, price, limits) and images."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from portal.catalog import registries
from portal.durations import duration_text
from wire import uids
from wire.spec import OVER_SHARE_STOP, OVER_SHARE_WARN
from wire.storage import StorageMount, StorageRefused, checked_source, checked_target

# A sandbox over its GPU memory share starves its neighbours meanwhile: an hour at most.
MAX_OVER_SHARE_GRACE = timedelta(hours=1)


class SharingMode(models.TextChoices):
    """What a tier's sandboxes ask for (a GPU's own mode is ``portal.fleet.models.GpuMode``).
    The values are the scheduler's request modes (``scheduler.cluster``)."""

    DEDICATED = "dedicated", "Dedicated GPUs"
    MIG = "mig", "MIG slice"
    MPS = "mps", "MPS share"
    TIMESLICE = "timeslice", "Time-slice replica"
    # Host CPU and memory only (data preparation, CPU jobs): no device, no GPU quota.
    CPU = "cpu", "CPU only (no GPU)"


class OverShare(models.TextChoices):
    """What happens to a sandbox on a shared GPU (MPS, time-slice) that holds more GPU memory
    than its share, summed over all its processes (the agent measures it: pid -> cgroup ->
    sandbox). Its owner is warned at once either way."""

    WARN = OVER_SHARE_WARN, "Warn its owner only"
    STOP = OVER_SHARE_STOP, "Warn its owner, then stop it after the grace"


class IsolationLevel(models.TextChoices):
    PROCESS = "process", "Process"
    CONTAINER = "container", "Container"
    VM = "vm", "Virtual machine"


class PriorityClass(models.Model):
    name = models.SlugField(max_length=40, unique=True)
    value = models.IntegerField(help_text="Higher runs first.")
    preemptible = models.BooleanField(default=False)

    class Meta:
        ordering = ["-value"]
        verbose_name_plural = "priority classes"

    def __str__(self) -> str:
        return f"{self.name} ({self.value})"


class Tier(models.Model):
    name = models.CharField(max_length=60, unique=True)
    slug = models.SlugField(max_length=40, unique=True)
    description = models.TextField(blank=True)
    sharing_mode = models.CharField(max_length=16, choices=SharingMode.choices)
    isolation_levels = models.JSONField(default=list, help_text="Subset of process, container, vm.")
    # Money as integers in minor units: millionths of the currency per GPU-hour held, or for
    # a CPU-only tier (which holds no GPU) per hour of the sandbox (see portal.billing.ledger).
    price_per_gpu_hour_micros = models.BigIntegerField(
        help_text="Per GPU-hour; a CPU-only tier's sandboxes are charged this per hour each."
    )
    currency = models.CharField(max_length=3, default="EUR")
    priority_class = models.ForeignKey(PriorityClass, on_delete=models.PROTECT, related_name="tiers")
    max_duration = models.DurationField(default=timedelta(hours=8))
    max_gpus = models.PositiveSmallIntegerField(default=1, help_text="Dedicated tiers: GPUs per sandbox.")
    # The request form's menu of GPU models: a mixed fleet (A100 + H100) where a tier sells
    # only some, or all of them as choices. A request that picks none takes any of these.
    gpu_models = models.JSONField(
        default=list,
        blank=True,
        help_text="GPU models this tier offers, e.g. H100-80GB, A100-80GB; empty: every model of the fleet.",
    )
    # MIG tiers: the slice sizes on the menu (a teaching tier of 1g slices only); empty: all.
    mig_profiles = models.JSONField(
        default=list, blank=True, help_text="MIG tiers: the MIG profiles offered; empty: every profile."
    )
    cpu_limit = models.FloatField(default=2.0)
    memory_limit_mib = models.PositiveIntegerField(default=4096)
    # A pids cgroup counts threads, not processes: PyTorch's OpenMP pool (a thread per host
    # core) in each DataLoader worker takes hundreds, so 512 failed real training runs.
    pids_limit = models.PositiveIntegerField(
        default=4096, help_text="Processes and threads (each thread counts) a sandbox may run."
    )
    # Docker's default /dev/shm is 64 MiB: PyTorch DataLoader workers die with "bus error",
    # NCCL with "failed to extend /dev/shm". Its pages count against the memory limit.
    shm_size_mib = models.PositiveIntegerField(
        default=0,
        help_text="Size of the sandbox's /dev/shm in MiB (shared memory, counted in its memory "
        "limit); 0: half the memory limit.",
    )
    network = models.BooleanField(default=False, help_text="Sandboxes get a network.")
    requeue_on_failure = models.BooleanField(
        default=False,
        help_text="A sandbox lost to a host or engine fault (host lost, sandbox vanished) is "
        "queued again instead of ending failed.",
    )
    # Graceful preemption (a preemptible priority class): a sandbox is safe for its first
    # preempt_after; then a preemption warns it (its owner told, SIGTERM to its processes, the
    # host's checkpoint hook run) and stops it preempt_grace later, as Slurm's GraceTime and
    # Kubernetes' termination grace period do; requeue_on_preemption queues it again after.
    preempt_after = models.DurationField(
        default=timedelta(0), help_text="Minimum runtime before a sandbox of this tier can be preempted."
    )
    preempt_grace = models.DurationField(
        default=timedelta(0),
        help_text="Time between the preemption warning (owner told, SIGTERM, checkpoint hook) and the stop.",
    )
    requeue_on_preemption = models.BooleanField(
        default=False, help_text="A preempted sandbox is queued again (keeping its place) instead of ending."
    )
    # Idle culling: a running sandbox whose GPU utilization (the mean over the agent's
    # window) stays under idle_util_pct for idle_minutes is warned, then stopped after
    # idle_grace_minutes more unless it gets busy. 0 % turns culling off.
    idle_util_pct = models.PositiveSmallIntegerField(
        default=0, help_text="Cull sandboxes whose GPU utilization stays under this % (0: never)."
    )
    idle_minutes = models.PositiveIntegerField(default=30, help_text="Idle this long: the user is warned.")
    idle_grace_minutes = models.PositiveIntegerField(
        default=10, help_text="Still idle this long after the warning: the sandbox is stopped."
    )
    # A shared GPU's memory is first come, first served: MPS limits bind one process each,
    # time-slicing limits nothing. A sandbox over its share takes its neighbours' memory (they
    # fail to allocate, or their jobs die), so by default it is stopped once the grace is over:
    # its owner, warned at once, has that long to free memory; warn-only protects no one.
    over_share = models.CharField(
        max_length=8,
        choices=OverShare.choices,
        default=OverShare.STOP,
        help_text="A sandbox on a shared GPU (MPS, time-slice) holding more GPU memory than its share.",
    )
    over_share_grace = models.DurationField(
        default=timedelta(minutes=2),
        help_text="How long it may stay over its GPU memory share before it is stopped (hh:mm:ss).",
    )
    storages: models.ManyToManyField[Storage, Any] = models.ManyToManyField(
        "Storage", blank=True, related_name="tiers", help_text="Persistent storage its sandboxes mount."
    )
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["price_per_gpu_hour_micros"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(price_per_gpu_hour_micros__gte=0),
                name="%(app_label)s_%(class)s_price_not_negative",
                violation_error_message="A price cannot be negative.",
            ),
            models.CheckConstraint(
                condition=models.Q(max_gpus__gte=1, max_gpus__lte=8),
                name="%(app_label)s_%(class)s_max_gpus_1_to_8",
                violation_error_message="Dedicated sandboxes take 1 to 8 GPUs of one host.",
            ),
            models.CheckConstraint(
                condition=models.Q(shm_size_mib__lte=models.F("memory_limit_mib")),
                name="%(app_label)s_%(class)s_shm_within_memory",
                violation_error_message="Shared memory cannot be larger than the memory limit: it is memory.",
            ),
            models.CheckConstraint(
                condition=models.Q(preempt_after__gte=timedelta(0), preempt_grace__gte=timedelta(0))
                & models.Q(preempt_grace__lte=timedelta(hours=1)),
                name="%(app_label)s_%(class)s_preemption_times",
                violation_error_message="Preemption times are not negative; the grace is at most 1 h.",
            ),
            models.CheckConstraint(
                condition=~models.Q(sharing_mode=SharingMode.CPU) | models.Q(idle_util_pct=0),
                name="%(app_label)s_%(class)s_cpu_tiers_not_culled_by_gpu",
                violation_error_message="A CPU-only tier has no GPU utilization to cull by: "
                "leave its idle threshold at 0 %.",
            ),
            models.CheckConstraint(
                condition=models.Q(
                    over_share_grace__gte=timedelta(0), over_share_grace__lte=MAX_OVER_SHARE_GRACE
                ),
                name="%(app_label)s_%(class)s_over_share_grace",
                violation_error_message="The grace for a sandbox over its GPU memory share is 0 to 1 h.",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """The grace as a form error on its field (the constraint is the database's guard)."""
        grace = self.over_share_grace
        if grace is not None and grace < timedelta(0):
            raise ValidationError({"over_share_grace": "The grace cannot be negative."})
        if grace is not None and grace > MAX_OVER_SHARE_GRACE:
            raise ValidationError(
                {
                    "over_share_grace": f"At most {duration_text(MAX_OVER_SHARE_GRACE)}: while a sandbox "
                    "is over its GPU memory share, its neighbours on the GPU may run out of memory."
                }
            )

    @property
    def shares_gpu(self) -> bool:
        """Its sandboxes share a GPU's memory with others: an MPS share, a time-slice replica."""
        return self.sharing_mode in (SharingMode.MPS, SharingMode.TIMESLICE)

    @property
    def over_share_rule(self) -> str:
        """What happens over the GPU memory share, in words ("" for tiers that share no GPU)."""
        if not self.shares_gpu:
            return ""
        if self.over_share == OverShare.WARN:
            return "over its GPU memory share, its owner is warned (it keeps running)"
        return (
            "over its GPU memory share, its owner is warned at once and it is stopped "
            f"after {duration_text(self.over_share_grace)} if it stays over"
        )

    @property
    def max_duration_display(self) -> str:
        return duration_text(self.max_duration)

    @property
    def idle_rule(self) -> str:
        """The culling rule in words, as users see it ("" when culling is off)."""
        if not self.idle_util_pct:
            return ""
        return (
            f"stopped when GPU utilization stays under {self.idle_util_pct}% for "
            f"{self.idle_minutes + self.idle_grace_minutes} min (warned after {self.idle_minutes} min)"
        )

    @property
    def preemption_rule(self) -> str:
        """Preemption in words, as users see it ("" when this tier is never preempted)."""
        if not self.priority_class.preemptible:
            return ""
        rule = "preemptible" + (
            f" after {duration_text(self.preempt_after)} of running" if self.preempt_after else ""
        )
        rule += (
            f", warned {duration_text(self.preempt_grace)} before the stop"
            if self.preempt_grace
            else ", stopped without warning"
        )
        return rule + (", then queued again" if self.requeue_on_preemption else "")

    @property
    def shm_mib(self) -> int:
        """The /dev/shm size a sandbox of this tier gets (the field, or half its memory)."""
        return self.shm_size_mib or max(1, self.memory_limit_mib // 2)

    @property
    def cpu_only(self) -> bool:
        return self.sharing_mode == SharingMode.CPU

    @property
    def price_display(self) -> str:
        unit = "h per sandbox" if self.cpu_only else "GPU-h"
        return f"{self.price_per_gpu_hour_micros / 1_000_000:.2f} {self.currency}/{unit}"


def validate_registry_prefix(value: str) -> None:
    try:
        registries.checked_prefix(value)
    except ValueError as exc:
        raise ValidationError(str(exc)) from exc


class ImageRegistry(models.Model):
    """A registry, or a namespace in one, whose images the agents may pull (the catalog's
    images still name each one a sandbox may run): ``portal/catalog/registries.py``."""

    prefix = models.CharField(
        max_length=200,
        unique=True,
        validators=[validate_registry_prefix],
        help_text="Registry host and any namespace, e.g. registry.example.org/ml/ or 127.0.0.1:5000/lab/",
    )
    note = models.CharField(max_length=200, blank=True, help_text="Who runs it, what it holds.")
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["prefix"]

    def __str__(self) -> str:
        return self.prefix

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.prefix = registries.checked_prefix(self.prefix)
        super().save(*args, **kwargs)

    @classmethod
    def active_prefixes(cls) -> list[str]:
        return list(cls.objects.filter(active=True).values_list("prefix", flat=True))

    @classmethod
    def allows(cls, reference: str) -> bool:
        """Whether the agents may pull ``reference``: it is under an active approval."""
        return registries.approved_by(reference, cls.active_prefixes()) is not None


class SandboxImage(models.Model):
    """The allowlist: sandboxes may only run these images."""

    name = models.CharField(max_length=60, unique=True)
    reference = models.CharField(max_length=200, help_text="Container image, e.g. gpushare/sandbox-base:1")
    command = models.JSONField(default=list, help_text="Command run in the sandbox, as a list.")
    app = models.CharField(
        max_length=60,
        blank=True,
        help_text="The web app its command serves on $GPUSHARE_APP_SOCKET under $GPUSHARE_APP_URL, "
        "e.g. JupyterLab (opened from the sandbox page); empty: none.",
    )
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        registry = registries.registry_named(self.reference)
        if registry and not ImageRegistry.allows(self.reference):
            raise ValidationError(
                {"reference": f"{registry} is not an approved registry: approve it (or the image's namespace "
                 "in it) under Registries, or load the image on every host and name it without its registry."}
            )  # fmt: skip


def _agent_rule(check: object, value: str) -> None:
    """The agent's own check of a path (wire/storage.py), as a form error."""
    try:
        check(value)  # type: ignore[operator]
    except StorageRefused as exc:
        raise ValidationError(str(exc)) from exc


def validate_directory(value: str) -> None:
    _agent_rule(checked_source, value)


def validate_mount_path(value: str) -> None:
    _agent_rule(checked_target, value)


class Storage(models.Model):
    """The storage allowlist, as images are one: directories under every GPU host's
    STORAGE_ROOT (a shared file system in production) that tiers give their sandboxes. A home
    is one folder per user inside ``directory``, a project storage one per project; a dataset
    is ``directory`` itself, read-only."""

    class Kind(models.TextChoices):
        HOME = "home", "Home (one per user)"
        PROJECT = "project", "Project folder (one per project)"
        DATASET = "dataset", "Dataset (read-only, shared)"

    name = models.CharField(max_length=60, unique=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    directory = models.CharField(
        max_length=200,
        validators=[validate_directory],
        help_text="Under the storage root of every GPU host, e.g. homes, projects or datasets/imagenet.",
    )
    mount_path = models.CharField(
        max_length=200,
        validators=[validate_mount_path],
        help_text="Where sandboxes see it, e.g. /home/sandbox, /project or /datasets/imagenet.",
    )
    limit_gib = models.PositiveIntegerField(
        default=0, help_text="Per user (a home) or per project (a folder), in GiB; 0: no limit."
    )
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["kind", "name"]
        verbose_name_plural = "storage"
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(kind="dataset") | models.Q(limit_gib=0),
                name="%(app_label)s_%(class)s_datasets_unlimited",
                violation_error_message="A dataset is read-only: it takes no limit.",
            )
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def limit_bytes(self) -> int:
        return self.limit_gib * 1024**3

    @property
    def read_only(self) -> bool:
        return self.kind == self.Kind.DATASET


class StorageVolume(models.Model):
    """One user's home or one project's folder of a storage: its group on the hosts (from
    its id) and its usage, as the agents last measured it."""

    storage = models.ForeignKey(Storage, on_delete=models.PROTECT, related_name="volumes")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True)
    project = models.ForeignKey("accounts.Project", on_delete=models.PROTECT, null=True, blank=True)
    used_bytes = models.BigIntegerField(default=0)
    measured_at = models.DateTimeField(null=True, blank=True)
    warned_pct = models.PositiveSmallIntegerField(default=0)  # the last warning given: 0, 90 or 100

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["storage", "user"],
                condition=models.Q(user__isnull=False),
                name="catalog_volume_per_user",
            ),
            models.UniqueConstraint(
                fields=["storage", "project"],
                condition=models.Q(project__isnull=False),
                name="catalog_volume_per_project",
            ),
            models.CheckConstraint(
                condition=models.Q(user__isnull=True) | models.Q(project__isnull=True),
                name="catalog_volume_one_owner",
            ),
        ]

    def __str__(self) -> str:
        return self.relative_path

    @property
    def relative_path(self) -> str:
        # By id, never by name: a renamed user or project keeps their files.
        return f"{self.storage.directory}/{self.user_id or self.project_id}"

    @property
    def used_pct(self) -> float | None:
        limit = self.storage.limit_bytes
        return 100.0 * self.used_bytes / limit if limit else None

    def mount(self) -> StorageMount:
        return StorageMount(
            self.storage.name,
            self.relative_path,
            self.storage.mount_path,
            False,
            uids.storage_gid(self.pk),
            self.pk,
        )
