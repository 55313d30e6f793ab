from django.db import migrations
from django.db.models import Count, Q


def count_earlier_attempts(apps, schema_editor):  # type: ignore[no-untyped-def]
    """A sandbox queued again before attempts were counted (waiting, so it held no allocation
    key at 0021) ran once per requeue: each left an event naming its lost allocation. Its
    next launch is then told the right attempt, and that it resumes."""
    Sandbox = apps.get_model("sandboxes", "Sandbox")
    requeued = (
        Sandbox.objects.filter(attempt=0)
        .annotate(runs=Count("events", filter=Q(events__data__has_key="lost_allocation")))
        .filter(runs__gt=0)
    )
    for sandbox in requeued.iterator():
        Sandbox.objects.filter(pk=sandbox.pk).update(attempt=sandbox.runs)


class Migration(migrations.Migration):
    dependencies = [("sandboxes", "0021_attempts")]

    operations = [migrations.RunPython(count_earlier_attempts, migrations.RunPython.noop)]
