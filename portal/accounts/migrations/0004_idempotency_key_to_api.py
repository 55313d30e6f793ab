# IdempotencyKey moved to the api app (portal/api), its table kept: the state forgets it
# here and api.0001 takes it over; the database is not touched.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0003_api_token_expiry_and_revoker"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="IdempotencyKey")],
            database_operations=[],
        ),
    ]
