"""The audit log's model moved to the audit app (portal.audit), the lowest app, so every app
can record into it without importing the console. The table and its triggers stay: this
removes the model from the console's state only; audit 0001 adopts the same table."""

from django.db import migrations


class Migration(migrations.Migration):
    # After every migration that reads the log through the console's state (fleet 0004).
    dependencies = [("console", "0001_audit_log"), ("fleet", "0004_gpu_modes_follow_demand")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="AuditEntry")],
            database_operations=[],
        )
    ]
