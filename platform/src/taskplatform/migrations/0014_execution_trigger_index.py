"""The index behind the console's trigger filter, newest first (``trigger``, ``id``).

Without it, filtering the executions list by a trigger few rows have (an operator's, a flow's)
read the whole ledger: 334 ms at p95 at a million executions (``bench/console.py``).

The model declares it (the state operation); the database operation builds it. On PostgreSQL
CONCURRENTLY, so outside a transaction (``atomic = False``), as 0012 does: the ledger stays
readable and writable while the index is built, and a build that failed part-way (its invalid
index dropped first) is simply run again by the next ``migrate``. MariaDB's InnoDB builds a
secondary index online by default; SQLite has no concurrent writers to spare.
"""

from django.db import migrations, models

INDEX = "tp_exec_trigger"
COLUMNS = '("trigger", "id")'


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        Execution = apps.get_model("taskplatform", "Execution")
        schema_editor.add_index(Execution, models.Index(fields=["trigger", "id"], name=INDEX))
        return
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
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")
        return
    Execution = apps.get_model("taskplatform", "Execution")
    schema_editor.remove_index(Execution, models.Index(fields=["trigger", "id"], name=INDEX))


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("taskplatform", "0013_fence_cursors_owed_from")]
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="execution",
                    index=models.Index(fields=["trigger", "id"], name=INDEX),
                ),
            ],
            database_operations=[migrations.RunPython(create, drop)],
        ),
    ]
