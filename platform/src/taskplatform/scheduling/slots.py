"""Schedule slots: the instants at which a periodic job is due, the same in every process.

A slot is a UTC instant computed from the schedule alone — never from a process's memory of
when it last ran — so every beat process, and every leader after a failover, names the
same slots and the ledger recognises a second publication of one (``"<job>@<slot>"``).

- :class:`Crontab`: cron fields in an explicit IANA time zone. Day-of-month and day-of-week
  must both match, as in Celery's ``crontab``. Daylight-saving time follows Vixie cron:

  * a job with a specific hour (``30 2 * * *``) runs once per local day: a local time that
    does not exist (spring forward) runs at the first instant after the gap; a local time
    that happens twice (fall back) runs at its first occurrence only;
  * a job whose hour field is a wildcard (``*`` or ``*/n``) follows real time: a skipped
    local time has no slot, and a repeated local time has two.

- :class:`Interval`: every N seconds of real time, counted from a fixed anchor (the
  schedule's start time, else the Unix epoch), so slot times survive restarts and leaders.
- :class:`Clocked`: one slot at one instant.

:func:`plan_due` turns the slots owed since a cursor into what to publish now, following a
job's misfire policy (``skip``, ``run_once``, ``catch_up``).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from itertools import islice
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import ParseException
from celery.schedules import crontab as celery_crontab

from ..domain.policies import MisfirePolicy
from ..exceptions import ConfigurationError

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: How far ahead a crontab search looks for its next matching day (covers ``0 0 29 2 *``).
MAX_SEARCH_DAYS = 366 * 8 + 2


def slot_key(name: str, slot: datetime) -> str:
    """The idempotency key of one slot of a job: ``"<name>@<UTC ISO-8601>"``."""
    return f"{name}@{format_slot(slot)}"


def format_slot(slot: datetime) -> str:
    slot = _aware(slot, "a slot")
    text = slot.strftime("%Y-%m-%dT%H:%M:%S")
    if slot.microsecond:
        text += f".{slot.microsecond:06d}"
    return text + "Z"


def _aware(value: datetime, what: str) -> datetime:
    if value.tzinfo is None:
        raise ValueError(f"{what} must be timezone-aware, not {value!r}")
    return value.astimezone(UTC)


class Schedule(ABC):
    """A deterministic sequence of UTC slots."""

    @abstractmethod
    def next_after(self, after: datetime) -> datetime | None:
        """The first slot strictly after ``after`` (aware), or None if there is none."""

    def slots(self, after: datetime, until: datetime) -> Iterator[datetime]:
        """Slots in ``(after, until]``, oldest first."""
        current = self.next_after(after)
        while current is not None and current <= until:
            yield current
            current = self.next_after(current)

    def last_at_or_before(self, moment: datetime, since: datetime) -> datetime | None:
        """The latest slot in ``(since, moment]``, or None."""
        last = None
        for slot in self.slots(since, moment):
            last = slot
        return last


@dataclass(frozen=True)
class Interval(Schedule):
    """Every ``every_seconds`` of real time from ``anchor`` (slots are ``anchor + k·every``)."""

    every_seconds: float
    anchor: datetime = EPOCH

    def __post_init__(self) -> None:
        if not 0 < self.every_seconds < 100 * 365 * 86_400:
            raise ConfigurationError(f"an interval must be positive, not {self.every_seconds!r} seconds")
        object.__setattr__(self, "anchor", _aware(self.anchor, "the interval anchor"))

    def next_after(self, after: datetime) -> datetime | None:
        after = _aware(after, "after")
        if after < self.anchor:
            return self.anchor
        step = timedelta(seconds=self.every_seconds)
        elapsed = after - self.anchor
        k = elapsed // step + 1
        return self.anchor + k * step

    def last_at_or_before(self, moment: datetime, since: datetime) -> datetime | None:
        moment = _aware(moment, "moment")
        if moment < self.anchor:
            return None
        step = timedelta(seconds=self.every_seconds)
        last = self.anchor + ((moment - self.anchor) // step) * step
        return last if last > _aware(since, "since") else None


@dataclass(frozen=True)
class Clocked(Schedule):
    """One slot, at ``at``."""

    at: datetime

    def __post_init__(self) -> None:
        object.__setattr__(self, "at", _aware(self.at, "the clocked time"))

    def next_after(self, after: datetime) -> datetime | None:
        return self.at if self.at > _aware(after, "after") else None


@dataclass(frozen=True)
class Crontab(Schedule):
    """Cron fields (Celery's syntax: ranges, steps, lists, day names) in an IANA time zone."""

    minute: str = "*"
    hour: str = "*"
    day_of_month: str = "*"
    month_of_year: str = "*"
    day_of_week: str = "*"
    timezone: str = "UTC"
    _tz: ZoneInfo = field(init=False, repr=False, compare=False)
    _minutes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _hours: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _days: frozenset[int] = field(init=False, repr=False, compare=False)
    _months: frozenset[int] = field(init=False, repr=False, compare=False)
    _weekdays: frozenset[int] = field(init=False, repr=False, compare=False)
    _real_time: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            spec: Any = celery_crontab(
                minute=self.minute,
                hour=self.hour,
                day_of_week=self.day_of_week,
                day_of_month=self.day_of_month,
                month_of_year=self.month_of_year,
            )
        except (ValueError, TypeError, ParseException) as exc:
            raise ConfigurationError(f"invalid crontab {self.expression!r}: {exc}") from None
        try:
            tz = ZoneInfo(str(self.timezone))
        except (ZoneInfoNotFoundError, ValueError):
            raise ConfigurationError(f"unknown time zone {self.timezone!r} (use an IANA name)") from None
        object.__setattr__(self, "_tz", tz)
        object.__setattr__(self, "_minutes", tuple(sorted(spec.minute)))
        object.__setattr__(self, "_hours", tuple(sorted(spec.hour)))
        object.__setattr__(self, "_days", frozenset(spec.day_of_month))
        object.__setattr__(self, "_months", frozenset(spec.month_of_year))
        object.__setattr__(self, "_weekdays", frozenset(d % 7 for d in spec.day_of_week))
        # Vixie cron: a wildcard hour follows real time; a specific hour runs once a day.
        object.__setattr__(self, "_real_time", str(self.hour).strip().startswith("*"))

    @property
    def expression(self) -> str:
        return f"{self.minute} {self.hour} {self.day_of_month} {self.month_of_year} {self.day_of_week}"

    @property
    def tz(self) -> ZoneInfo:
        return self._tz

    def _day_matches(self, day: date) -> bool:
        return day.month in self._months and day.day in self._days and day.isoweekday() % 7 in self._weekdays

    def _hour_instants(self, day: date, hour: int) -> list[datetime]:
        """The slots of one local hour of one day, in UTC, sorted and without repeats."""
        start = datetime(day.year, day.month, day.day, hour)
        end = start.replace(minute=59)
        ends = {dt.replace(tzinfo=self.tz, fold=f).astimezone(UTC) for dt in (start, end) for f in (0, 1)}
        if len(ends) == 2:  # no transition within this hour: minutes map one to one
            base = min(ends)
            return [base + timedelta(minutes=m) for m in self._minutes]
        found: set[datetime] = set()
        for minute in self._minutes:
            found.update(self._local_to_utc(datetime(day.year, day.month, day.day, hour, minute)))
        return sorted(found)

    def _hour_ends_by(self, day: date, hour: int, moment: datetime) -> bool:
        """True if every slot of this local hour is at or before ``moment`` (a cheap bound)."""
        naive = datetime(day.year, day.month, day.day, hour, 59, 59)
        latest = max(naive.replace(tzinfo=self.tz, fold=f).astimezone(UTC) for f in (0, 1))
        return latest <= moment

    def _local_to_utc(self, naive: datetime) -> list[datetime]:
        tz = self.tz
        first = naive.replace(tzinfo=tz, fold=0)
        second = naive.replace(tzinfo=tz, fold=1)
        u_first, u_second = first.astimezone(UTC), second.astimezone(UTC)
        if u_first == u_second:  # an ordinary local time
            return [u_first]
        exists = u_first.astimezone(tz).replace(tzinfo=None) == naive
        if exists:  # the repeated hour: fold 0 is the first occurrence
            return [u_first, u_second] if self._real_time else [u_first]
        if self._real_time:  # a local time that never happens has no slot
            return []
        # Skipped by a spring-forward: run at the first instant after the gap. For a gap,
        # fold=1 lands before the transition and fold=0 after it; bisect to the second.
        low, high = min(u_first, u_second), max(u_first, u_second)
        while high - low > timedelta(seconds=1):
            mid = low + (high - low) / 2
            mid = mid.replace(microsecond=0)
            if mid <= low:
                break
            if self._offset_changes_between(low, mid):
                high = mid
            else:
                low = mid
        return [self._transition_in(low, high)]

    def _offset_changes_between(self, a: datetime, b: datetime) -> bool:
        return a.astimezone(self.tz).utcoffset() != b.astimezone(self.tz).utcoffset()

    def _transition_in(self, low: datetime, high: datetime) -> datetime:
        """The first instant of ``(low, high]`` (one second apart at most) with the new offset."""
        return high if self._offset_changes_between(low, high) else low

    def next_after(self, after: datetime) -> datetime | None:
        after = _aware(after, "after")
        # Local hours map to non-decreasing UTC instants (a skipped time maps to the end of
        # its gap, a repeated hour sorts within itself), so the first hour holding a slot
        # after ``after`` holds the answer. Start a day early for zones east of UTC.
        local = after.astimezone(self.tz)
        day = local.date() - timedelta(days=1)
        for _ in range(MAX_SEARCH_DAYS):
            if self._day_matches(day) and not self._hour_ends_by(day, 23, after):
                # Wall time never jumps by more than a few hours: earlier hours of the
                # current local day cannot hold a later instant.
                first_hour = local.hour - 3 if day == local.date() else 0
                for hour in self._hours:
                    if hour < first_hour or self._hour_ends_by(day, hour, after):
                        continue
                    for instant in self._hour_instants(day, hour):
                        if instant > after:
                            return instant
            day += timedelta(days=1)
        return None


@dataclass(frozen=True)
class DuePlan:
    """What to publish for one schedule entry now, and where its cursor moves."""

    publish: tuple[datetime, ...]
    #: Slots that were owed but are dropped by the policy (skipped, coalesced, beyond the window).
    dropped: int
    cursor: datetime


def plan_due(
    schedule: Schedule,
    *,
    cursor: datetime,
    now: datetime,
    policy: MisfirePolicy | str,
    grace_seconds: float,
    catch_up_window_seconds: float,
    limit: int = 10_000,
) -> DuePlan:
    """The slots in ``(cursor, now]`` to publish, by misfire policy.

    When every owed slot is less than ``grace_seconds`` late (an ordinary tick, a failover
    gap), all of them are published. When some are older, they were missed while no beat
    published, and the policy decides:

    - ``skip``: the missed slots are dropped; the on-time ones are published;
    - ``run_once``: the whole owed backlog, on-time slots included, collapses into one
      execution keyed by the latest owed slot (a second leader names the same slot);
    - ``catch_up``: every slot back to ``catch_up_window_seconds`` is published, older ones
      are dropped.

    Only the tail of a long backlog is walked (a year-long outage of a per-second job costs
    no more than the slots kept). ``limit`` bounds the slots of one plan; the cursor then
    stops at the last one planned and the next plan continues from there.
    """
    policy = MisfirePolicy(policy)
    first = schedule.next_after(cursor)
    if first is None or first > now:
        return DuePlan((), 0, cursor)
    grace_start = now - timedelta(seconds=grace_seconds)
    if first >= grace_start:  # nothing missed
        owed = list(islice(schedule.slots(cursor, now), limit))
        return DuePlan(tuple(owed), 0, owed[-1])
    if policy is MisfirePolicy.RUN_ONCE:
        latest = schedule.last_at_or_before(now, cursor) or first
        return DuePlan((latest,), count_between(schedule, cursor, latest, cap=limit, inclusive=False), latest)
    start = grace_start
    if policy is MisfirePolicy.CATCH_UP:
        start = min(grace_start, now - timedelta(seconds=catch_up_window_seconds))
    since = max(cursor, start - timedelta(microseconds=1))
    kept = list(islice(schedule.slots(since, now), limit))
    dropped = count_between(schedule, cursor, start, cap=limit, inclusive=False)
    if not kept:  # every owed slot was dropped: the cursor moves to the last of them
        return DuePlan((), dropped, schedule.last_at_or_before(now, cursor) or first)
    return DuePlan(tuple(kept), dropped, kept[-1])


def count_between(schedule: Schedule, after: datetime, until: datetime, *, cap: int, inclusive: bool = True) -> int:
    """Slots in ``(after, until]`` (``(after, until)`` if not inclusive), counted up to ``cap``."""
    n = 0
    for slot in schedule.slots(after, until):
        if not inclusive and slot >= until:
            break
        n += 1
        if n >= cap:
            break
    return n


@dataclass(frozen=True)
class Bounded(Schedule):
    """A schedule with no slot before ``not_before`` or after ``not_after`` (start time, expiry)."""

    inner: Schedule
    not_before: datetime | None = None
    not_after: datetime | None = None

    def next_after(self, after: datetime) -> datetime | None:
        after = _aware(after, "after")
        if self.not_before is not None and after < self.not_before:
            after = self.not_before - timedelta(microseconds=1)
        upcoming = self.inner.next_after(after)
        if upcoming is not None and self.not_after is not None and upcoming > self.not_after:
            return None
        return upcoming


#: Seconds per django-celery-beat ``IntervalSchedule.period``.
PERIOD_SECONDS: dict[str, float] = {"days": 86_400, "hours": 3600, "minutes": 60, "seconds": 1, "microseconds": 1e-6}


def parse_cron(expression: str, timezone_name: str) -> Crontab:
    """``"minute hour day-of-month month day-of-week"`` in ``timezone_name``; ConfigurationError if bad."""
    parts = expression.split()
    if len(parts) != 5:
        raise ConfigurationError(
            f"a cron expression has 5 fields (minute hour day-of-month month day-of-week), not {len(parts)}: "
            f"{expression!r}"
        )
    minute, hour, day_of_month, month_of_year, day_of_week = parts
    return Crontab(minute, hour, day_of_month, month_of_year, day_of_week, timezone=timezone_name)


def merge_next(schedules: dict[str, tuple[Schedule, datetime]]) -> list[tuple[datetime, str]]:
    """A heap of ``(next slot, name)`` for ``{name: (schedule, after)}``; names with no slot left are left out."""
    heap = []
    for name, (schedule, after) in schedules.items():
        upcoming = schedule.next_after(after)
        if upcoming is not None:
            heap.append((upcoming, name))
    heapq.heapify(heap)
    return heap
