"""The schedule table: django-celery-beat's rows as slot entries, with cursors and a heap of next slots.

``ScheduleTable.load`` re-reads the schedule tables (a digest per row tells what changed),
builds a ``SlotEntry`` per row (its ``slots.Schedule``, misfire policy and what it triggers)
and keeps each entry's cursor, the last slot it published, in a heap ordered by next slot.
"""

from __future__ import annotations

import gc
import heapq
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from django.db import connection
from django.db.models import Count, F, Max, Q, Sum
from django_celery_beat.models import (
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    PeriodicTasks,
    SolarSchedule,
)

from ..conf import PlatformSettings
from ..core.validation import is_idempotent
from ..domain.policies import MisfirePolicy
from ..exceptions import ConfigurationError
from ..models import JobDefinition, ScheduleCursor, SchedulerFence
from .slots import PERIOD_SECONDS, Bounded, Clocked, Crontab, Interval, Schedule

log = logging.getLogger("taskplatform.beat")

#: The task a plain django-celery-beat entry uses to trigger a job by slug.
TRIGGER_TASK = "taskplatform.trigger_job"

#: Rows built between two calls of ``load``'s ``keep_alive`` (a few tens of milliseconds).
KEEP_ALIVE_EVERY = 500

#: A sync re-reads every row at least this often, even when ``ScheduleTable.unchanged`` saw
#: nothing change: the backstop for an edit that bypassed every change mark (raw SQL).
FULL_RELOAD_SECONDS = 600.0
#: How far before the last full load ``unchanged`` looks for rows whose change stamp it has
#: not seen: a writer's clock behind the beat's, and a row that committed after its stamp.
STAMP_MARGIN = timedelta(seconds=300)


@dataclass
class SlotEntry:
    """One schedule row as the leader publishes it."""

    name: str
    schedule: Schedule | None
    digest: int
    active: bool  # PeriodicTask.enabled and the job not paused
    kind: str  # "job" | "task" (an IdempotentTask) | "plain" (any other task)
    job_id: int | None = None
    job_slug: str = ""
    task: str = ""
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    policy: MisfirePolicy = MisfirePolicy.RUN_ONCE
    catch_up_window_seconds: float = 3600.0
    generation: int = 0

    @property
    def key_prefix(self) -> str:
        return self.job_slug if self.kind == "job" else self.name

    def next_slot(self, after: datetime) -> datetime | None:
        return self.schedule.next_after(after) if self.schedule is not None else None


_ROW_FIELDS = (
    "id", "name", "task", "args", "kwargs", "queue", "exchange", "routing_key", "priority", "headers",
    "expires", "expire_seconds", "start_time", "enabled", "solar_id",
    "interval__every", "interval__period",
    "crontab__minute", "crontab__hour", "crontab__day_of_month", "crontab__month_of_year",
    "crontab__day_of_week", "crontab__timezone",
    "clocked__clocked_time",
    "job__id", "job__slug", "job__enabled", "job__misfire_policy", "job__catch_up_window_seconds",
)  # fmt: skip
_JOB_FIELDS = ("id", "slug", "enabled", "misfire_policy", "catch_up_window_seconds", "periodic_task_id")


def _digest(row: dict[str, Any], job: dict[str, Any] | None) -> int:
    """What a row and its job hold, to tell a changed entry from an unchanged one within this
    process (never stored): Python's hash of their values in the query's field order.

    The values are strings, integers, booleans, time stamps and None; two different rows of
    these hash alike by chance only (one in 2**64), save integers -1 and -2, which no column
    read here holds (ids, counts, seconds and priorities are not negative). A hash of their
    ``repr`` took a sixth of a first load of 100,000 entries; this takes a fiftieth."""
    return hash((tuple(row.values()), tuple(job.values()) if job is not None else None))


