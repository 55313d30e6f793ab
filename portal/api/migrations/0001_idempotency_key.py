# IdempotencyKey, moved from the accounts app with its table ("accounts_idempotencykey"),
# index and constraint names unchanged: state only, the database is not touched.

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("accounts", "0004_idempotency_key_to_api"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="IdempotencyKey",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("key", models.CharField(max_length=255)),
                        ("method", models.CharField(max_length=8)),
                        ("path", models.CharField(max_length=255)),
                        ("request_hash", models.CharField(max_length=64)),
                        ("response_status", models.PositiveSmallIntegerField(blank=True, null=True)),
                        ("response_body", models.JSONField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "user",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="idempotency_keys",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "accounts_idempotencykey",
                        "indexes": [models.Index(fields=["created_at"], name="idempotency_created_idx")],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("user", "key"),
                                name="accounts_idempotencykey_one_per_user_key",
                                violation_error_message="This idempotency key was already used.",
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
