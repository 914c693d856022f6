"""Crontab slots against cronsim, an independent cron implementation, over many zones and years.

cronsim (pinned in requirements/test.txt) evaluates cron expressions the way Debian's cron does,
and Debian's cron is Vixie cron: its daylight-saving rule is the one ``slots.py`` implements.
Read from cronsim 2.8's source (``CronSim.__init__``, ``__next__``):

- a 5-field expression whose minute AND hour fields both do not start with ``*`` iterates naive
  wall times: a repeated wall time is returned with ``fold=0`` (its first occurrence), a
  non-existent one is moved forward a minute at a time to the first wall time that exists;
- any other expression ticks in real time (UTC) and returns every instant whose wall time
  matches: no slot for a skipped wall time, two for a repeated one.

So the two must produce the same sequence of next slots, except for the divergences listed in
docs/beat.md ("Differences from cronsim"), each encoded below as a narrow check of its exact
shape (:func:`expected_dom_and_dow`, :func:`lord_howe_hour_step`), never as a skip.

Windows: 25 hours either side of every offset change of 2024-2027 in each zone (found here
with zoneinfo, not with the code under test), random two-day windows in those years, one
month of day-of-month/day-of-week combinations, and a long look-ahead for ``0 0 29 2 *``.
A window never starts inside a repeated stretch: cronsim keeps a specific-time job's position
as a naive wall time, which cannot say which pass it is in.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta
from functools import cache
from itertools import islice
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from taskplatform.scheduling.slots import parse_cron

LORD_HOWE = "Australia/Lord_Howe"
ZONES = [
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Australia/Sydney",
    "Pacific/Chatham",  # +12:45 / +13:45: the repeated and skipped stretch straddles two local hours
    LORD_HOWE,  # a 30-minute shift
    "America/Santiago",  # changes at local midnight
    "Asia/Kolkata",  # +05:30, no DST
    "Africa/Casablanca",  # +01 with a "negative DST" to +00 during Ramadan
    "Europe/London",
]
YEARS = range(2024, 2028)

# Real time: the minute or the hour field starts with ``*`` (Vixie cron's MIN_STAR | HR_STAR).
REAL_TIME = [
    "* * * * *",
    "*/15 * * * *",
    "15 * * * *",
    "0 */2 * * *",
    "*/20 2 * * *",
    "*/5 1-3 * * *",
    "*/10 0 * * *",
    "*/30 3 * * *",
]
# Specific time: both fields are numbers, lists, ranges or steps of a range.
SPECIFIC = [
    "30 2 * * *",
    "0 2 * * *",
    "0 3 * * *",
    "45 2 * * *",
    "15 1-3 * * *",
    "0,15,30,45 2 * * *",
    "0,30 0-3 * * *",
    "0-40/20 2 * * *",
    "0 0 * * *",
    "30 0 * * *",
    "0 1 * * *",
    "30 23 * * *",
]
# Calendar fields (at most one of day-of-month and day-of-week restricted).
CALENDAR = [
    "5 0 * * 0",
    "0 9 * * 1,3,5",
    "0 0 * * 1-5",
    "0 12 1 * *",
    "30 3 * 3,10 *",
    "0 0 * 2 *",
    "0 0 31 * *",
    "0 0 29 2 *",
    "*/30 * 1 1 *",
]
# Day-of-month AND day-of-week restricted: (day-of-month values, day-of-week values, 0 = Sunday).
DOM_AND_DOW: dict[str, tuple[frozenset[int], frozenset[int]]] = {
    "0 0 13 * 5": (frozenset({13}), frozenset({5})),
    "0 0 1,15 * 1": (frozenset({1, 15}), frozenset({1})),
    "0 8 1-7 * 1": (frozenset(range(1, 8)), frozenset({1})),
}
EXPRESSIONS = [*REAL_TIME, *SPECIFIC, *CALENDAR, *DOM_AND_DOW]


def transitions(zone: str) -> list[datetime]:
    """The instants of ``YEARS`` at which the zone's UTC offset changes (first instant of the new offset).

    Probed hourly with zoneinfo and refined to the minute (every transition of these zones and
    years is on a whole minute).
    """
    tz = ZoneInfo(zone)

    def offset(instant: datetime) -> timedelta | None:
        return instant.astimezone(tz).utcoffset()

    found = []
    instant = datetime(YEARS[0], 1, 1, tzinfo=UTC)
    end = datetime(YEARS[-1] + 1, 1, 1, tzinfo=UTC)
    while instant < end:
        following = instant + timedelta(hours=1)
        if offset(following) != offset(instant):
            minute = next(m for m in range(1, 61) if offset(instant + timedelta(minutes=m)) != offset(instant))
            found.append(instant + timedelta(minutes=minute))
        instant = following
    return found


def ours(expression: str, zone: str, after: datetime, until: datetime) -> list[datetime]:
    return list(parse_cron(expression, zone).slots(after, until))


def cronsims(expression: str, zone: str, after: datetime, until: datetime) -> list[datetime]:
    """cronsim's next slots after ``after`` up to ``until``, as UTC instants."""
    found = []
    for moment in CronSim(expression, after.astimezone(ZoneInfo(zone))):
        instant = moment.astimezone(UTC)
        if instant > until:
            break
        found.append(instant)
    return found


