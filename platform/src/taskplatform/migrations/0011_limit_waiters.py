"""A waiting row names the limit that refused it, and counts its waits that backed off.

``waiting_on_limit``: a freed slot wakes a waiter of that very limit (``ledger.wake_waiter``),
not any row of the task, which may wait on its job's limit and give the slot back unused.
``limit_backoffs``: consecutive waits whose slots could not be counted; the worker doubles the
next wait with it. The partial index over the waiting rows by limit is 0012's.
One transaction: on SQLite adding a column with a default rebuilds the table, and a writer of
the previous release between the copy and the drop would lose its row. On PostgreSQL each
column is added in an instant (a nullable one; a constant default without a CHECK, so no scan
of the table under its exclusive lock).
Rows that waited before this migration name no limit: the rescuer makes them due at once
(``ledger.recall_unnamed_waiters``), as it does those a worker of the previous release parks
during a rolling deploy.
"""

from django.db import migrations, models


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
            field=models.IntegerField(
                db_default=0,
                default=0,
                help_text="Waits in a row whose limit slots could not be counted (lock backend down): the next backs off.",
            ),
        ),
    ]
