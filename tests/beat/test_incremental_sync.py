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
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

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


def entries_of(jobs: list[JobDefinition]) -> list[PeriodicTask]:
    return [PeriodicTask.objects.get(name=entry_name(job)) for job in jobs]


# Each edit below is seen through one mark only (the one named beside it in CHANGES): take that
# mark out of ``ScheduleTable._read_marks``/``unchanged`` and its case fails.


def _saved_by_a_writer_whose_clock_is_behind(jobs: list[JobDefinition]) -> None:
    """``save()`` stamps ``PeriodicTasks``; the writer's clock, an hour behind, dates the row's
    ``date_changed`` before the window ``unchanged`` looks at."""
    periodic = entries_of(jobs)[0]
    periodic.args = '["inc-0", "saved"]'
    periodic.save()
    PeriodicTask.objects.filter(pk=periodic.pk).update(date_changed=timezone.now() - timedelta(hours=1))


def _crontab_changed_in_bulk(jobs: list[JobDefinition]) -> None:
    cron = entries_of(jobs)[2].crontab
    assert cron is not None
    CrontabSchedule.objects.filter(pk=cron.pk).update(minute="*/7")  # no signal: django-celery-beat#694


def _row_committed_after_its_stamp(jobs: list[JobDefinition]) -> None:
    """What a sync can see when it falls between an edit's ``PeriodicTasks`` stamp and its row
    (a writer that stamps first): the stamp unchanged, the row new."""
    PeriodicTask.objects.filter(name=entry_name(jobs[0])).update(args='["inc-0", "late"]', date_changed=timezone.now())


def _job_slug_changed(jobs: list[JobDefinition]) -> None:
    JobDefinition.objects.filter(pk=jobs[0].pk).update(slug="inc-renamed", updated_at=timezone.now())


def _pause_swapped(jobs: list[JobDefinition]) -> None:
    """One job paused, another resumed, in bulk: as many enabled jobs as before."""
    JobDefinition.objects.filter(pk=jobs[0].pk).update(enabled=False)
    JobDefinition.objects.filter(pk=jobs[1].pk).update(enabled=True)


def _entry_enable_swapped(jobs: list[JobDefinition]) -> None:
    first, second, _ = entries_of(jobs)
    PeriodicTask.objects.filter(pk=first.pk).update(enabled=False)
    PeriodicTask.objects.filter(pk=second.pk).update(enabled=True)


def _moved_keeping_the_sum(jobs: list[JobDefinition]) -> None:
    """Two entries on schedules i and i + 2 (``_set_up``) both moved to schedule i + 1: the
    plain sum of their schedule ids is kept."""
    first, second, _ = entries_of(jobs)
    mid = IntervalSchedule.objects.get(every=62)
    PeriodicTask.objects.filter(pk__in=[first.pk, second.pk]).update(interval=mid)


def _windows_changed_keeping_the_sum(jobs: list[JobDefinition]) -> None:
    JobDefinition.objects.filter(pk=jobs[0].pk).update(catch_up_window_seconds=600)
    JobDefinition.objects.filter(pk=jobs[1].pk).update(catch_up_window_seconds=600)


def _policies_swapped(jobs: list[JobDefinition]) -> None:
    JobDefinition.objects.filter(pk=jobs[0].pk).update(misfire_policy="catch_up")
    JobDefinition.objects.filter(pk=jobs[1].pk).update(misfire_policy="skip")


def _entry_deleted_by_raw_sql(jobs: list[JobDefinition]) -> None:
    with connection.cursor() as cur:
        cur.execute(f"DELETE FROM {PeriodicTask._meta.db_table} WHERE name = %s", ["inc-standalone"])


def _set_up(change: str, jobs: list[JobDefinition]) -> None:
    """The state each edit starts from, written before the table's first load."""
    if change == "an entry saved by a writer whose clock is behind":  # an old entry, outside the window
        PeriodicTask.objects.filter(pk=entries_of(jobs)[0].pk).update(date_changed=timezone.now() - timedelta(hours=2))
    if change == "an entry deleted by raw SQL":  # a plain django-celery-beat entry, no job
        interval = IntervalSchedule.objects.create(every=45, period=IntervalSchedule.SECONDS)
        PeriodicTask.objects.create(name="inc-standalone", task="testapp.effect", interval=interval)
    if change == "two jobs' pause states swapped in bulk":
        JobDefinition.objects.filter(pk=jobs[1].pk).update(enabled=False)
    if change == "two entries' enabled flags swapped in bulk":
        PeriodicTask.objects.filter(pk=entries_of(jobs)[1].pk).update(enabled=False)
    if change == "two windows changed keeping their sum":
        JobDefinition.objects.filter(pk=jobs[0].pk).update(catch_up_window_seconds=300)
        JobDefinition.objects.filter(pk=jobs[1].pk).update(catch_up_window_seconds=900)
    if change == "two policies swapped in bulk":
        JobDefinition.objects.filter(pk=jobs[0].pk).update(misfire_policy="skip")
        JobDefinition.objects.filter(pk=jobs[1].pk).update(misfire_policy="catch_up")
    if change == "two entries moved to a schedule between theirs":
        low, mid, high = (
            IntervalSchedule.objects.create(every=e, period=IntervalSchedule.SECONDS) for e in (61, 62, 63)
        )
        assert mid.pk - low.pk == high.pk - mid.pk
        first, second, _ = entries_of(jobs)
        PeriodicTask.objects.filter(pk=first.pk).update(interval=low)
        PeriodicTask.objects.filter(pk=second.pk).update(interval=high)


