"""The beat's sync re-reads the schedule only when something changed (``ScheduleTable.unchanged``).

Every kind of edit a site makes is seen at the next sync, each through the mark it leaves:
django-celery-beat's ``PeriodicTasks`` stamp, the number of rows, or a row's own change time.
An edit that leaves none (raw SQL) is seen at the next full reload. Each test below fails when
the mark it names is taken out of ``unchanged``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from config.celery_app import app as celery_app
from taskplatform import schedule_job
from taskplatform.conf import platform_settings
from taskplatform.models import JobDefinition
from taskplatform.scheduling import table as table_module
from taskplatform.scheduling.table import FULL_RELOAD_SECONDS, ScheduleTable

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]


def make_jobs(n: int) -> list[JobDefinition]:
    jobs = []
    for i in range(n):
        job = JobDefinition.objects.create(slug=f"inc-{i}", task="testapp.effect")
        schedule_job(job, every_seconds=60)
        jobs.append(job)
    return jobs


def loaded_table() -> ScheduleTable:
    table = ScheduleTable(platform_settings(), celery_app)
    table.load(timezone.now(), first=True)
    return table


def entry_name(job: JobDefinition) -> str:
    job.refresh_from_db()
    assert job.periodic_task is not None
    return job.periodic_task.name


def test_an_unchanged_schedule_is_not_read_again_until_the_full_reload() -> None:
    """A row changed behind every mark is not seen by the next syncs (they did not read the
    rows) and is seen by the full reload ``FULL_RELOAD_SECONDS`` after the last one."""
    job = make_jobs(3)[0]
    table = loaded_table()
    name = entry_name(job)
    before = table.entries[name].digest
    with connection.cursor() as cur:  # raw SQL: no signal, no stamp, the same row count
        cur.execute(
            f"UPDATE {PeriodicTask._meta.db_table} SET args = %s WHERE name = %s",
            ['["inc-0", "raw"]', name],
        )
    now = timezone.now()
    assert table.unchanged(now + timedelta(seconds=1))
    assert table.load(now + timedelta(seconds=1), first=False) == ([], [])
    assert table.entries[name].digest == before, "the rows were read again though no mark changed"
    table.load(now + timedelta(seconds=FULL_RELOAD_SECONDS + 1), first=False)
    assert table.entries[name].digest != before


def _save_entry(job: JobDefinition) -> None:
    periodic = PeriodicTask.objects.get(name=entry_name(job))
    periodic.args = '["inc-0", "saved"]'
    periodic.save()


def _save_schedule(job: JobDefinition) -> None:
    periodic = PeriodicTask.objects.get(name=entry_name(job))
    interval = IntervalSchedule.objects.create(every=90, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.filter(pk=periodic.pk).update(interval=interval)  # no signal on the entry
    interval.every = 120
    interval.save()  # django-celery-beat's signal on the schedule model stamps PeriodicTasks


def _bulk_create(job: JobDefinition) -> None:
    interval = IntervalSchedule.objects.create(every=30, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.bulk_create([PeriodicTask(name="inc-bulk", task="testapp.effect", interval=interval)])


def _row_committed_after_its_stamp(job: JobDefinition) -> None:
    """What a sync can see when it falls between an edit's ``PeriodicTasks`` stamp (pre_save
    commits it first in autocommit) and the row: the stamp unchanged, the row new."""
    PeriodicTask.objects.filter(name=entry_name(job)).update(args='["inc-0", "late"]', date_changed=timezone.now())


def _raw_delete(job: JobDefinition) -> None:
    with connection.cursor() as cur:
        cur.execute(f"DELETE FROM {PeriodicTask._meta.db_table} WHERE name = %s", ["inc-bulk-gone"])


def _job_updated(job: JobDefinition) -> None:
    JobDefinition.objects.filter(pk=job.pk).update(catch_up_window_seconds=30, updated_at=timezone.now())


def _job_paused_in_bulk(job: JobDefinition) -> None:
    JobDefinition.objects.filter(pk=job.pk).update(enabled=False)  # no signal, updated_at untouched


def _entry_disabled_in_bulk(job: JobDefinition) -> None:
    PeriodicTask.objects.filter(name=entry_name(job)).update(enabled=False)  # no stamp, no date_changed


def _policy_changed_in_bulk(job: JobDefinition) -> None:
    JobDefinition.objects.filter(pk=job.pk).update(misfire_policy="catch_up")


def _window_changed_in_bulk(job: JobDefinition) -> None:
    JobDefinition.objects.filter(pk=job.pk).update(catch_up_window_seconds=77)


def _entry_moved_in_bulk(job: JobDefinition) -> None:
    other = IntervalSchedule.objects.create(every=75, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.filter(name=entry_name(job)).update(interval=other)  # no stamp, no date_changed


CHANGES: dict[str, tuple[Callable[[JobDefinition], None], str]] = {
    "entry moved to another schedule in bulk": (_entry_moved_in_bulk, "the sum of schedule ids"),
    "job paused in bulk": (_job_paused_in_bulk, "the count of enabled jobs"),
    "entry disabled in bulk": (_entry_disabled_in_bulk, "the count of enabled entries"),
    "policy changed in bulk": (_policy_changed_in_bulk, "the count of jobs per misfire policy"),
    "window changed in bulk": (_window_changed_in_bulk, "the sum of catch-up windows"),
    "entry saved": (_save_entry, "the PeriodicTasks stamp"),
    "schedule saved": (_save_schedule, "the PeriodicTasks stamp"),
    "entry bulk-created": (_bulk_create, "a row change time"),
    "row committed after its stamp": (_row_committed_after_its_stamp, "a row change time"),
    "entry deleted by raw SQL": (_raw_delete, "the row count"),
    "job updated in bulk": (_job_updated, "a job's change time"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_kind_of_edit_is_seen_at_the_next_sync(change: str) -> None:
    job = make_jobs(2)[0]
    if change == "entry deleted by raw SQL":
        interval = IntervalSchedule.objects.create(every=45, period=IntervalSchedule.SECONDS)
        PeriodicTask.objects.create(name="inc-bulk-gone", task="testapp.effect", interval=interval)
    table = loaded_table()
    snapshot = {name: entry.digest for name, entry in table.entries.items()}
    assert table.unchanged(timezone.now())
    edit, mark = CHANGES[change]
    edit(job)
    now = timezone.now()
    assert not table.unchanged(now), f"{change}: not seen through {mark}"
    table.load(now, first=False)
    after = {name: entry.digest for name, entry in table.entries.items()}
    assert after != snapshot
    assert table.unchanged(timezone.now()), "the load that saw the change is the new baseline"


def test_a_load_cut_short_is_not_a_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that stops part-way (the leader's keep-alive raises, a database error) leaves the
    table half rebuilt, though nothing changed since the previous load: the next sync must read
    every row again, not trust the previous load's marks (the scheduler's tick retries a failed
    first load as an ordinary sync)."""
    make_jobs(2)
    table = loaded_table()
    monkeypatch.setattr(table_module, "KEEP_ALIVE_EVERY", 1)

    def fail() -> None:
        raise RuntimeError("lease lost")

    with pytest.raises(RuntimeError):
        table.load(timezone.now(), first=True, keep_alive=fail)
    assert not table.unchanged(timezone.now())
