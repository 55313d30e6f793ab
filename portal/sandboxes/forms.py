"""The request form: every rule lives in ``actions.check_request_sandbox``; the form maps
its errors onto the field at fault."""

from __future__ import annotations

import shlex
from datetime import timedelta
from typing import Any

from django import forms
from django.db.models import Model

from portal.accounts.models import Membership, Project
from portal.api.text import repeated_fields, text_problem, unknown_fields
from portal.catalog.models import IsolationLevel, SandboxImage, Tier
from portal.fleet.models import Host
from portal.sandboxes.actions import SandboxRequest, SandboxRequestError, check_request_sandbox
from portal.sandboxes.gpu_choice import fleet_models, offered_models
from portal.sandboxes.models import MAX_NODES
from scheduler.gpus import MODELS
from wire.spec import DRIVER_ISOLATION

MIG_PROFILES = sorted(
    {p.name for m in MODELS.values() for p in m.mig_profiles}, key=lambda n: (int(n.split("g")[0]), n)
)

EXTEND_CHOICES_H = (1, 2, 4, 8)  # hours a user may add to a sandbox's time limit at once

# Django's message echoes the value, however long or odd: name the choices' place instead.
_CHOOSE = {"invalid_choice": "Choose one of the listed options."}


class ReadChoiceField(forms.ModelChoiceField):
    """A choice of a row its caller may have read already (``read``, set by the form from its
    ``read`` rows) from a query at least as narrow as this field's: taken as it is rather than
    read again by primary key. The API reads the project, tier and image by their slugs and
    the form read each again: three queries of a POST's twenty, in a burst that queued in one
    web process (BENCHMARKS.md, "A burst of requests")."""

    read: Model | None = None

    def to_python(self, value: Any) -> Any:
        if self.read is not None and value not in self.empty_values and str(value) == str(self.read.pk):
            return self.read
        return super().to_python(value)


class ModelMenuField(forms.ChoiceField):
    """The GPU model menu. Any value passes here: ``check_request_sandbox`` checks it against
    the chosen tier's models and names them, which "choose one of the listed options" does
    not for a script (the API's caller has no menu to look at)."""

    def valid_value(self, value: str) -> bool:
        return True


def tier_menus(tiers: list[Tier] | None = None) -> dict[str, list[str]]:
    """Each open tier's GPU models by its id (``tiers``: the open tiers, if read already):
    the page shows the chosen tier's. The fleet's models are read only for a tier that
    lists none."""
    tiers = list(Tier.objects.filter(active=True)) if tiers is None else tiers
    fleet = fleet_models() if any(not t.gpu_models and not t.cpu_only for t in tiers) else []
    return {str(tier.pk): offered_models(tier, fleet) for tier in tiers}


def model_choices(menus: dict[str, list[str]]) -> list[tuple[str, str]]:
    """The menu field's choices: every model some open tier offers."""
    return [("", "Any"), *((m, m) for m in sorted({m for models in menus.values() for m in models}))]


def isolation_the_fleet_gives() -> str:
    """The first of container, process and VM that a host that is up gives: the form's
    default, so that where no host runs Docker (``make run`` on a machine without it) the
    form does not open on an isolation nothing can run."""
    drivers = set(Host.objects.filter(state=Host.State.UP).values_list("driver", flat=True))
    given = {DRIVER_ISOLATION[driver] for driver in drivers if driver in DRIVER_ISOLATION}
    preferred = (IsolationLevel.CONTAINER, IsolationLevel.PROCESS, IsolationLevel.VM)
    return next((level.value for level in preferred if level in given), IsolationLevel.CONTAINER.value)


