"""``SchedulerFence.cursors_owed_from``: a new leader publishes before it has written the
cursors of its first load; while they are written, a successor starts an entry without a
cursor from there (``scheduling/table.py: _unseen_since``)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("taskplatform", "0012_limit_waiters_index")]

    operations = [
        migrations.AddField(
            model_name="schedulerfence",
            name="cursors_owed_from",
            field=models.DateTimeField(
                blank=True,
                help_text=(
                    "Set while a new leader is still writing the cursors of its first load (it publishes "
                    "first): an entry without a cursor is owed its slots from then."
                ),
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="schedulerfence",
            name="cursors_owed_up_to_id",
            field=models.BigIntegerField(
                blank=True,
                help_text="With cursors_owed_from: the highest schedule row id that leader's load read (later rows are new).",
                null=True,
            ),
        ),
    ]