@lru_cache(maxsize=65_536)
def _crontab(minute: str, hour: str, day_of_month: str, month_of_year: str, day_of_week: str, zone: str) -> Crontab:
    """One ``Crontab`` per distinct expression and zone (immutable, so shared): 100,000 entries
    of the scale mix use 8,640 crontabs, and parsing each entry's cost a fifth of the first
    load. A bad expression raises each time (exceptions are not cached)."""
    return Crontab(
        minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month_of_year,
        day_of_week=day_of_week, timezone=zone,
    )  # fmt: skip


#: ``MisfirePolicy`` by value (calling the enum cost a tenth of building an entry).
_POLICIES = {policy.value: policy for policy in MisfirePolicy}


def build_schedule(row: dict[str, Any]) -> Schedule:
    """The ``slots.Schedule`` of one ``PeriodicTask`` row (as ``values()`` returns it)."""
    if row["crontab__minute"] is not None:
        return _crontab(
            row["crontab__minute"],
            row["crontab__hour"],
            row["crontab__day_of_month"],
            row["crontab__month_of_year"],
            row["crontab__day_of_week"],
            str(row["crontab__timezone"]),
        )
    if row["interval__every"] is not None:
        seconds = row["interval__every"] * PERIOD_SECONDS[row["interval__period"]]
        anchor = row["start_time"] or datetime(1970, 1, 1, tzinfo=UTC)
        return Interval(seconds, anchor=anchor)
    if row["clocked__clocked_time"] is not None:
        return Clocked(row["clocked__clocked_time"])
    if row["solar_id"] is not None:
        raise ConfigurationError("solar schedules are not supported by LockedScheduler; use a crontab")
    raise ConfigurationError("the periodic task has no schedule")


def _loads(text: str | None, default: Any) -> Any:
    if not text:
        return default
    if text == "{}":  # most rows' kwargs and headers (a fresh value: entries may not share one)
        return {}
    if text == "[]":
        return []
    if text.startswith('["') and text.endswith('"]') and len(text) > 3:
        # One plain string (a trigger's job slug): what ``json.loads`` returns, without it.
        inner = text[2:-2]
        if '"' not in inner and "\\" not in inner and inner.isprintable():
            return [inner]
    return json.loads(text)


def build_entry(
    row: dict[str, Any], job: dict[str, Any] | None, conf: PlatformSettings, app: Any, digest: int | None = None
) -> SlotEntry:
    """A ``SlotEntry`` from a ``PeriodicTask`` row and the job it triggers (if any); ``digest``
    is the row's ``_digest`` if the caller has it already."""
    digest = _digest(row, job) if digest is None else digest
    schedule = build_schedule(row)
    if row["start_time"] is not None or row["expires"] is not None:
        schedule = Bounded(schedule, not_before=row["start_time"], not_after=row["expires"])
    options: dict[str, Any] = {}
    for option in ("queue", "exchange", "routing_key", "priority"):
        if row[option] is not None and row[option] != "":
            options[option] = row[option]
    headers = _loads(row["headers"], {})
    if headers:
        options["headers"] = headers
    if row["expire_seconds"]:
        options["expires"] = row["expire_seconds"]
    entry = SlotEntry(
        name=row["name"],
        schedule=schedule,
        digest=digest,
        active=bool(row["enabled"]),
        kind="plain",
        task=row["task"],
        args=_loads(row["args"], []),
        kwargs=_loads(row["kwargs"], {}),
        options=options,
        catch_up_window_seconds=conf.beat_catch_up_window_seconds,
    )
    if job is not None:
        entry.kind = "job"
        entry.job_id = job["id"]
        entry.job_slug = job["slug"]
        entry.active = entry.active and bool(job["enabled"])
        entry.policy = _POLICIES.get(job["misfire_policy"]) or MisfirePolicy(job["misfire_policy"])
        if job["catch_up_window_seconds"]:
            entry.catch_up_window_seconds = float(job["catch_up_window_seconds"])
    elif is_idempotent(app.tasks.get(row["task"])):
        entry.kind = "task"
    return entry


