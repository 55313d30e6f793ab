"""GPUs in Django admin: the fleet app's model, registered here because draining and
undraining go through the control layer (portal.control.faults), which the fleet app may
not import; the console sits above control."""

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from portal.control.faults import do_drain_gpu, do_undrain_gpu
from portal.fleet.models import Gpu
from portal.fleet.modes import GpuModeError, check_gpu_mode, do_set_gpu_mode


class GpuAdminForm(forms.ModelForm):
    class Meta:
        model = Gpu
        fields = [
            "host", "index", "uuid", "name", "model", "memory_mib", "mig_enabled", "sharing_mode",
            "timeslice_replicas",
        ]  # fmt: skip
        help_texts = {
            "sharing_mode": "Follows demand: an idle GPU takes a dedicated, MPS or time-slice sandbox. "
            "Pinned: it takes only that mode. A GPU in MIG mode stays MIG.",
        }

    def clean_sharing_mode(self) -> str:
        """A pin the GPU's sandboxes contradict is refused here, as on the fleet page."""
        mode: str = self.cleaned_data["sharing_mode"]
        if self.instance.pk is not None and mode != self.instance.sharing_mode:
            try:
                check_gpu_mode(self.instance, mode)
            except GpuModeError as exc:
                raise forms.ValidationError(str(exc)) from exc
        return mode


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    form = GpuAdminForm
    list_display = (
        "host",
        "index",
        "model",
        "uuid",
        "sharing_mode",
        "mig_enabled",
        "state",
        "drain_reason",
        "unavailable_reason",
    )
    list_filter = ("host", "sharing_mode", "state")
    readonly_fields = (
        "state",
        "drain_reason",
        "unavailable_reason",
    )  # changed through the drain actions only
    actions = ["drain", "undrain"]

    def save_model(self, request: HttpRequest, obj: Gpu, form: forms.ModelForm, change: bool) -> None:
        """A mode change goes through ``do_set_gpu_mode`` (the lock, the fleet event, the
        agent's message); the other fields save as usual."""
        if not change or "sharing_mode" not in form.changed_data:
            super().save_model(request, obj, form, change)
            return
        mode, obj.sharing_mode = obj.sharing_mode, form.initial["sharing_mode"]
        super().save_model(request, obj, form, change)
        try:
            do_set_gpu_mode(obj.uuid, mode, request.user)
        except GpuModeError as exc:  # a sandbox of another mode was placed since the form was checked
            self.message_user(request, str(exc), messages.ERROR)
        obj.refresh_from_db()

    @admin.action(description="Drain the selected GPUs (no new sandboxes)")
    def drain(self, request: HttpRequest, queryset: QuerySet[Gpu]) -> None:
        done = sum(
            do_drain_gpu(g.uuid, f"drained by {request.user} in admin", request.user) for g in queryset
        )
        self.message_user(request, f"{done} GPU(s) drained.", messages.SUCCESS)

    @admin.action(description="Undrain the selected GPUs")
    def undrain(self, request: HttpRequest, queryset: QuerySet[Gpu]) -> None:
        done = sum(do_undrain_gpu(g.uuid, request.user) for g in queryset)
        self.message_user(request, f"{done} GPU(s) back in service.", messages.SUCCESS)
