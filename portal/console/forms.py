"""Forms of the admin console: what an admin may ask a fleet plan to do."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms

from portal.catalog.models import ImageRegistry, IsolationLevel, PriorityClass, SandboxImage, Storage, Tier
from portal.catalog.sharing import TIER_DESCRIPTION_HELP, tier_mode_help
from portal.fleet.models import SETTABLE_MODES, Gpu, Host
from portal.identity.models import GroupRule
from portal.quotas.departments import promised_within
from portal.quotas.models import Department, ModelQuota, QuotaPolicy
from portal.sandboxes.forms import MIG_PROFILES
from portal.sandboxes.gpu_choice import fleet_models
from scheduler.gpus import COMPUTE_SLICES, MODELS


def _mig_profiles() -> list[tuple[str, str]]:
    names = sorted({p.name for m in MODELS.values() for p in m.mig_profiles}, key=lambda n: (int(n[0]), n))
    return [(n, n) for n in names]


class FleetFilterForm(forms.Form):
    """The fleet page's search: hosts by name, by GPU model, by their state or their GPUs'.
    A model or GPU state filter shows only the GPUs that match, on the hosts that have one."""

    q = forms.CharField(required=False, max_length=63, label="Host", strip=True)
    model = forms.ChoiceField(required=False, label="GPU model")
    state = forms.ChoiceField(required=False, choices=[("", "any"), *Host.State.choices], label="Host state")
    gpu_state = forms.ChoiceField(
        required=False, choices=[("", "any"), *Gpu.State.choices], label="GPU state"
    )

    def __init__(self, *args: Any, models: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = [("", "any"), *((m, m) for m in models)]  # type: ignore[attr-defined]


class MigRelayoutForm(forms.Form):
    host = forms.ModelChoiceField(
        queryset=Host.objects.none(), to_field_name="name", help_text="A host with GPUs in MIG mode."
    )
    profile = forms.ChoiceField(choices=_mig_profiles, help_text="The MIG profile to make room for.")
    max_disturbed = forms.IntegerField(
        min_value=0,
        max_value=COMPUTE_SLICES,
        initial=1,
        label="Running sandboxes it may move",
        help_text="Each is checkpointed (when a hook is set), stopped and relaunched on its new slot.",
    )

    # Set by "Approve and run": the preview's fingerprint, so only the plan shown runs.
    fingerprint = forms.CharField(required=False, widget=forms.HiddenInput, max_length=16)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["host"].queryset = Host.objects.filter(gpus__mig_enabled=True).distinct()  # type: ignore[attr-defined]


class GpuModeForm(forms.Form):
    """Pin a GPU not in MIG mode to one sharing mode, or let it follow demand again."""

    mode = forms.ChoiceField(
        choices=[(m.value, m.label) for m in SETTABLE_MODES],
        label="Sharing mode",
        error_messages={"invalid_choice": "Choose one of the listed modes."},
    )

    def __init__(self, *args: Any, gpu: Gpu, **kwargs: Any) -> None:
        # One form per GPU on the fleet page: ids and the label name the GPU.
        kwargs["auto_id"] = f"id_gpu{gpu.pk}_%s"
        super().__init__(*args, **kwargs)
        self.fields["mode"].widget.attrs["aria-label"] = f"Sharing mode of {gpu.host.name}/gpu{gpu.index}"


class ConsolidationForm(forms.Form):
    max_migrations = forms.IntegerField(
        min_value=1,
        max_value=1000,
        required=False,
        label="At most this many moves",
        help_text="Empty: as many as it takes to free every shared GPU that can be freed.",
    )


def tier_model_choices() -> list[tuple[str, str]]:
    """The models a tier's menu may list: the fleet's, and every model the scheduler knows
    (an admin may open a tier to a model before its hosts join)."""
    return [(m, m) for m in sorted({*fleet_models(), *MODELS})]


def ticked(choices: Any, label: str, help_text: str) -> forms.MultipleChoiceField:
    """A list field as checkboxes, none ticked allowed (a JSON list on the model)."""
    return forms.MultipleChoiceField(
        choices=choices, widget=forms.CheckboxSelectMultiple, required=False, label=label, help_text=help_text
    )


class TierForm(forms.ModelForm):
    isolation_levels = forms.MultipleChoiceField(
        choices=IsolationLevel.choices, widget=forms.CheckboxSelectMultiple, label="Isolation levels"
    )
    gpu_models = ticked(
        tier_model_choices,
        "GPU models offered",
        "The request form's menu of models (none ticked: every model of the fleet). A request that picks "
        "none takes any of these.",
    )
    mig_profiles = ticked(
        [(p, p) for p in MIG_PROFILES],
        "MIG profiles offered",
        "MIG tiers: the slice sizes the request form offers (none ticked: every profile).",
    )

    class Meta:
        model = Tier
        fields = [
            "name", "slug", "description", "sharing_mode", "isolation_levels", "price_per_gpu_hour_micros",
            "currency", "priority_class", "max_duration", "max_gpus", "gpu_models", "mig_profiles",
            "cpu_limit", "memory_limit_mib", "pids_limit", "shm_size_mib", "network", "requeue_on_failure",
            "preempt_after", "preempt_grace", "requeue_on_preemption", "idle_util_pct", "idle_minutes",
            "idle_grace_minutes", "over_share", "over_share_grace", "storages", "active",
        ]  # fmt: skip
        widgets = {"storages": forms.CheckboxSelectMultiple}
        labels = {
            "price_per_gpu_hour_micros": "Price per GPU-hour, or per sandbox-hour for a CPU-only tier "
            "(millionths of the currency)",
            "shm_size_mib": "Shared memory, /dev/shm (MiB)",
            "pids_limit": "Processes and threads",
            "preempt_after": "Preemptible after (minimum runtime, hh:mm:ss)",
            "preempt_grace": "Preemption warning (grace before the stop, hh:mm:ss)",
            "over_share": "Over its GPU memory share (MPS and time-slice tiers)",
            "over_share_grace": "Over its GPU memory share: grace before the stop (hh:mm:ss)",
        }
        help_texts = {"description": TIER_DESCRIPTION_HELP}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["sharing_mode"].help_text = tier_mode_help()

    def clean_storages(self) -> Any:
        storages = self.cleaned_data["storages"]
        seen: dict[str, str] = {}
        for storage in storages:
            if storage.mount_path in seen:
                both = f"{seen[storage.mount_path]} and {storage.name}"
                raise forms.ValidationError(f"{both} would both be mounted at {storage.mount_path}.")
            seen[storage.mount_path] = storage.name
        return storages


class StorageForm(forms.ModelForm):
    class Meta:
        model = Storage
        fields = ["name", "kind", "directory", "mount_path", "limit_gib", "active"]
        labels = {"limit_gib": "Limit (GiB, per user or per project; 0: none)"}

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("kind") == Storage.Kind.DATASET and data.get("limit_gib"):
            self.add_error("limit_gib", "A dataset is read-only: it takes no limit.")
        return data


class QuotaForm(forms.ModelForm):
    class Meta:
        model = QuotaPolicy
        fields = [
            "project", "department", "max_live_sandboxes", "max_gpus", "guaranteed_gpus", "weight",
            "max_gpu_hours_month",
        ]  # fmt: skip

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        guaranteed = data.get("guaranteed_gpus")
        if guaranteed is not None:
            _check_room_in(self, data.get("department"), guaranteed, but_quota=self.instance.pk)
        return data


def _gpus(count: Decimal) -> str:
    """ "6", "2.5": a figure of GPUs as a person writes it (a Decimal keeps its zeros)."""
    return format(count.normalize(), "f")


class DepartmentForm(forms.ModelForm):
    """A unit of the tree above projects. Refused: a parent below itself (a loop), and
    guarantees that do not nest (its parts promised more than it, or it more than its parent),
    since a guarantee no level can keep is a promise broken on the first busy day."""

    class Meta:
        model = Department
        fields = ["name", "parent", "guaranteed_gpus", "max_gpus", "weight"]
        labels = {"parent": "Part of"}

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        parent, unit = data.get("parent"), self.instance
        if parent is not None and unit.pk is not None and (parent == unit or unit in parent.ancestors()):
            self.add_error("parent", f"{parent} is {unit.name} or one of its parts: that would make a loop.")
            return data
        guaranteed = data.get("guaranteed_gpus")
        parts = promised_within(unit) if unit.pk is not None else Decimal(0)
        if guaranteed is not None and parts > guaranteed:
            self.add_error(
                "guaranteed_gpus",
                f"Its parts guarantee {_gpus(parts)} GPUs together: give it at least that, "
                "or leave it empty.",
            )
        _check_room_in(self, parent, guaranteed if guaranteed is not None else parts, but_department=unit.pk)
        return data


def _check_room_in(
    form: forms.ModelForm,
    parent: Department | None,
    guaranteed: Decimal,
    *,
    but_department: int | None = None,
    but_quota: int | None = None,
) -> None:
    """A guarantee inside a unit that guarantees a figure of its own: with its siblings', it
    may not promise more than that figure."""
    if parent is None or parent.guaranteed_gpus is None:
        return
    others = promised_within(parent, but_department=but_department, but_quota=but_quota)
    if others + guaranteed > parent.guaranteed_gpus:
        form.add_error(
            "guaranteed_gpus",
            f"{parent.name} guarantees {_gpus(parent.guaranteed_gpus)} GPUs in all, and its other parts "
            f"{_gpus(others)} already: at most "
            f"{_gpus(max(Decimal(0), parent.guaranteed_gpus - others))} here.",
        )


class ModelQuotaForm(forms.ModelForm):
    gpu_models = ticked(
        tier_model_choices,
        "Models of the class",
        "A class of models (Hopper: H100-80GB and H200) counts them together; none ticked: the limit's "
        "name is the model.",
    )

    class Meta:
        model = ModelQuota
        fields = ["quota", "department", "name", "gpu_models", "max_gpus", "max_gpu_hours_month"]
        labels = {
            "quota": "Project's quota",
            "department": "Or a department's",
            "name": "GPU model or class name",
        }

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if (data.get("quota") is None) == (data.get("department") is None):
            self.add_error(None, "Name a project's quota or a department, one of the two.")
        known = dict(tier_model_choices())
        if not data.get("gpu_models") and data.get("name") and data["name"] not in known:
            self.add_error(
                "name", "Name a GPU model the fleet or the scheduler knows, or tick the models of the class."
            )
        if data.get("max_gpus") is None and data.get("max_gpu_hours_month") is None:
            self.add_error(None, "Set a limit on GPUs held, on GPU-hours a month, or both.")
        return data


class PriorityClassForm(forms.ModelForm):
    class Meta:
        model = PriorityClass
        fields = ["name", "value", "preemptible"]


class ImageForm(forms.ModelForm):
    class Meta:
        model = SandboxImage
        fields = ["name", "reference", "command", "app", "active"]


class RegistryForm(forms.ModelForm):
    class Meta:
        model = ImageRegistry
        fields = ["prefix", "note", "active"]


class GroupRuleForm(forms.ModelForm):
    class Meta:
        model = GroupRule
        fields = ["source", "group", "project", "role", "active"]
