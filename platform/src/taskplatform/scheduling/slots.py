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
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from functools import lru_cache
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
    if value.tzinfo is UTC:  # most values: the scheduler's own and the database's
        return value
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


#: Answers a ``Crontab`` remembers (``next_after``), cleared when full.
MEMO_SIZE = 256


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
    #: ``next_after``'s recent answers: a crontab is shared by every entry with its expression
    #: and zone, and those entries' cursors are mostly the same slot (a takeover queues
    #: 100,000 entries; the scale mix's 30,000 crontab entries use 8,640 crontabs).
    _memo: dict[datetime, datetime | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.expression.isascii():
            # int() reads any Unicode digit (U+0665 is 5); a schedule is written in ASCII or refused.
            raise ConfigurationError(f"invalid crontab {self.expression!r}: only ASCII characters are allowed")
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
        # Vixie cron (and Debian's, and cronsim): a job whose minute or hour field starts with
        # ``*`` follows real time; one with a specific minute and hour runs once per wall time.
        real_time = str(self.minute).strip().startswith("*") or str(self.hour).strip().startswith("*")
        object.__setattr__(self, "_real_time", real_time)
        object.__setattr__(self, "_memo", {})

    @property
    def expression(self) -> str:
        return f"{self.minute} {self.hour} {self.day_of_month} {self.month_of_year} {self.day_of_week}"

    @property
    def tz(self) -> ZoneInfo:
        return self._tz

    def _day_matches(self, day: date) -> bool:
        return day.month in self._months and day.day in self._days and day.isoweekday() % 7 in self._weekdays

    def _next_wall(self, start: datetime, last_day: date) -> datetime | None:
        """The first local wall time (naive, whole minute) at or after ``start`` that the fields match.

        Pure calendar arithmetic, blind to the zone: which of these wall times happen, and
        when, is :meth:`next_after`'s business.
        """
        day, first_hour, first_minute = start.date(), start.hour, start.minute
        while day <= last_day:
            if self._day_matches(day):
                for hour in self._hours[bisect_left(self._hours, first_hour) :]:
                    i = bisect_left(self._minutes, first_minute if hour == first_hour else 0)
                    if i < len(self._minutes):
                        return datetime.combine(day, time(hour, self._minutes[i]))
            day += timedelta(days=1)
            first_hour = first_minute = 0
        return None

    def next_after(self, after: datetime) -> datetime | None:
        """Walk the stretches of constant UTC offset from ``after`` on, in real time.

        Within one stretch local wall time is UTC plus a constant, so the first matching wall
        time of the stretch is its first slot. No assumption is made about how local hours
        order in UTC (Pacific/Chatham repeats 02:45-03:44, across two local hours). At a
        transition, Vixie cron's rule applies (see the module docstring): a real-time job
        simply continues on the new wall clock; a specific-time job runs a wall time skipped
        by a spring-forward once, at the transition, and does not run again the wall times a
        fall-back repeats.
        """
        after = _aware(after, "after")
        try:
            return self._memo[after]
        except KeyError:
            pass
        upcoming = self._next_after(after)
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        self._memo[after] = upcoming
        return upcoming

    def _next_after(self, after: datetime) -> datetime | None:
        tz = self.tz
        offset = _offset(tz, after)
        wall = after.replace(tzinfo=None) + offset
        last_day = min(wall.date() + timedelta(days=MAX_SEARCH_DAYS), date.max - timedelta(days=2))
        bound = _minute_ceil(wall + timedelta(microseconds=1))  # strictly after ``after``
        if not self._real_time:
            previous = _last_transition_at_or_before(tz, after)
            if previous is not None and previous.before > previous.after:
                # ``after`` may sit in the second pass of a repeated stretch: those wall
                # times already ran in the first pass.
                bound = max(bound, _minute_ceil(_wall(previous.at, previous.before)))
        stretch_start = after
        candidate = self._next_wall(bound, last_day)
        while candidate is not None:
            instant = (candidate - offset).replace(tzinfo=UTC)
            change = _first_transition_in(tz, stretch_start, instant)
            if change is None:  # the offset holds up to the candidate: its wall time is real
                return instant
            # The candidate lies beyond this stretch; continue on the far side of ``change``.
            skipped = change.after > change.before and candidate < _wall(change.at, change.after)
            if skipped and not self._real_time:  # a wall time the spring-forward skipped
                return change.at
            offset, stretch_start = change.after, change.at
            new_bound = _minute_ceil(_wall(change.at, change.after))
            if not self._real_time:
                new_bound = max(new_bound, _minute_ceil(_wall(change.at, change.before)))
            if new_bound < bound or candidate < new_bound:
                candidate = self._next_wall(new_bound, last_day)
            bound = new_bound
        return None


@dataclass(frozen=True)
class _Transition:
    """A change of UTC offset: from ``at`` on, wall time is UTC + ``after`` instead of + ``before``."""

    at: datetime
    before: timedelta
    after: timedelta


#: Offset probes are this far apart; :func:`_transitions_in_year` then bisects to the second.
#: No zone in tzdata has changed its offset twice within 95 hours since 1900, so one probe
#: interval never hides two changes.
_PROBE_SECONDS = 6 * 3600


def _offset(tz: ZoneInfo, instant: datetime) -> timedelta:
    offset = instant.astimezone(tz).utcoffset()
    assert offset is not None  # a ZoneInfo always has one
    return offset


def _wall(instant: datetime, offset: timedelta) -> datetime:
    """The naive local wall time of a UTC ``instant`` under ``offset``."""
    return instant.replace(tzinfo=None) + offset


def _minute_ceil(wall: datetime) -> datetime:
    floor = wall.replace(second=0, microsecond=0)
    return floor if floor == wall else floor + timedelta(minutes=1)


@lru_cache(maxsize=2048)
def _transitions_in_year(tz: ZoneInfo, year: int) -> tuple[_Transition, ...]:
    """The offset changes of ``tz`` in ``(year-01-01T00:00Z, (year+1)-01-01T00:00Z]``, oldest first.

    zoneinfo has no public list of transitions: probe the offset and bisect each change.
    """
    if not 1 <= year < 9999:
        return ()
    start = int(datetime(year, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(year + 1, 1, 1, tzinfo=UTC).timestamp())

    def offset_at(ts: int) -> timedelta:
        return _offset(tz, datetime.fromtimestamp(ts, UTC))

    found = []
    low, low_offset = start, offset_at(start)
    while low < end:
        high = min(low + _PROBE_SECONDS, end)
        high_offset = offset_at(high)
        if high_offset != low_offset:
            a, b = low, high  # offset_at(a) == low_offset != offset_at(b)
            while b - a > 1:
                mid = (a + b) // 2
                if offset_at(mid) == low_offset:
                    a = mid
                else:
                    b = mid
            found.append(_Transition(datetime.fromtimestamp(b, UTC), low_offset, high_offset))
        low, low_offset = high, high_offset
    return tuple(found)


def _first_transition_in(tz: ZoneInfo, start: datetime, end: datetime) -> _Transition | None:
    """The first offset change at an instant in ``(start, end]``, or None."""
    for year in range(start.year, end.year + 1):
        for change in _transitions_in_year(tz, year):
            if change.at > end:
                return None
            if change.at > start:
                return change
    return None


def _last_transition_at_or_before(tz: ZoneInfo, moment: datetime) -> _Transition | None:
    """The latest offset change at or before ``moment`` in its UTC year or the year before, or None.

    Older changes do not matter to :meth:`Crontab.next_after`: a fall-back repeats hours, not years.
    """
    for year in (moment.year, moment.year - 1):
        earlier = [change for change in _transitions_in_year(tz, year) if change.at <= moment]
        if earlier:
            return earlier[-1]
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
