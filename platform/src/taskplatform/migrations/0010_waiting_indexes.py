"""Partial indexes over the waiting rows of fleet-wide limits (PostgreSQL and SQLite).

The releasing worker looks for the first waiter of a task or a job after every limited body,
and a rate refusal counts the waiters: without these, PostgreSQL walked the primary key of the
whole ledger for ``ORDER BY id LIMIT 3`` (400-700 ms at 2 M rows, measured by the review of
the limits). Only waiting rows enter them, so the hot path's inserts and updates of other
states pay nothing. MariaDB has no partial indexes: there the (state, due_at) index serves.
They are created here rather than in the model, which would make Django warn on MariaDB.
"""

from django.db import migrations

INDEXES = (
    ("tp_exec_waiting_task", "task_name"),
    ("tp_exec_waiting_job", "job_id"),
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor not in ("postgresql", "sqlite"):
        return
    for name, column in INDEXES:
        schema_editor.execute(
            f'CREATE INDEX IF NOT EXISTS {name} ON taskplatform_execution ("{column}", "id") '
            "WHERE \"state\" = 'WAITING'"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor not in ("postgresql", "sqlite"):
        return
    for name, _column in INDEXES:
        schema_editor.execute(f"DROP INDEX IF EXISTS {name}")


class Migration(migrations.Migration):
    dependencies = [("taskplatform", "0009_flows")]
    operations = [migrations.RunPython(create, drop)]
