"""A waiting row names the limit that refused it, and counts its waits that backed off.

``waiting_on_limit``: a freed slot wakes a waiter of that very limit (``ledger.wake_waiter``),
not any row of the task, which may wait on its job's limit and give the slot back unused.
``limit_backoffs``: consecutive waits whose slots could not be counted; the worker doubles the
next wait with it. A partial index over the waiting rows by limit serves the wake after every
limited body (PostgreSQL and SQLite; MariaDB has no partial indexes, and there the
(state, due_at) index serves), created here as in 0010 so Django does not warn on MariaDB.
Rows that waited before this migration have no limit named: their due time publishes them.
"""

from django.db import migrations, models

INDEX = "tp_exec_waiting_limit"


def create(apps, schema_editor):
    if schema_editor.connection.vendor not in ("postgresql", "sqlite"):
        return
    schema_editor.execute(
        f'CREATE INDEX IF NOT EXISTS {INDEX} ON taskplatform_execution ("waiting_on_limit", "id") '
        "WHERE \"state\" = 'WAITING'"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor not in ("postgresql", "sqlite"):
        return
    schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    dependencies = [("taskplatform", "0010_waiting_indexes")]
    operations = [
        migrations.AddField(
            model_name="execution",
            name="waiting_on_limit",
            field=models.BigIntegerField(
                blank=True,
                help_text="WAITING: the fleet-wide limit that refused it (a slot of it freed wakes it).",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="execution",
            name="limit_backoffs",
            field=models.PositiveIntegerField(
                db_default=0,
                default=0,
                help_text="Waits in a row whose limit slots could not be counted (lock backend down): the next backs off.",
            ),
        ),
        migrations.RunPython(create, drop),
    ]
