"""A waiting row names the limit that refused it, and counts its waits that backed off.

``waiting_on_limit``: a freed slot wakes a waiter of that very limit (``ledger.wake_waiter``),
not any row of the task, which may wait on its job's limit and give the slot back unused.
``limit_backoffs``: consecutive waits whose slots could not be counted; the worker doubles the
next wait with it. A partial index over the waiting rows by limit serves the wake after every
limited body (PostgreSQL and SQLite; MariaDB has no partial indexes, and there the
(state, due_at) index serves), created here as in 0010 so Django does not warn on MariaDB.
Rows that waited before this migration name no limit: the rescuer makes them due at once
(``ledger.recall_unnamed_waiters``), as it does those a worker of the previous release parks
during a rolling deploy.
"""

from django.db import migrations, models

INDEX = "tp_exec_waiting_limit"
COLUMNS = '("waiting_on_limit", "id") WHERE "state" = \'WAITING\''


def create(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {INDEX} ON taskplatform_execution {COLUMNS}")
    elif vendor == "postgresql":
        # CONCURRENTLY: the ledger stays readable and writable while the index is built (a
        # plain CREATE INDEX holds off every claim and renewal for the whole scan). A build
        # that failed part-way leaves an invalid index, which IF NOT EXISTS would keep.
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                "SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
                [INDEX],
            )
            row = cursor.fetchone()
        if row is not None and row[0]:
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")
        schema_editor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} ON taskplatform_execution {COLUMNS}")


def drop(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")
    elif vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    # Not one transaction: on PostgreSQL an index is built CONCURRENTLY (outside any), and the
    # two columns are each added in an instant (a nullable one, and one with a constant default
    # and no CHECK: no scan of the table under its exclusive lock).
    atomic = False
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
            field=models.IntegerField(
                db_default=0,
                default=0,
                help_text="Waits in a row whose limit slots could not be counted (lock backend down): the next backs off.",
            ),
        ),
        migrations.RunPython(create, drop),
    ]
