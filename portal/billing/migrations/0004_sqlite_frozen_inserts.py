# SQLite's half of what migration 0002's PostgreSQL triggers hold: no line may be added to
# (or moved into) a finalized invoice, and a credit note applies to a finalized invoice only.
# Deletes stay refused by the models there (Django's test teardown empties SQLite tables
# with DELETE); PostgreSQL's triggers from 0002 already cover all of this.

from django.db import migrations

SQLITE_UP = [
    "CREATE TRIGGER billing_invoiceline_frozen_insert BEFORE INSERT ON billing_invoiceline "
    "WHEN (SELECT state FROM billing_invoice WHERE id = NEW.invoice_id) = 'finalized' "
    "BEGIN SELECT RAISE(ABORT, 'the lines of a finalized invoice cannot change'); END;",
    "CREATE TRIGGER billing_invoiceline_frozen_move BEFORE UPDATE ON billing_invoiceline "
    "WHEN (SELECT state FROM billing_invoice WHERE id = NEW.invoice_id) = 'finalized' "
    "BEGIN SELECT RAISE(ABORT, 'the lines of a finalized invoice cannot change'); END;",
    "CREATE TRIGGER billing_creditnote_finalized_only BEFORE INSERT ON billing_creditnote "
    "WHEN NOT EXISTS (SELECT 1 FROM billing_invoice WHERE id = NEW.invoice_id AND state = 'finalized') "
    "BEGIN SELECT RAISE(ABORT, 'credit notes apply to finalized invoices only'); END;",
]
SQLITE_DOWN = [
    "DROP TRIGGER billing_creditnote_finalized_only;",
    "DROP TRIGGER billing_invoiceline_frozen_move;",
    "DROP TRIGGER billing_invoiceline_frozen_insert;",
]


def _sqlite(statements):  # type: ignore[no-untyped-def]
    def run(apps, schema_editor):  # type: ignore[no-untyped-def]
        if schema_editor.connection.vendor == "sqlite":
            for statement in statements:
                schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [("billing", "0003_usage_page_indexes")]

    operations = [migrations.RunPython(_sqlite(SQLITE_UP), _sqlite(SQLITE_DOWN))]
