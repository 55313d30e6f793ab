"""GPUs follow demand: a non-MIG GPU is ``auto`` unless an admin pinned it.

The rule for GPUs that exist already, so that no choice an admin made is undone:

- **dedicated becomes auto**, unless the audit log shows a person set this GPU's sharing
  mode (then it stays pinned to dedicated). ``dedicated`` was the default: every agent's
  inventory wrote it for a new GPU and for one leaving MIG mode, so on its own it says
  nothing about what an admin wanted;
- **mps and timeslice stay, as pins**: nothing but a person (the admin, the console, the
  demo seed) ever set them;
- a GPU in MIG mode stays ``mig``; a GPU not in MIG mode that still says ``mig`` (a reset
  reported while it was being changed) follows demand, which the new constraint requires.

New GPUs from an agent's inventory follow demand (``portal.fleet.inventory``). Reversed,
``auto`` becomes ``dedicated`` again, the old default.
"""

from django.db import migrations, models


def _pinned_by_a_person(apps):
    """Primary keys (as the audit log keeps them, strings) of GPUs whose sharing mode a
    signed-in person changed: the console's audit signals record every such save."""
    AuditEntry = apps.get_model("console", "AuditEntry")
    pinned = set()
    entries = AuditEntry.objects.filter(target_type="fleet.gpu").values_list("target_id", "before", "after")
    for target_id, before, after in entries.iterator():
        if not isinstance(after, dict) or "sharing_mode" not in after:
            continue
        was = before.get("sharing_mode") if isinstance(before, dict) else None
        if was != after["sharing_mode"]:
            pinned.add(target_id)
    return pinned


def follow_demand(apps, schema_editor):
    Gpu = apps.get_model("fleet", "Gpu")
    Gpu.objects.filter(mig_enabled=False, sharing_mode="mig").update(sharing_mode="auto")
    chosen = _pinned_by_a_person(apps)
    defaulted = [
        pk
        for pk in Gpu.objects.filter(mig_enabled=False, sharing_mode="dedicated").values_list("pk", flat=True)
        if str(pk) not in chosen
    ]
    Gpu.objects.filter(pk__in=defaulted).update(sharing_mode="auto")


def back_to_dedicated(apps, schema_editor):
    apps.get_model("fleet", "Gpu").objects.filter(sharing_mode="auto").update(sharing_mode="dedicated")


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0003_fleet_plans"),
        ("console", "0001_audit_log"),
    ]

    operations = [
        migrations.AlterField(
            model_name="gpu",
            name="sharing_mode",
            field=models.CharField(
                choices=[
                    ("auto", "Follows demand"),
                    ("dedicated", "Pinned: dedicated"),
                    ("mps", "Pinned: MPS"),
                    ("timeslice", "Pinned: time-slice"),
                    ("mig", "MIG"),
                ],
                default="auto",
                max_length=16,
            ),
        ),
        migrations.RunPython(follow_demand, back_to_dedicated),
        migrations.AddConstraint(
            model_name="gpu",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("mig_enabled", True), models.Q(("sharing_mode", "mig"), _negated=True), _connector="OR"
                ),
                name="fleet_gpu_only_mig_gpus_share_by_mig",
                violation_error_message="A GPU not in MIG mode cannot be shared by MIG slices.",
            ),
        ),
    ]
