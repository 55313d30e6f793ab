# The webhook models, moved from billing with their tables (billing_webhookendpoint,
# billing_webhookdelivery): state only, so an existing database keeps its rows untouched
# and a new one has the tables billing 0002 created. The content types move too, so
# admin permissions and log entries follow the models.

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

MODELS = ("webhookendpoint", "webhookdelivery")


def move_content_types(apps, schema_editor, source="billing", target="webhooks"):
    content_type = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    for model in MODELS:
        if not content_type.objects.using(db).filter(app_label=target, model=model).exists():
            content_type.objects.using(db).filter(app_label=source, model=model).update(app_label=target)


def move_content_types_back(apps, schema_editor):
    move_content_types(apps, schema_editor, source="webhooks", target="billing")


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("billing", "0006_webhooks_move_out"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="WebhookEndpoint",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("url", models.URLField(max_length=500)),
                        ("secret", models.CharField(max_length=200)),
                        (
                            "events",
                            models.JSONField(
                                default=list,
                                help_text="Among invoice.finalized, sandbox.stopped, usage.closed.",
                            ),
                        ),
                        ("active", models.BooleanField(default=True)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "project",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="webhook_endpoints",
                                to="accounts.project",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_webhookendpoint",
                        "ordering": ["pk"],
                    },
                ),
                migrations.CreateModel(
                    name="WebhookDelivery",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "event",
                            models.CharField(
                                choices=[
                                    ("invoice.finalized", "invoice.finalized"),
                                    ("sandbox.stopped", "sandbox.stopped"),
                                    ("usage.closed", "usage.closed"),
                                ],
                                max_length=40,
                            ),
                        ),
                        ("event_id", models.UUIDField()),
                        ("payload", models.JSONField()),
                        ("attempts", models.PositiveIntegerField(default=0)),
                        ("last_status", models.IntegerField(blank=True, null=True)),
                        ("last_error", models.CharField(blank=True, max_length=300)),
                        ("attempt_log", models.JSONField(blank=True, default=list)),
                        ("next_attempt_at", models.DateTimeField(blank=True, null=True)),
                        ("delivered_at", models.DateTimeField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "endpoint",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="deliveries",
                                to="webhooks.webhookendpoint",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_webhookdelivery",
                        "verbose_name_plural": "webhook deliveries",
                        "ordering": ["-created_at", "-pk"],
                        "indexes": [
                            models.Index(
                                condition=models.Q(
                                    ("delivered_at__isnull", True), ("next_attempt_at__isnull", False)
                                ),
                                fields=["next_attempt_at"],
                                name="webhook_delivery_due_idx",
                            )
                        ],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("endpoint", "event_id"),
                                name="billing_webhookdelivery_once_per_endpoint",
                                violation_error_message="An event is delivered once to each endpoint.",
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(move_content_types, move_content_types_back),
    ]