def unambiguous(zone: str, instant: datetime) -> datetime:
    """``instant``, or 3 hours earlier if its wall time happens twice (see the module docstring)."""
    tz = ZoneInfo(zone)
    wall = instant.astimezone(tz).replace(tzinfo=None)
    if wall.replace(tzinfo=tz, fold=0).utcoffset() != wall.replace(tzinfo=tz, fold=1).utcoffset():
        return instant - timedelta(hours=3)
    return instant


# --- the documented divergences (docs/beat.md, "Differences from cronsim") ---------------------------


def expected_dom_and_dow(expression: str, zone: str, theirs: list[datetime]) -> list[datetime]:
    """Divergence 1: with both day fields restricted, cron runs on days matching EITHER, Celery BOTH.

    Our slots must be exactly cronsim's slots on the days where both fields match.
    """
    days, weekdays = DOM_AND_DOW[expression]
    tz = ZoneInfo(zone)
    return [s for s in theirs if (d := s.astimezone(tz).date()).day in days and d.isoweekday() % 7 in weekdays]


def lord_howe_hour_step(
    expression: str, zone: str, mine: list[datetime], theirs: list[datetime], changes: Iterable[datetime]
) -> bool:
    """Divergence 2: cronsim skips the first half hour of the first matching hour after a Lord Howe change.

    cronsim's ``advance_hour`` puts the wall clock on ``:00`` and steps whole real hours; across
    Lord Howe's 30-minute shift it lands on ``:30`` and never sees ``:00``-``:29`` of the next
    matching hour. This is exactly that shape: a real-time expression with a restricted hour,
    cronsim's slots a subset of ours, and the extra ones being the ``:00``-``:29`` slots of our
    first matching local hour after one change.
    """
    minute, hour = expression.split()[:2]
    if zone != LORD_HOWE or hour == "*" or not (minute.startswith("*") or hour.startswith("*")):
        return False
    extra = sorted(set(mine) - set(theirs))
    if not extra or not set(theirs) <= set(mine):
        return False
    tz = ZoneInfo(zone)
    for change in changes:
        after_change = [s.astimezone(tz) for s in mine if s > change]
        if not after_change:
            continue
        first = after_change[0]
        shape = [
            s.astimezone(UTC)
            for s in after_change
            if (s.date(), s.hour) == (first.date(), first.hour) and s.minute < 30
        ]
        if shape == extra:
            return True
    return False


# --- the comparison -----------------------------------------------------------------------------------