class ScheduleTable:
    """The leader's view of the schedule: entries, cursors and a heap of next slots."""

    def __init__(self, conf: PlatformSettings, app: Any) -> None:
        self.conf = conf
        self.app = app
        self.entries: dict[str, SlotEntry] = {}
        self.cursors: dict[str, datetime] = {}
        self.heap: list[tuple[datetime, str, int]] = []
        self._generation = 0
        self.broken: dict[str, str] = {}
        #: Wall time of the previous load: an entry that changed since was edited after it.
        self.loaded_at: datetime | None = None
        #: What the last full load saw of the change marks (``unchanged``), and when.
        self._marks: tuple[Any, ...] | None = None
        #: Per kind of row, how many change stamps the last full load saw within
        #: ``STAMP_MARGIN`` before it, and the latest.
        self._recent: dict[str, tuple[int, datetime | None]] = {}
        self._full_at: datetime | None = None
        #: What the last full load read that a takeover needs without reading the rows again:
        #: each row's change stamp and ``last_run_at`` (where an entry without a cursor starts),
        #: and every name it saw (a cursor of a name not among them goes).
        self._changed_at: dict[str, datetime | None] = {}
        self._last_run: dict[str, datetime | None] = {}
        self._seen: set[str] = set()
        #: The full load after which the process's objects were frozen (``freeze_after_load``).
        self.frozen_for: datetime | None = None
        #: Read with the cursors at a takeover: where a leader that had not written the cursors
        #: of its first load yet started the entries without one, and the highest row id that
        #: load read (``SchedulerFence``); None, None when every cursor was written.
        self.owed_from: datetime | None = None
        self.owed_up_to_id: int | None = None
        #: Each row's id, as the last full load read it; the highest is ``max_row_id``.
        self._row_ids: dict[str, int] = {}
        self.max_row_id = 0

    @property
    def full_load_at(self) -> datetime | None:
        """When the last full load (every row read) finished, None before the first."""
        return self._full_at

    def unchanged(self, now: datetime) -> bool:
        """True when nothing in the schedule tables changed since the last full load, so a
        sync need not re-read and digest every row (a second at 100,000 entries).

        A change shows in one of the marks it leaves: django-celery-beat's ``PeriodicTasks``
        stamp (its signals set it on every save and delete of an entry or a schedule, and
        ``jobs.py`` after its bulk updates; ``DatabaseScheduler`` relies on it alone); sums
        weighted by row id of the entries' enabled flags and schedules and of the jobs' enabled
        flags, misfire policies and catch-up windows (a bulk ``update()`` or ``bulk_create``
        sends no signal; ``_read_marks``);
        the number and the latest of the entries' ``date_changed`` and the jobs' ``updated_at``
        from ``STAMP_MARGIN`` before the last load on, against what that load saw (an edit
        whose ``PeriodicTasks`` stamp committed before its row: a load can fall in between).
        The schedule tables themselves (intervals, crontabs, clocked and solar times) are read
        whole and compared. What leaves none of these marks (raw SQL on an entry or a job; a
        bulk update of any other of their columns, such as an entry's arguments, expiry or
        start, a job's slug; that race under
        two edits at once, the later one's row first) is read at the next full load, at most
        ``FULL_RELOAD_SECONDS`` later; slots of the new schedule due before then are not
        published, the old schedule's are. The check is five aggregate queries and the schedule tables.
        """
        if (
            self._marks is None
            or self._full_at is None
            or now - self._full_at >= timedelta(seconds=FULL_RELOAD_SECONDS)
        ):
            return False
        if self._read_marks() != self._marks:
            return False
        since = self._full_at - STAMP_MARGIN
        for kind, model, stamp in _STAMPED:
            found = model.objects.filter(**{f"{stamp}__gte": since}).aggregate(n=Count("id"), last=Max(stamp))
            if (found["n"], found["last"]) != self._recent[kind]:
                return False
        return True

    def _read_marks(self) -> tuple[Any, ...]:
        """The stamp, and per-row weighted sums of what a bulk ``update()`` changes without a
        signal: each row's id times its value (or the ids of the rows with a value), so that
        two edits that cancel out in a count or a plain sum (one job paused, another resumed)
        still change the mark. Inserts and deletes change them too."""
        stamp = PeriodicTasks.objects.filter(ident=1).values_list("last_update", flat=True).first()
        tasks = PeriodicTask.objects.aggregate(
            on=Sum("id", filter=Q(enabled=True)),
            **{column: Sum(F("id") * F(column)) for column in ("interval_id", "crontab_id", "clocked_id", "solar_id")},
        )
        jobs = JobDefinition.objects.aggregate(
            on=Sum("id", filter=Q(enabled=True)),
            window=Sum(F("id") * F("catch_up_window_seconds")),
            **{policy.value: Sum("id", filter=Q(misfire_policy=policy.value)) for policy in MisfirePolicy},
        )
        # The schedule tables are read whole: a site has a few hundred schedules for any number
        # of entries, and a bulk update of a crontab's fields leaves no other mark.
        schedules = [hash(tuple(model.objects.order_by("pk").values_list(*columns))) for model, columns in _SCHEDULES]
        return stamp, *sorted(tasks.items()), *sorted(jobs.items()), *schedules

    def _push(self, entry: SlotEntry) -> None:
        cursor = self.cursors.get(entry.name)
        if cursor is None:
            return
        upcoming = entry.next_slot(cursor)
        if upcoming is not None:
            heapq.heappush(self.heap, (upcoming, entry.name, entry.generation))

    def load(
        self,
        now: datetime,
        *,
        first: bool,
        keep_alive: Callable[[], None] | None = None,
        entries_only: bool = False,
    ) -> tuple[list[tuple[str, datetime]], list[str]]:
        """Re-read the schedule tables; returns cursors to (re)set ``(name, slot)`` and to delete.

        ``first``: this process just became leader, so cursors are read from the database.
        The entries may have been built already, by this process as a follower
        (``entries_only``): an entry whose row has not changed is kept, its cursor read and
        its next slot queued; if nothing changed since the follower's last full load, the rows
        are not even read again (``_resume``). What a takeover starts from is the same as a
        cold load's: the cursors the last leader wrote.

        ``entries_only``: a follower's warm-up: the entries are built or updated, nothing else
        (no cursor, no queue of next slots, nothing returned), so that a takeover does not
        start cold (a first load of 100,000 entries takes seconds).

        ``keep_alive`` is called every ``KEEP_ALIVE_EVERY`` rows (building an entry costs
        tens of microseconds, so a large schedule takes seconds): the leader renews its lease
        there, or raises to stop when it cannot.

        An entry that is new, edited, re-enabled or repaired since the previous load is owed
        slots from that previous load on (it changed after it): an edit is not a misfire of
        the new schedule, and a slot due between the edit and this load is not lost.
        """
        if first:
            self.heap = []  # a leader's queue is its own: a former term's is stale
            self.cursors = {}
            if self.entries and self.unchanged(now):
                return self._resume(now, keep_alive)
        elif self.unchanged(now):
            self.loaded_at = now  # nothing changed up to now: an edit after it is owed from here
            return [], []
        marks = self._read_marks()  # before the rows: a change between the two is seen next time
        since = now - STAMP_MARGIN
        # The same aggregate ``unchanged`` compares (reading every recent stamp instead took
        # 2.5 s after a bulk edit of 100,000 jobs).
        job_stamps = JobDefinition.objects.filter(updated_at__gte=since).aggregate(
            n=Count("id"), last=Max("updated_at")
        )
        recent = {"job": (job_stamps["n"], job_stamps["last"])}
        if first:
            # Before the rows: queries come before the pause below.
            self.cursors = read_cursors()
            self.owed_from, self.owed_up_to_id = read_owed_from(self.conf.beat_lock_name)
        # From the read's rows to the built entries, the garbage collector is paused: CPU work
        # that allocates millions of objects and frees none (``_collector_paused``). No query
        # runs inside but the lease renewals.
        with ExitStack() as paused:
            rows = _read_rows(
                PeriodicTask.objects.values(*_ROW_FIELDS, "date_changed", "last_run_at"),
                keep_alive,
                then=lambda: paused.enter_context(_collector_paused()),
            )
            recent["task"] = _latest(row["date_changed"] for row in rows if _at_or_after(row["date_changed"], since))
            self._marks = None  # until this load has finished: a load cut short is not a baseline
            changed_at = {row["name"]: row.pop("date_changed") for row in rows}  # not part of the digest
            last_run = {row["name"]: row.pop("last_run_at") for row in rows}  # nor this (the leader writes it)
            row_ids = {row["name"]: row["id"] for row in rows}
            linked = {row["job__slug"] for row in rows if row["job__id"] is not None}
            trigger_slugs = [
                args[0]
                for row in rows
                if row["task"] == TRIGGER_TASK and row["job__id"] is None
                for args in [_loads_safely(row["args"])]
                if args and isinstance(args[0], str) and args[0] not in linked
            ]
            jobs_by_slug: dict[str, dict[str, Any]] = {}
            if trigger_slugs:  # plain trigger rows: their jobs, queried with the collector on
                paused.close()
                jobs = JobDefinition.objects.filter(slug__in=trigger_slugs).values(*_JOB_FIELDS)
                jobs_by_slug = {job["slug"]: job for job in jobs}
                paused.enter_context(_collector_paused())
            # ``loaded_at`` moves on only once this load has finished: after a load cut short, the
            # next one owes what it did not reach from the same moment as it would have.
            since = self.loaded_at or now
            resets, seen = self._build(
                rows,
                linked,
                jobs_by_slug,
                changed_at,
                last_run,
                now=now,
                since=since,
                first=first,
                entries_only=entries_only,
                keep_alive=keep_alive,
            )
        gone = [name for name in self.cursors if name not in seen]
        for name in gone:
            self.cursors.pop(name, None)
        for name in [name for name in self.entries if name not in seen]:
            self.entries.pop(name, None)
        for name in [name for name in self.broken if name not in seen]:
            self.broken.pop(name, None)
        self._marks, self._recent, self._full_at = marks, recent, now
        self._changed_at, self._last_run, self._seen = changed_at, last_run, seen
        self._row_ids, self.max_row_id = row_ids, max(row_ids.values(), default=0)
        self.loaded_at = now
        return resets, gone

    def _build(
        self,
        rows: list[dict[str, Any]],
        linked: set[str],
        jobs_by_slug: dict[str, dict[str, Any]],
        changed_at: dict[str, datetime | None],
        last_run: dict[str, datetime | None],
        *,
        now: datetime,
        since: datetime,
        first: bool,
        entries_only: bool,
        keep_alive: Callable[[], None] | None,
    ) -> tuple[list[tuple[str, datetime]], set[str]]:
        """``load``'s entries from its rows: (cursors to set, the names seen)."""
        resets: list[tuple[str, datetime]] = []
        seen: set[str] = set()
        for index, row in enumerate(rows):
            if keep_alive is not None and index % KEEP_ALIVE_EVERY == 0:
                keep_alive()
            name = row["name"]
            seen.add(name)
            shadowed = _shadowed_trigger(row, linked)
            if shadowed:
                if self.broken.get(name) != shadowed:
                    log.error("schedule entry %r ignored: %s", name, shadowed)
                self.broken[name] = shadowed
                self.entries.pop(name, None)
                continue
            job = _job_of(row, jobs_by_slug)
            digest = _digest(row, job)
            known = self.entries.get(name)
            if known is not None and known.digest == digest:
                if first and name in self.cursors:  # built as a follower: its cursor decides
                    self._push(known)
                    continue
                if not first:
                    continue
            try:
                entry = build_entry(row, job, self.conf, self.app, digest)
            except (ConfigurationError, ValueError, KeyError) as exc:
                if self.broken.get(name) != str(exc):
                    log.error("schedule entry %r cannot be scheduled: %s", name, exc)
                self.broken[name] = str(exc)
                self.entries.pop(name, None)
                continue
            repaired = self.broken.pop(name, None) is not None
            self._generation += 1
            entry.generation = self._generation
            self.entries[name] = entry
            if entries_only:
                continue
            if first:  # a takeover: whatever this process saw as a follower, as in a cold load
                known, repaired = None, False
            if name not in self.cursors or repaired or (known is not None and not first):
                if not first:
                    start = max(self.cursors.get(name, since), since)
                elif name not in self.cursors:
                    start = self._unseen_since(changed_at.get(name), now, last_run.get(name), row["id"])
                else:
                    start = now
                self.cursors[name] = start
                resets.append((name, start))
            self._push(entry)
        return resets, seen

    def _resume(
        self, now: datetime, keep_alive: Callable[[], None] | None
    ) -> tuple[list[tuple[str, datetime]], list[str]]:
        """A takeover by a follower whose entries are current (nothing changed since its last
        full load): the cursors are read, and each entry queued from its own, as a cold load
        would; an entry without one starts where a cold load would start it (``_unseen_since``,
        from what the full load read of its row, unchanged since)."""
        self.cursors = read_cursors()
        self.owed_from, self.owed_up_to_id = read_owed_from(self.conf.beat_lock_name)
        resets: list[tuple[str, datetime]] = []
        try:
            for index, (name, entry) in enumerate(self.entries.items()):
                if keep_alive is not None and index % KEEP_ALIVE_EVERY == 0:
                    keep_alive()
                if name not in self.cursors:
                    start = self._unseen_since(
                        self._changed_at.get(name), now, self._last_run.get(name), self._row_ids.get(name)
                    )
                    self.cursors[name] = start
                    resets.append((name, start))
                self._push(entry)
        except BaseException:
            self._marks = None  # half queued: the next load reads every row (not a baseline)
            raise
        gone = [name for name in self.cursors if name not in self._seen]
        for name in gone:
            self.cursors.pop(name, None)
        self.loaded_at = now
        return resets, gone

    def split_owed(
        self, resets: list[tuple[str, datetime]], now: datetime
    ) -> tuple[list[tuple[str, datetime]], list[tuple[str, datetime]]]:
        """A first load's new cursors: (those the fence's moment covers, the others).

        Covered: an entry started at the moment (the one kept from a predecessor, else this
        load's ``now``) whose row the moment's load read (its id is not above the kept one):
        a successor that finds the moment starts it there too, so its cursor can wait until
        after the first publication. Any other start (a ``last_run_at``, a change time, a row
        the moment's load never read) is written before it: a successor could not rebuild it."""
        moment = self.owed_from or now
        up_to = self.owed_up_to_id if self.owed_from is not None else None
        covered: list[tuple[str, datetime]] = []
        others: list[tuple[str, datetime]] = []
        for name, start in resets:
            row_id = self._row_ids.get(name)
            # A ``last_run_at`` decides before the moment (a successor would start there, even
            # where it is ahead of this load's now and the start came out at the moment).
            if (
                start == moment
                and self._last_run.get(name) is None
                and (up_to is None or (row_id is not None and row_id <= up_to))
            ):
                covered.append((name, start))
            else:
                others.append((name, start))
        return covered, others

    def _unseen_since(
        self,
        changed_at: datetime | None,
        now: datetime,
        last_run_at: datetime | None = None,
        row_id: int | None = None,
    ) -> datetime:
        """Where a new leader starts an entry that has no cursor yet.

        An entry that django-celery-beat's ``DatabaseScheduler`` has run (its ``last_run_at``
        is set) starts there: a site that switches to ``LockedScheduler`` handles an entry that
        is overdue by its misfire policy instead of skipping it silently.

        An entry created (or last changed) shortly before the previous leader died may never
        have been seen by it: that leader synced at most ``beat_sync_seconds`` before dying, and
        the takeover took up to a lease and a tick more. Such an entry is owed its slots from
        when it changed, so none is lost in the failover. Anything older without a cursor (a
        first start of the scheduler on an existing schedule) starts now: its past is not owed.

        Unless a leader started it before, then lost the lease (or died) before it had written
        the cursors of its first load (it publishes first): the fence holds where that leader
        started the entries without a cursor (``owed_from``, its load's time) and the highest
        row id its load read. An entry that existed then (its id is not above) starts where that
        leader started it, by the same rule at that moment, whatever edits its row had since (a
        restarted beat re-saves its ``CELERY_BEAT_SCHEDULE`` rows; a pause stamps the row): the
        slots it owed from then are not lost. An entry created since then is one that leader
        never saw, as above.
        """
        if last_run_at is not None:
            return min(last_run_at, now)
        unseen = timedelta(
            seconds=self.conf.beat_sync_seconds + self.conf.beat_lease_seconds + self.conf.beat_tick_seconds + 1
        )
        owed_from, up_to = self.owed_from, self.owed_up_to_id
        if owed_from is not None and (up_to is None or row_id is None or row_id <= up_to):
            if changed_at is not None and changed_at >= owed_from - unseen:
                return min(changed_at, owed_from, now)
            return min(owed_from, now)
        if changed_at is None:
            return now
        if changed_at < now - unseen:
            return now
        return min(changed_at, now)

    def pop_due(self, now: datetime) -> list[SlotEntry]:
        due: dict[str, SlotEntry] = {}
        while self.heap and self.heap[0][0] <= now:
            _slot, name, generation = heapq.heappop(self.heap)
            entry = self.entries.get(name)
            if entry is not None and entry.generation == generation:
                due[name] = entry
        return list(due.values())

    def reschedule(self, entries: Iterable[SlotEntry]) -> None:
        for entry in entries:
            self._push(entry)

    def next_due(self) -> datetime | None:
        while self.heap:
            slot, name, generation = self.heap[0]
            entry = self.entries.get(name)
            if entry is not None and entry.generation == generation:
                return slot
            heapq.heappop(self.heap)
        return None