class SandboxRequestForm(forms.Form):
    project = ReadChoiceField(queryset=Project.objects.none())
    tier = ReadChoiceField(queryset=Tier.objects.filter(active=True))
    image = ReadChoiceField(queryset=SandboxImage.objects.filter(active=True))
    isolation = forms.ChoiceField(
        choices=IsolationLevel.choices, initial=IsolationLevel.CONTAINER, error_messages=_CHOOSE
    )
    gpu_model = ModelMenuField(
        choices=[("", "Any")],
        required=False,
        label="GPU model",
        help_text="Any: whichever model the tier offers has room first",
    )
    gpu_count = forms.IntegerField(
        min_value=1, max_value=8, initial=1, required=False, label="GPUs", help_text="Dedicated tiers"
    )
    nodes = forms.IntegerField(
        min_value=1, max_value=MAX_NODES, initial=1, required=False, label="Nodes",
        help_text="Dedicated tiers on a Slurm cluster: one job over this many nodes, that many GPUs each",
    )  # fmt: skip
    mig_profile = forms.ChoiceField(
        choices=[("", "—")] + [(p, p) for p in MIG_PROFILES],
        required=False,
        label="MIG profile",
        help_text="MIG tiers",
        error_messages=_CHOOSE,
    )
    mps_memory_gib = forms.IntegerField(
        min_value=1, max_value=80, initial=10, required=False, label="MPS memory (GiB)", help_text="MPS tiers"
    )
    mps_thread_pct = forms.IntegerField(
        min_value=1, max_value=100, initial=25, required=False, label="MPS threads (%)", help_text="MPS tiers"
    )
    duration_hours = forms.IntegerField(min_value=1, max_value=720, initial=1, label="Duration (hours)")
    run = forms.ChoiceField(
        choices=[("interactive", "Interactive"), ("batch", "Batch")],
        initial="interactive",
        required=False,  # absent: interactive
        label="Kind",
        error_messages=_CHOOSE,
        help_text="Interactive runs until you stop it; batch runs your command and ends with it.",
    )
    command = forms.CharField(
        required=False,
        max_length=2000,
        label="Command (batch)",
        help_text="Run in the sandbox as its user, e.g. python train.py --epochs 3",
        widget=forms.TextInput(attrs={"placeholder": "python train.py --epochs 3"}),
    )
    name = forms.CharField(
        required=False,
        max_length=60,
        label="Name (optional)",
        help_text="A label for your lists, e.g. resnet-sweep-3",
    )

    def __init__(
        self,
        *args: Any,
        user: Any,
        for_create: bool = False,
        read: tuple[Model, ...] = (),
        menus: dict[str, list[str]] | None = None,
        **kwargs: Any,
    ) -> None:
        """``for_create``: the request goes on to ``do_request_sandbox``, which checks the
        quota itself (under the project's lock), so ``clean`` leaves it out. ``read``: the
        project, tier or image rows the caller read from queries at least as narrow as the
        fields' (the API's: the token's projects, open tiers, allowed images), not read again.
        ``menus``: ``tier_menus()``, if the page read them already."""
        super().__init__(*args, **kwargs)
        for row in read:
            for field in self.fields.values():
                queryset = getattr(field, "queryset", None)
                if (
                    isinstance(field, ReadChoiceField)
                    and queryset is not None
                    and isinstance(row, queryset.model)
                ):
                    field.read = row
        self.user = user
        self.for_create = for_create
        if not self.is_bound:
            self.fields["isolation"].initial = isolation_the_fleet_gives()
        projects = (
            Project.objects.all()
            if user.is_staff
            # One filter() call: both conditions must hold for the *same* membership row.
            else Project.objects.filter(
                memberships__user=user,
                memberships__role__in=[Membership.Role.MANAGER, Membership.Role.MEMBER],
            )
        )
        self.fields["project"].queryset = projects.distinct()  # type: ignore[attr-defined]
        # A callable: read when the form is drawn, never for a POST (the actions check a
        # pick against its tier), so the API's burst of requests reads no menu.
        menu_field: Any = self.fields["gpu_model"]
        menu_field.choices = lambda: model_choices(tier_menus() if menus is None else menus)
        self.request_obj: SandboxRequest | None = None

    def _refuse_unexpected_fields(self) -> None:
        """Fields the form does not have (``privileged``, ``volumes``...) are refused, not
        ignored, and so is a field given twice (Django would quietly take the last)."""
        if extra := sorted(unknown_fields(self.data, [*self.fields, "csrfmiddlewaretoken"])):
            self.add_error(
                None,
                f"Unknown fields: {', '.join(extra)}. This form takes {', '.join(self.fields)}.",
            )
        for name, messages in repeated_fields(self.data).items():
            if name in self.fields:
                self.add_error(name, messages)

    def clean_command(self) -> str:
        command: str = self.cleaned_data.get("command") or ""
        # Control characters (escapes, newlines) in a command are a mistake or an attempt to
        # mislead whoever reads it in the console or the audit log.
        if problem := text_problem(command, max_length=2000):
            raise forms.ValidationError(problem)
        return command

    def clean_name(self) -> str:
        name: str = (self.cleaned_data.get("name") or "").strip()
        if problem := text_problem(name, max_length=60):
            raise forms.ValidationError(problem)
        return name

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        self._refuse_unexpected_fields()
        command: tuple[str, ...] = ()
        if data.get("run") == "batch":
            try:
                command = tuple(shlex.split(data.get("command") or ""))
            except ValueError as exc:
                self.add_error("command", f"The command cannot be read: {exc}.")
            else:
                if not command:
                    self.add_error("command", "A batch run needs the command it runs.")
        if self.errors:
            return data
        req = SandboxRequest(
            project=data["project"],
            tier=data["tier"],
            image=data["image"],
            isolation=data["isolation"],
            gpu_count=data.get("gpu_count") or 1,
            nodes=data.get("nodes") or 1,
            mig_profile=data.get("mig_profile") or "",
            gpu_model=data.get("gpu_model") or "",
            mps_memory_mib=(data.get("mps_memory_gib") or 0) * 1024,
            mps_thread_pct=data.get("mps_thread_pct") or 0,
            duration=timedelta(hours=data["duration_hours"]),
            name=data.get("name") or "",
            command=command,
        )
        try:
            check_request_sandbox(self.user, req, quota=not self.for_create)
        except SandboxRequestError as exc:
            self.add_request_error(exc)
        self.request_obj = req
        return data

    def add_request_error(self, exc: SandboxRequestError) -> None:
        """A refusal from the actions, on the form field it names."""
        field = {"mps_memory_mib": "mps_memory_gib", "duration": "duration_hours"}.get(exc.field, exc.field)
        self.add_error(field if field in self.fields else None, exc.message)
