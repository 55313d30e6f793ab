"""Running events said "running (<driver> <ref>)", and for the process driver the ref was the
host's pid: shown to tenants on the timeline and through the events API. Rewritten to what
new ones say, "running (<driver>)"; the handle itself stays on the sandbox for staff."""

from django.db import migrations

DRIVERS = ("process", "docker", "libvirt")


def drop_refs(apps, schema_editor):
    SandboxEvent = apps.get_model("sandboxes", "SandboxEvent")
    for driver in DRIVERS:
        SandboxEvent.objects.filter(to_state="running", message__startswith=f"running ({driver} ").update(
            message=f"running ({driver})"
        )


class Migration(migrations.Migration):
    dependencies = [("sandboxes", "0015_notification_email")]

    # Not reversible in substance (the refs are gone); going back leaves the new wording.
    operations = [migrations.RunPython(drop_refs, migrations.RunPython.noop)]
