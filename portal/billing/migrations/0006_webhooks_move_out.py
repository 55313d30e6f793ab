# The webhook models moved to portal.webhooks (one webhook system for billing and alerts).
# State only: the tables stay as they are and portal.webhooks 0001 takes them over by name.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0005_usagerecord_billed_milli"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name="WebhookDelivery"),
                migrations.DeleteModel(name="WebhookEndpoint"),
            ],
            database_operations=[],
        ),
    ]