#: The schedule tables ``ScheduleTable._read_marks`` reads whole, with the columns a slot depends on.
_SCHEDULES: tuple[tuple[Any, tuple[str, ...]], ...] = (
    (IntervalSchedule, ("id", "every", "period")),
    (CrontabSchedule, ("id", "minute", "hour", "day_of_month", "month_of_year", "day_of_week", "timezone")),
    (ClockedSchedule, ("id", "clocked_time")),
    (SolarSchedule, ("id", "event", "latitude", "longitude")),
)

#: The rows whose change stamps ``ScheduleTable.unchanged`` compares: (kind, model, field).
_STAMPED = (("task", PeriodicTask, "date_changed"), ("job", JobDefinition, "updated_at"))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def read_owed_from(lock_name: str) -> tuple[datetime | None, int | None]:
    """Where the entries without a cursor start and the highest row id that owes it, if a
    leader of ``lock_name`` had not written the cursors of its first load when it stopped
    leading (``SchedulerFence.cursors_owed_from``, ``cursors_owed_up_to_id``)."""
    row = (
        SchedulerFence.objects.filter(name=lock_name).values_list("cursors_owed_from", "cursors_owed_up_to_id").first()
    )
    return (row[0], row[1]) if row is not None else (None, None)


def read_cursors() -> dict[str, datetime]:
    """Every entry's cursor. On PostgreSQL as whole seconds and microseconds since the epoch:
    parsing 100,000 timestamps took a second of a takeover."""
    if connection.vendor != "postgresql":
        return dict(ScheduleCursor.objects.values_list("name", "last_slot"))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name, EXTRACT(EPOCH FROM date_trunc('second', last_slot))::bigint, "
            "mod(EXTRACT(MICROSECONDS FROM last_slot)::bigint, 1000000)::int "
            f"FROM {ScheduleCursor._meta.db_table}"
        )
        rows = cursor.fetchall()
    return {name: _EPOCH + timedelta(seconds=seconds, microseconds=micros) for name, seconds, micros in rows}


