"""The audit log's model, taken over from the console app with its table and append-only
triggers in place (console 0001 created them; console 0002 dropped the model from its state)."""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("console", "0002_auditentry_moves_to_audit"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="AuditEntry",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("at", models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ("actor_name", models.CharField(blank=True, max_length=150)),
                        ("action", models.CharField(max_length=40)),
                        ("target_type", models.CharField(max_length=60)),
                        ("target_id", models.CharField(max_length=64)),
                        ("target_repr", models.CharField(max_length=200)),
                        ("before", models.JSONField(blank=True, null=True)),
                        ("after", models.JSONField(blank=True, null=True)),
                        ("message", models.CharField(blank=True, max_length=300)),
                        (
                            "actor",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "console_auditentry",
                        "verbose_name_plural": "audit entries",
                        "ordering": ["-at", "-pk"],
                        "indexes": [
                            models.Index(fields=["target_type", "target_id"], name="audit_target_idx")
                        ],
                    },
                ),
            ],
            database_operations=[],
        )
    ]
