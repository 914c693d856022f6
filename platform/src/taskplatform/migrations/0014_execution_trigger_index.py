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

from ._concurrently import create_index_concurrently

INDEX = "tp_exec_trigger"
COLUMNS = '("trigger", "id")'


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        Execution = apps.get_model("taskplatform", "Execution")
        schema_editor.add_index(Execution, models.Index(fields=["trigger", "id"], name=INDEX))
        return
    create_index_concurrently(schema_editor, INDEX, "taskplatform_execution", COLUMNS)


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