#: Loads in progress with the collector paused, and whether it was on before the first.
_paused = {"count": 0, "was_enabled": False}
_paused_lock = threading.Lock()


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a load turns rows into entries (CPU work
    only, no query but the lease renewals): a load of 100,000 entries allocates millions of
    objects, none of them garbage, and the collections they set off took 1.5 s of its 5.3 s.
    Reference counting frees as usual meanwhile. The switch is process-wide, so loads on two
    threads (a follower's warm-up, a takeover) count: the last one out switches it on again,
    if it was on before the first."""
    with _paused_lock:
        if _paused["count"] == 0:
            _paused["was_enabled"] = gc.isenabled()
            gc.disable()
        _paused["count"] += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused["count"] -= 1
            if _paused["count"] == 0 and _paused["was_enabled"]:
                gc.enable()


def _read_rows(
    query: Any, keep_alive: Callable[[], None] | None, then: Callable[[], Any] = lambda: None
) -> list[dict[str, Any]]:
    """The rows of a ``values()`` query, with ``keep_alive`` called every ``KEEP_ALIVE_EVERY``
    rows read: at 100,000 entries the read alone can outlast a lease on a busy host.

    On PostgreSQL the query runs on the connection's own cursor with psycopg's time-stamp
    loader: Django registers a Python subclass of it (to set the time zone), which cannot use
    psycopg's C implementation and took three quarters of the read (4 s at 100,000 entries,
    of which 3 s parsing time stamps). Both return the same instants; the schedule code reads
    only instants and the text of the other columns (django-timezone-field's zone objects come
    back as their names, which ``build_schedule`` uses). ``then`` is called once the query has
    run, before its rows are converted."""
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if connection.vendor != "postgresql" or not is_psycopg3:
        # Django's own read, which fetches as it goes: the pause starts once every row is here.
        rows = []
        for index, row in enumerate(query.iterator(chunk_size=KEEP_ALIVE_EVERY)):
            if keep_alive is not None and index % KEEP_ALIVE_EVERY == 0:
                keep_alive()
            rows.append(row)
        then()
        return rows
    from psycopg.types.datetime import TimestamptzLoader  # PostgreSQL only: an optional dependency

    names = [*query.query.extra_select, *query.query.values_select, *query.query.annotation_select]  # as Django's
    sql, params = query.query.sql_with_params()
    rows = []
    with connection.cursor() as cursor:
        cursor.cursor.adapters.register_loader("timestamptz", TimestamptzLoader)  # this cursor only
        cursor.execute(sql, params)
        then()
        while chunk := cursor.fetchmany(KEEP_ALIVE_EVERY):
            if keep_alive is not None:
                keep_alive()
            rows.extend(dict(zip(names, values, strict=True)) for values in chunk)
    return rows


def _at_or_after(at: datetime | None, since: datetime) -> bool:
    return at is not None and at >= since


def _latest(stamps: Iterable[datetime]) -> tuple[int, datetime | None]:
    """How many stamps, and the latest (what ``unchanged``'s aggregate returns)."""
    values = list(stamps)
    return len(values), max(values, default=None)


def _loads_safely(text: str | None) -> Any:
    try:
        return _loads(text, [])
    except ValueError:
        return []


def _shadowed_trigger(row: dict[str, Any], linked: set[str]) -> str:
    """Why a plain ``trigger_job`` row must not run (its job has a linked schedule), or ""."""
    if row["task"] != TRIGGER_TASK or row["job__id"] is not None:
        return ""
    args = _loads_safely(row["args"])
    if args and isinstance(args[0], str) and args[0] in linked:
        return f"job {args[0]!r} already has its own schedule (job:{args[0]}); running both would run it twice"
    return ""


def _job_of(row: dict[str, Any], jobs_by_slug: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if row["job__id"] is not None:
        return {
            "id": row["job__id"],
            "slug": row["job__slug"],
            "enabled": row["job__enabled"],
            "misfire_policy": row["job__misfire_policy"],
            "catch_up_window_seconds": row["job__catch_up_window_seconds"],
        }
    if row["task"] == TRIGGER_TASK:
        args = _loads_safely(row["args"])
        if args and isinstance(args[0], str):
            return jobs_by_slug.get(args[0])
    return None