CHANGES: dict[str, tuple[Callable[[list[JobDefinition]], None], str]] = {
    "an entry saved by a writer whose clock is behind": (
        _saved_by_a_writer_whose_clock_is_behind,
        "the PeriodicTasks stamp",
    ),
    "a crontab's fields changed in bulk": (_crontab_changed_in_bulk, "the schedule tables, read whole"),
    "a row committed after its stamp": (_row_committed_after_its_stamp, "the entries' latest change stamp"),
    "a job's slug changed in bulk": (_job_slug_changed, "the jobs' latest change stamp"),
    "two jobs' pause states swapped in bulk": (_pause_swapped, "the jobs' enabled ids"),
    "two entries' enabled flags swapped in bulk": (_entry_enable_swapped, "the entries' enabled ids"),
    "two entries moved to a schedule between theirs": (_moved_keeping_the_sum, "the id-weighted schedule sums"),
    "two windows changed keeping their sum": (_windows_changed_keeping_the_sum, "the id-weighted window sum"),
    "two policies swapped in bulk": (_policies_swapped, "the ids per misfire policy"),
    "an entry deleted by raw SQL": (_entry_deleted_by_raw_sql, "the id-weighted schedule sums"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_kind_of_edit_is_seen_at_the_next_sync(change: str) -> None:
    jobs = make_jobs(2)
    cron_job = JobDefinition.objects.create(slug="inc-cron", task="testapp.effect")
    schedule_job(cron_job, cron="*/5 * * * *")
    jobs.append(cron_job)
    _set_up(change, jobs)
    table = loaded_table()
    snapshot = {name: entry.digest for name, entry in table.entries.items()}
    assert table.unchanged(timezone.now())
    edit, mark = CHANGES[change]
    edit(jobs)
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


def test_an_entry_created_before_a_load_cut_short_is_owed_from_the_load_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry created after a load, then a load that stops before reaching it: the next load
    owes it slots from the last finished load, not from the one cut short."""
    make_jobs(1)
    table = loaded_table()
    finished_at = table.loaded_at
    assert finished_at is not None
    job = JobDefinition.objects.create(slug="inc-new", task="testapp.effect")
    schedule_job(job, every_seconds=60)
    monkeypatch.setattr(table_module, "KEEP_ALIVE_EVERY", 1)

    def fail() -> None:
        raise RuntimeError("database error")

    with pytest.raises(RuntimeError):
        table.load(timezone.now() + timedelta(seconds=5), first=False, keep_alive=fail)
    monkeypatch.undo()
    resets, _gone = table.load(timezone.now() + timedelta(seconds=10), first=False)
    assert dict(resets)[entry_name(job)] == finished_at


def test_a_load_keeps_the_lease_alive_while_it_reads_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``keep_alive`` (the leader's lease renewal) is called every ``KEEP_ALIVE_EVERY`` rows
    while the rows are read, not only while entries are built: at 100,000 entries the read
    alone outlasted the 6 s lease on a busy host, and the leader lost the lease before it had
    built a single entry, at every attempt."""
    make_jobs(12)
    monkeypatch.setattr(table_module, "KEEP_ALIVE_EVERY", 5)
    table = ScheduleTable(platform_settings(), celery_app)
    built_when_called: list[int] = []
    table.load(timezone.now(), first=True, keep_alive=lambda: built_when_called.append(len(table.entries)))
    assert len(table.entries) == 12
    # The read calls it once per 5 rows (3 times for 12) before any entry exists; the build
    # loop's first call, at row 0, makes one more with none built.
    assert built_when_called.count(0) >= 4, built_when_called


def test_the_quick_argument_parse_is_json_loads_whenever_it_answers() -> None:
    """``_loads`` skips ``json.loads`` for empty containers and a list of one plain string (a
    trigger's job slug, on every job's row): what it returns is what ``json.loads`` returns."""
    import json
    import random

    samples = ["[]", "{}", '[""]', '["a"]', '["job-1"]', '["a b"]', '["é"]', '["\\u0041"]', '["a\\"b"]',
               '["a","b"]', '["a"] ', ' ["a"]', '[1]', '{"a": 1}', '["\\\\"]', '["\\n"]', '["a"]]']  # fmt: skip
    alphabet = 'ab"\\ ,[]{}:\u00e9\t\n0'
    rng = random.Random(7)
    samples += ['["' + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) + '"]' for _ in range(3000)]
    for text in samples:
        try:
            expected = json.loads(text)
        except ValueError:
            with pytest.raises(ValueError):
                table_module._loads(text, [])
            continue
        got = table_module._loads(text, [])
        assert got == expected and type(got) is type(expected), text
    assert table_module._loads("", []) == [] and table_module._loads(None, {}) == {}