def compare(
    zone: str, expression: str, after: datetime, until: datetime, changes: list[datetime], used: dict[str, int]
) -> str | None:
    """None if our slots match cronsim's (up to a documented divergence), else a description."""
    mine, theirs = ours(expression, zone, after, until), cronsims(expression, zone, after, until)
    if mine == theirs:
        return None
    if expression in DOM_AND_DOW and mine == expected_dom_and_dow(expression, zone, theirs):
        used["dom-and-dow"] += 1
        return None
    if lord_howe_hour_step(expression, zone, mine, theirs, changes):
        used["lord-howe-hour-step"] += 1
        return None
    tz = ZoneInfo(zone)
    only_ours = [s.astimezone(tz).isoformat() for s in sorted(set(mine) - set(theirs))][:5]
    only_theirs = [s.astimezone(tz).isoformat() for s in sorted(set(theirs) - set(mine))][:5]
    window = f"({after.isoformat()}, {until.isoformat()}]"
    return f"{zone} {expression!r} {window}: ours only {only_ours}, cronsim only {only_theirs}"


@cache
def changes_of(zone: str) -> list[datetime]:
    return transitions(zone)


@pytest.mark.parametrize("zone", ZONES)
def test_slots_match_cronsim_around_every_dst_change_and_on_random_days(zone: str) -> None:
    changes = changes_of(zone)
    if zone in ("UTC", "Asia/Kolkata"):
        assert changes == []
    else:  # two a year (Casablanca: around Ramadan), or the test is not looking where it should
        assert len(changes) == 2 * len(YEARS), changes
    rng = random.Random(f"slots-differential-{zone}")
    windows: list[tuple[datetime, datetime, list[str]]] = []
    for change in changes:
        windows.append((change - timedelta(hours=25), change + timedelta(hours=25), EXPRESSIONS[1:]))
        windows.append((change - timedelta(hours=3), change + timedelta(hours=3), EXPRESSIONS[:1]))
    for _ in range(6):
        start = datetime(YEARS[0], 1, 1, tzinfo=UTC) + timedelta(seconds=rng.randrange(len(YEARS) * 365 * 86400))
        start = unambiguous(zone, start)
        windows.append((start, start + timedelta(days=2), EXPRESSIONS[1:]))
        windows.append((start, start + timedelta(hours=6), EXPRESSIONS[:1]))
    # A month with a Friday the 13th, the 1st and 15th, and a first Monday (February 2026).
    windows.append((datetime(2026, 1, 31, tzinfo=UTC), datetime(2026, 3, 2, tzinfo=UTC), [*DOM_AND_DOW, *CALENDAR]))

    used = {"dom-and-dow": 0, "lord-howe-hour-step": 0}
    mismatches = [
        problem
        for after, until, expressions in windows
        for expression in expressions
        if (problem := compare(zone, expression, after, until, changes, used))
    ]

    assert mismatches == [], "\n".join(mismatches)
    # The documented divergences are real (a cronsim upgrade that removes one must update docs/beat.md).
    assert used["dom-and-dow"] > 0
    assert (used["lord-howe-hour-step"] > 0) == (zone == LORD_HOWE)


@pytest.mark.parametrize("zone", ZONES)
def test_february_29_matches_cronsim_years_ahead(zone: str) -> None:
    after = datetime(2024, 3, 1, tzinfo=UTC)
    mine = list(islice(parse_cron("0 0 29 2 *", zone).slots(after, datetime(2040, 1, 1, tzinfo=UTC)), 3))
    theirs = CronSim("0 0 29 2 *", after.astimezone(ZoneInfo(zone)))
    assert mine == [next(theirs).astimezone(UTC) for _ in range(3)]
    assert [m.astimezone(ZoneInfo(zone)).date() for m in mine] == [
        date(2028, 2, 29),
        date(2032, 2, 29),
        date(2036, 2, 29),
    ]
