"""The partial index over the waiting rows by limit: the wake after every limited body looks
for a waiter of the limit whose slot freed (``ledger._waiters``).

PostgreSQL and SQLite; MariaDB has no partial indexes, and there the (state, due_at) index
serves (nothing is created, as in 0010, so Django does not warn on MariaDB). On PostgreSQL it
is built CONCURRENTLY, so outside a transaction (``atomic = False``): the only operation here,
so a build that fails (a statement timeout, a long transaction waited on) is simply run again
by the next ``migrate``, the invalid index it left dropped first.
"""

from django.db import migrations

from ._concurrently import create_index_concurrently

INDEX = "tp_exec_waiting_limit"
COLUMNS = '("waiting_on_limit", "id") WHERE "state" = \'WAITING\''


def create(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {INDEX} ON taskplatform_execution {COLUMNS}")
        # 0011's column with a default made SQLite rebuild the table, which keeps only the
        # model's own indexes: 0010's partial ones are made again.
        for name, column in (("tp_exec_waiting_task", "task_name"), ("tp_exec_waiting_job", "job_id")):
            schema_editor.execute(
                f'CREATE INDEX IF NOT EXISTS {name} ON taskplatform_execution ("{column}", "id") '
                "WHERE \"state\" = 'WAITING'"
            )
    elif vendor == "postgresql":
        # CONCURRENTLY: the ledger stays readable and writable while the index is built (a
        # plain CREATE INDEX holds off every claim and renewal for the whole scan).
        create_index_concurrently(schema_editor, INDEX, "taskplatform_execution", COLUMNS)


def drop(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")
    elif vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("taskplatform", "0011_limit_waiters")]
    operations = [migrations.RunPython(create, drop)]
