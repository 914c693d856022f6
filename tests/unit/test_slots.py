"""Schedule slots are deterministic UTC instants: this file pins that contract.

- Crontab in an IANA zone follows Vixie cron across daylight-saving transitions: a job with a
  specific minute and hour runs once per local day (a skipped time at the first instant after
  the gap, a repeated time at its first occurrence); a job whose minute or hour field starts with
  ``*`` (``*``, ``*/n``) follows real time (no slot for a skipped time, two for a repeated one).
  Pacific/Chatham (+12:45/+13:45) repeats and skips 02:45-03:44, across two local hours. Expected
  instants are written out by hand from the 2026 transition rules of Berlin, New York, Sydney
  and Chatham, never computed by the code under test; each table row also states the local
  wall time it means, checked against tzdata, so a wrong row fails on its own.
  ``test_slots_differential.py`` compares with cronsim over many zones and years.
- Interval slots are ``anchor + k * every``, whoever computes them and from wherever.
- Clocked has one slot.
- ``plan_due`` applies the misfire policies (skip / run_once / catch_up) with a grace period and
  a catch-up window, bounds its work by ``limit``, and moves the cursor to the last owed slot.
- Bad input fails loudly: ``ConfigurationError`` for bad schedules, ``ValueError`` for naive times.
- ``slot_key`` names a slot in UTC with a trailing ``Z``, whatever the input's zone.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from taskplatform.exceptions import ConfigurationError
from taskplatform.scheduling.slots import (
    EPOCH,
    Bounded,
    Clocked,
    Crontab,
    DuePlan,
    Interval,
    MisfirePolicy,
    Schedule,
    format_slot,
    parse_cron,
    plan_due,
    slot_key,
)

BERLIN = "Europe/Berlin"
NEW_YORK = "America/New_York"
SYDNEY = "Australia/Sydney"
HOUR = timedelta(hours=1)


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> datetime:
    """A literal UTC instant (shorthand for the tables)."""
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def local_day_window(zone: str, day: date) -> tuple[datetime, datetime]:
    """``(after, until)`` for ``Schedule.slots`` covering the whole local day ``[00:00, next 00:00)``.

    Computed with zoneinfo directly (midnight is never ambiguous in these zones), not with the
    code under test.
    """
    tz = ZoneInfo(zone)
    start = datetime(day.year, day.month, day.day, tzinfo=tz).astimezone(UTC)
    nxt = day + timedelta(days=1)
    end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=tz).astimezone(UTC)
    return start - timedelta(microseconds=1), end - timedelta(microseconds=1)


def slots_of_local_day(schedule: Schedule, zone: str, day: date) -> list[datetime]:
    after, until = local_day_window(zone, day)
    return list(schedule.slots(after, until))


def walls(instants: tuple[datetime, ...] | list[datetime], zone: str) -> list[str]:
    """The local wall-clock readings (with offset) of UTC instants."""
    tz = ZoneInfo(zone)
    return [i.astimezone(tz).isoformat() for i in instants]


# --- crontab across daylight-saving time: specific hour (Vixie: once per local day) -----------------

# (zone, minute, hour, local day, every slot of that local day in UTC, what they read on the local wall)
SPECIFIC_HOUR: list[Any] = [
    # Berlin: CET +01:00 / CEST +02:00. Spring forward 2026-03-29 02:00 CET -> 03:00 CEST (01:00Z).
    pytest.param(
        BERLIN, "30", "2", date(2026, 3, 29), (utc(2026, 3, 29, 1, 0),), ("2026-03-29T03:00:00+02:00",),
        id="berlin-spring-forward-02:30-skipped-runs-at-03:00-CEST",
    ),
    pytest.param(
        BERLIN, "0", "2", date(2026, 3, 29), (utc(2026, 3, 29, 1, 0),), ("2026-03-29T03:00:00+02:00",),
        id="berlin-spring-forward-02:00-skipped-runs-at-03:00-CEST",
    ),
    # Berlin fall back 2026-10-25 03:00 CEST -> 02:00 CET (01:00Z): 02:00-02:59 happens twice.
    pytest.param(
        BERLIN, "30", "2", date(2026, 10, 25), (utc(2026, 10, 25, 0, 30),), ("2026-10-25T02:30:00+02:00",),
        id="berlin-fall-back-02:30-repeated-runs-once-at-first-CEST",
    ),
    pytest.param(
        BERLIN, "30", "2", date(2026, 3, 28), (utc(2026, 3, 28, 1, 30),), ("2026-03-28T02:30:00+01:00",),
        id="berlin-ordinary-day-before-spring-forward",
    ),
    pytest.param(
        BERLIN, "30", "2", date(2026, 10, 26), (utc(2026, 10, 26, 1, 30),), ("2026-10-26T02:30:00+01:00",),
        id="berlin-ordinary-day-after-fall-back",
    ),
    pytest.param(
        BERLIN,
        "30",
        "1,2,3",
        date(2026, 3, 29),
        (utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 0), utc(2026, 3, 29, 1, 30)),
        ("2026-03-29T01:30:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-29T03:30:00+02:00"),
        id="berlin-spring-forward-hour-list-only-the-skipped-hour-moves",
    ),
    # New York: EST -05:00 / EDT -04:00. Spring forward 2026-03-08 02:00 EST -> 03:00 EDT (07:00Z).
    pytest.param(
        NEW_YORK, "30", "2", date(2026, 3, 8), (utc(2026, 3, 8, 7, 0),), ("2026-03-08T03:00:00-04:00",),
        id="new-york-spring-forward-02:30-skipped-runs-at-03:00-EDT",
    ),
    pytest.param(
        NEW_YORK, "45", "2", date(2026, 3, 8), (utc(2026, 3, 8, 7, 0),), ("2026-03-08T03:00:00-04:00",),
        id="new-york-spring-forward-02:45-skipped-runs-at-03:00-EDT-not-03:45",
    ),
    # New York fall back 2026-11-01 02:00 EDT -> 01:00 EST (06:00Z): 01:00-01:59 happens twice.
    pytest.param(
        NEW_YORK, "30", "1", date(2026, 11, 1), (utc(2026, 11, 1, 5, 30),), ("2026-11-01T01:30:00-04:00",),
        id="new-york-fall-back-01:30-repeated-runs-once-at-first-EDT",
    ),
    pytest.param(
        NEW_YORK,
        "30",
        "1-3",
        date(2026, 11, 1),
        (utc(2026, 11, 1, 5, 30), utc(2026, 11, 1, 7, 30), utc(2026, 11, 1, 8, 30)),
        ("2026-11-01T01:30:00-04:00", "2026-11-01T02:30:00-05:00", "2026-11-01T03:30:00-05:00"),
        id="new-york-fall-back-hour-range-repeated-hour-once",
    ),
    pytest.param(
        NEW_YORK, "30", "2", date(2026, 3, 7), (utc(2026, 3, 7, 7, 30),), ("2026-03-07T02:30:00-05:00",),
        id="new-york-ordinary-day-before-spring-forward",
    ),
    pytest.param(
        NEW_YORK, "30", "1", date(2026, 11, 2), (utc(2026, 11, 2, 6, 30),), ("2026-11-02T01:30:00-05:00",),
        id="new-york-ordinary-day-after-fall-back",
    ),
    # Sydney: AEST +10:00 / AEDT +11:00. Fall back 2026-04-05 03:00 AEDT -> 02:00 AEST (04-04 16:00Z).
    pytest.param(
        SYDNEY, "30", "2", date(2026, 4, 5), (utc(2026, 4, 4, 15, 30),), ("2026-04-05T02:30:00+11:00",),
        id="sydney-fall-back-02:30-repeated-runs-once-at-first-AEDT",
    ),
    # Sydney spring forward 2026-10-04 02:00 AEST -> 03:00 AEDT (10-03 16:00Z).
    pytest.param(
        SYDNEY, "30", "2", date(2026, 10, 4), (utc(2026, 10, 3, 16, 0),), ("2026-10-04T03:00:00+11:00",),
        id="sydney-spring-forward-02:30-skipped-runs-at-03:00-AEDT",
    ),
    pytest.param(
        SYDNEY, "30", "2", date(2026, 4, 6), (utc(2026, 4, 5, 16, 30),), ("2026-04-06T02:30:00+10:00",),
        id="sydney-ordinary-day-after-fall-back",
    ),
    pytest.param(
        SYDNEY, "30", "2", date(2026, 10, 3), (utc(2026, 10, 2, 16, 30),), ("2026-10-03T02:30:00+10:00",),
        id="sydney-ordinary-day-before-spring-forward",
    ),
]  # fmt: skip


@pytest.mark.scenario(29)
@pytest.mark.parametrize(("zone", "minute", "hour", "day", "expected", "wall"), SPECIFIC_HOUR)
def test_a_specific_hour_runs_once_per_local_day_across_dst(
    zone: str, minute: str, hour: str, day: date, expected: tuple[datetime, ...], wall: tuple[str, ...], figures: Any
) -> None:
    assert walls(expected, zone) == list(wall), "the table row itself disagrees with tzdata"
    schedule = Crontab(minute=minute, hour=hour, timezone=zone)

    slots = slots_of_local_day(schedule, zone, day)
    figures.record(local_days=1, slots=len(slots), doubled=len(slots) - len(set(slots)))
    assert slots == list(expected)
    after, _ = local_day_window(zone, day)
    assert schedule.next_after(after) == expected[0]


# (zone, the job's only slot on the fall-back day, a moment just after it, the next slot: the next day's)
RESUME_AFTER_FIRST_OCCURRENCE: list[Any] = [
    pytest.param(
        BERLIN, utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 0, 45), utc(2026, 10, 26, 1, 30), id="berlin-02:30"
    ),
    pytest.param(
        NEW_YORK, utc(2026, 11, 1, 5, 30), utc(2026, 11, 1, 5, 45), utc(2026, 11, 2, 6, 30), id="new-york-01:30"
    ),
    pytest.param(SYDNEY, utc(2026, 4, 4, 15, 30), utc(2026, 4, 4, 15, 45), utc(2026, 4, 5, 16, 30), id="sydney-02:30"),
]


@pytest.mark.parametrize(("zone", "first", "moment", "following"), RESUME_AFTER_FIRST_OCCURRENCE)
def test_a_specific_hour_does_not_rerun_in_the_second_occurrence_of_a_repeated_hour(
    zone: str, first: datetime, moment: datetime, following: datetime
) -> None:
    """A beat (or a new leader) resuming inside the repeated hour moves on to the next local day."""
    hour = "1" if zone == NEW_YORK else "2"
    schedule = Crontab(minute="30", hour=hour, timezone=zone)
    assert schedule.next_after(first) == following
    assert schedule.next_after(moment) == following
    # And it is the same answer from a cursor an hour later: inside the second occurrence.
    assert schedule.next_after(moment + HOUR) == following


# --- crontab across daylight-saving time: wildcard hour (Vixie: real time) --------------------------

# (zone, minute, hour, local day, local day length in hours, slot count, first slot, last slot,
#  consecutive slots around the transition, the local wall time examined, its slots that day)
WILDCARD_HOUR: list[Any] = [
    pytest.param(
        BERLIN, "30", "*", date(2026, 3, 29), 23, 23,
        utc(2026, 3, 28, 23, 30), utc(2026, 3, 29, 21, 30),
        (utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 30)),  # 01:30 CET, then 03:30 CEST
        "02:30", (),
        id="berlin-spring-forward-hourly-02:30-has-no-slot",
    ),
    pytest.param(
        BERLIN, "30", "*", date(2026, 10, 25), 25, 25,
        utc(2026, 10, 24, 22, 30), utc(2026, 10, 25, 22, 30),
        # 01:30 CEST, 02:30 CEST, 02:30 CET, 03:30 CET
        (utc(2026, 10, 24, 23, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 1, 30), utc(2026, 10, 25, 2, 30)),
        "02:30", (utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 1, 30)),
        id="berlin-fall-back-hourly-02:30-has-two-slots",
    ),
    pytest.param(
        BERLIN, "30", "*", date(2026, 3, 28), 24, 24,
        utc(2026, 3, 27, 23, 30), utc(2026, 3, 28, 22, 30),
        (utc(2026, 3, 28, 0, 30), utc(2026, 3, 28, 1, 30), utc(2026, 3, 28, 2, 30)),
        "02:30", (utc(2026, 3, 28, 1, 30),),
        id="berlin-ordinary-day-hourly",
    ),
    pytest.param(
        BERLIN, "0", "*/2", date(2026, 3, 29), 23, 11,
        utc(2026, 3, 28, 23, 0), utc(2026, 3, 29, 20, 0),
        (utc(2026, 3, 28, 23, 0), utc(2026, 3, 29, 2, 0)),  # 00:00 CET, then 04:00 CEST
        "02:00", (),
        id="berlin-spring-forward-every-2h-02:00-has-no-slot",
    ),
    pytest.param(
        BERLIN, "0", "*/2", date(2026, 10, 25), 25, 13,
        utc(2026, 10, 24, 22, 0), utc(2026, 10, 25, 21, 0),
        # 00:00 CEST, 02:00 CEST, 02:00 CET, 04:00 CET
        (utc(2026, 10, 24, 22, 0), utc(2026, 10, 25, 0, 0), utc(2026, 10, 25, 1, 0), utc(2026, 10, 25, 3, 0)),
        "02:00", (utc(2026, 10, 25, 0, 0), utc(2026, 10, 25, 1, 0)),
        id="berlin-fall-back-every-2h-02:00-has-two-slots",
    ),
    pytest.param(
        NEW_YORK, "30", "*", date(2026, 3, 8), 23, 23,
        utc(2026, 3, 8, 5, 30), utc(2026, 3, 9, 3, 30),
        (utc(2026, 3, 8, 6, 30), utc(2026, 3, 8, 7, 30)),  # 01:30 EST, then 03:30 EDT
        "02:30", (),
        id="new-york-spring-forward-hourly-02:30-has-no-slot",
    ),
    pytest.param(
        NEW_YORK, "30", "*", date(2026, 11, 1), 25, 25,
        utc(2026, 11, 1, 4, 30), utc(2026, 11, 2, 4, 30),
        # 00:30 EDT, 01:30 EDT, 01:30 EST, 02:30 EST
        (utc(2026, 11, 1, 4, 30), utc(2026, 11, 1, 5, 30), utc(2026, 11, 1, 6, 30), utc(2026, 11, 1, 7, 30)),
        "01:30", (utc(2026, 11, 1, 5, 30), utc(2026, 11, 1, 6, 30)),
        id="new-york-fall-back-hourly-01:30-has-two-slots",
    ),
    pytest.param(
        NEW_YORK, "0", "*/2", date(2026, 3, 8), 23, 11,
        utc(2026, 3, 8, 5, 0), utc(2026, 3, 9, 2, 0),
        (utc(2026, 3, 8, 5, 0), utc(2026, 3, 8, 8, 0)),  # 00:00 EST, then 04:00 EDT
        "02:00", (),
        id="new-york-spring-forward-every-2h-02:00-has-no-slot",
    ),
    pytest.param(
        SYDNEY, "30", "*", date(2026, 4, 5), 25, 25,
        utc(2026, 4, 4, 13, 30), utc(2026, 4, 5, 13, 30),
        # 01:30 AEDT, 02:30 AEDT, 02:30 AEST, 03:30 AEST
        (utc(2026, 4, 4, 14, 30), utc(2026, 4, 4, 15, 30), utc(2026, 4, 4, 16, 30), utc(2026, 4, 4, 17, 30)),
        "02:30", (utc(2026, 4, 4, 15, 30), utc(2026, 4, 4, 16, 30)),
        id="sydney-fall-back-hourly-02:30-has-two-slots",
    ),
    pytest.param(
        SYDNEY, "30", "*/2", date(2026, 4, 5), 25, 13,
        utc(2026, 4, 4, 13, 30), utc(2026, 4, 5, 12, 30),
        # 00:30 AEDT, 02:30 AEDT, 02:30 AEST, 04:30 AEST
        (utc(2026, 4, 4, 13, 30), utc(2026, 4, 4, 15, 30), utc(2026, 4, 4, 16, 30), utc(2026, 4, 4, 18, 30)),
        "02:30", (utc(2026, 4, 4, 15, 30), utc(2026, 4, 4, 16, 30)),
        id="sydney-fall-back-every-2h-02:30-has-two-slots",
    ),
    pytest.param(
        SYDNEY, "30", "*", date(2026, 10, 4), 23, 23,
        utc(2026, 10, 3, 14, 30), utc(2026, 10, 4, 12, 30),
        (utc(2026, 10, 3, 15, 30), utc(2026, 10, 3, 16, 30)),  # 01:30 AEST, then 03:30 AEDT
        "02:30", (),
        id="sydney-spring-forward-hourly-02:30-has-no-slot",
    ),
]  # fmt: skip


@pytest.mark.scenario(29)
@pytest.mark.parametrize(
    ("zone", "minute", "hour", "day", "day_hours", "count", "first", "last", "around", "wall", "wall_slots"),
    WILDCARD_HOUR,
)
def test_a_wildcard_hour_follows_real_time_across_dst(
    zone: str,
    minute: str,
    hour: str,
    day: date,
    day_hours: int,
    count: int,
    first: datetime,
    last: datetime,
    around: tuple[datetime, ...],
    wall: str,
    wall_slots: tuple[datetime, ...],
    figures: Any,
) -> None:
    after, until = local_day_window(zone, day)
    assert until - after == day_hours * HOUR, "the table row's transition claim disagrees with tzdata"
    schedule = Crontab(minute=minute, hour=hour, timezone=zone)

    slots = slots_of_local_day(schedule, zone, day)
    figures.record(local_days=1, slots=len(slots), doubled=len(slots) - len(set(slots)))

    assert len(slots) == count
    assert (slots[0], slots[-1]) == (first, last)
    assert len(set(slots)) == len(slots) and slots == sorted(slots)
    start = slots.index(around[0])
    assert tuple(slots[start : start + len(around)]) == around, "slots around the transition are not consecutive"
    tz = ZoneInfo(zone)
    assert tuple(s for s in slots if s.astimezone(tz).strftime("%H:%M") == wall) == wall_slots
    if hour == "*":  # every local hour that happens, once per real hour
        assert all(b - a == HOUR for a, b in pairwise(slots))


def test_a_new_leader_starting_inside_the_repeated_hour_continues_the_same_real_time_grid() -> None:
    """Failover: two independent chains of next_after name the same slots once they overlap."""
    schedule = Crontab(minute="30", hour="*", timezone=BERLIN)
    early = list(schedule.slots(utc(2026, 10, 24, 20, 0), utc(2026, 10, 25, 4, 0)))
    # A second process, its cursor at 02:45 CEST (the first 02:xx), built from scratch.
    rebuilt = Crontab(minute="30", hour="*", timezone=BERLIN)
    late = list(rebuilt.slots(utc(2026, 10, 25, 0, 45), utc(2026, 10, 25, 4, 0)))
    assert late == [utc(2026, 10, 25, 1, 30), utc(2026, 10, 25, 2, 30), utc(2026, 10, 25, 3, 30)]
    assert early[-len(late) :] == late


# --- crontab: a wildcard minute makes a real-time job too (Vixie cron's MIN_STAR | HR_STAR) ----------

# (zone, minute, hour, local day, every slot of that local day in UTC, what they read on the local wall)
WILDCARD_MINUTE: list[Any] = [
    # Berlin spring forward 2026-03-29 02:00 CET -> 03:00 CEST (01:00Z): 02:00, 02:20, 02:40 never happen.
    pytest.param(BERLIN, "*/20", "2", date(2026, 3, 29), (), (), id="berlin-spring-forward-*/20-2-no-slot"),
    pytest.param(
        BERLIN, "*/20", "2", date(2026, 3, 28),
        (utc(2026, 3, 28, 1, 0), utc(2026, 3, 28, 1, 20), utc(2026, 3, 28, 1, 40)),
        ("2026-03-28T02:00:00+01:00", "2026-03-28T02:20:00+01:00", "2026-03-28T02:40:00+01:00"),
        id="berlin-ordinary-day-*/20-2",
    ),
    # Berlin fall back 2026-10-25 03:00 CEST -> 02:00 CET (01:00Z): 02:00-02:59 happens twice, so do the slots.
    pytest.param(
        BERLIN, "*/20", "2", date(2026, 10, 25),
        (utc(2026, 10, 25, 0, 0), utc(2026, 10, 25, 0, 20), utc(2026, 10, 25, 0, 40),
         utc(2026, 10, 25, 1, 0), utc(2026, 10, 25, 1, 20), utc(2026, 10, 25, 1, 40)),
        ("2026-10-25T02:00:00+02:00", "2026-10-25T02:20:00+02:00", "2026-10-25T02:40:00+02:00",
         "2026-10-25T02:00:00+01:00", "2026-10-25T02:20:00+01:00", "2026-10-25T02:40:00+01:00"),
        id="berlin-fall-back-*/20-2-both-passes",
    ),
    # New York spring forward 2026-03-08 02:00 EST -> 03:00 EDT (07:00Z).
    pytest.param(NEW_YORK, "*/20", "2", date(2026, 3, 8), (), (), id="new-york-spring-forward-*/20-2-no-slot"),
    pytest.param(
        NEW_YORK, "*/20", "2", date(2026, 3, 7),
        (utc(2026, 3, 7, 7, 0), utc(2026, 3, 7, 7, 20), utc(2026, 3, 7, 7, 40)),
        ("2026-03-07T02:00:00-05:00", "2026-03-07T02:20:00-05:00", "2026-03-07T02:40:00-05:00"),
        id="new-york-ordinary-day-*/20-2",
    ),
    # New York fall back 2026-11-01 02:00 EDT -> 01:00 EST (06:00Z): 01:00-01:59 twice, 02:00-02:59 once.
    pytest.param(
        NEW_YORK, "*/20", "1", date(2026, 11, 1),
        (utc(2026, 11, 1, 5, 0), utc(2026, 11, 1, 5, 20), utc(2026, 11, 1, 5, 40),
         utc(2026, 11, 1, 6, 0), utc(2026, 11, 1, 6, 20), utc(2026, 11, 1, 6, 40)),
        ("2026-11-01T01:00:00-04:00", "2026-11-01T01:20:00-04:00", "2026-11-01T01:40:00-04:00",
         "2026-11-01T01:00:00-05:00", "2026-11-01T01:20:00-05:00", "2026-11-01T01:40:00-05:00"),
        id="new-york-fall-back-*/20-1-both-passes",
    ),
    pytest.param(
        NEW_YORK, "*/20", "2", date(2026, 11, 1),
        (utc(2026, 11, 1, 7, 0), utc(2026, 11, 1, 7, 20), utc(2026, 11, 1, 7, 40)),
        ("2026-11-01T02:00:00-05:00", "2026-11-01T02:20:00-05:00", "2026-11-01T02:40:00-05:00"),
        id="new-york-fall-back-*/20-2-happens-once",
    ),
    # The rule is Vixie's: only a field that starts with ``*`` is a wildcard. A list or a range of
    # minutes with a specific hour is a specific-time job: once after the gap, first pass only.
    pytest.param(
        BERLIN, "0,20,40", "2", date(2026, 3, 29), (utc(2026, 3, 29, 1, 0),), ("2026-03-29T03:00:00+02:00",),
        id="berlin-spring-forward-minute-list-runs-once-at-03:00",
    ),
    pytest.param(
        BERLIN, "0-40/20", "2", date(2026, 3, 29), (utc(2026, 3, 29, 1, 0),), ("2026-03-29T03:00:00+02:00",),
        id="berlin-spring-forward-minute-range-step-runs-once-at-03:00",
    ),
    pytest.param(
        BERLIN, "0,20,40", "2", date(2026, 10, 25),
        (utc(2026, 10, 25, 0, 0), utc(2026, 10, 25, 0, 20), utc(2026, 10, 25, 0, 40)),
        ("2026-10-25T02:00:00+02:00", "2026-10-25T02:20:00+02:00", "2026-10-25T02:40:00+02:00"),
        id="berlin-fall-back-minute-list-first-pass-only",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("zone", "minute", "hour", "day", "expected", "wall"), WILDCARD_MINUTE)
def test_a_wildcard_minute_follows_real_time_even_with_a_specific_hour(
    zone: str, minute: str, hour: str, day: date, expected: tuple[datetime, ...], wall: tuple[str, ...]
) -> None:
    """Vixie cron: ``*/20 2 * * *`` skips the spring-forward day; it does not run once at 03:00."""
    assert walls(expected, zone) == list(wall), "the table row itself disagrees with tzdata"
    schedule = Crontab(minute=minute, hour=hour, timezone=zone)

    assert slots_of_local_day(schedule, zone, day) == list(expected)


# --- crontab in Pacific/Chatham: a repeated stretch that spans two local hours -------------------------

# Chatham is +12:45 (CHAST) / +13:45 (CHADT). Fall back 2026-04-05 03:45 CHADT -> 02:45 CHAST, at
# 2026-04-04T14:00Z: wall times 02:45-03:44 happen twice. Spring forward 2026-09-27 02:45 CHAST ->
# 03:45 CHADT, at 2026-09-26T14:00Z: wall times 02:45-03:44 never happen.
CHATHAM = "Pacific/Chatham"
QUARTER = timedelta(minutes=15)

# (local day, local day length in hours, slot count, first slot, last slot,
#  consecutive slots around the transition, and what they read on the local wall)
CHATHAM_EVERY_15: list[Any] = [
    pytest.param(
        date(2026, 4, 5), 25, 100, utc(2026, 4, 4, 10, 15), utc(2026, 4, 5, 11, 0),
        (utc(2026, 4, 4, 13, 15), utc(2026, 4, 4, 13, 30), utc(2026, 4, 4, 13, 45), utc(2026, 4, 4, 14, 0),
         utc(2026, 4, 4, 14, 15), utc(2026, 4, 4, 14, 30), utc(2026, 4, 4, 14, 45), utc(2026, 4, 4, 15, 0)),
        ("2026-04-05T03:00:00+13:45", "2026-04-05T03:15:00+13:45", "2026-04-05T03:30:00+13:45",
         "2026-04-05T02:45:00+12:45", "2026-04-05T03:00:00+12:45", "2026-04-05T03:15:00+12:45",
         "2026-04-05T03:30:00+12:45", "2026-04-05T03:45:00+12:45"),
        id="fall-back-every-repeated-quarter-twice",
    ),
    pytest.param(
        date(2026, 9, 27), 23, 92, utc(2026, 9, 26, 11, 15), utc(2026, 9, 27, 10, 0),
        (utc(2026, 9, 26, 13, 45), utc(2026, 9, 26, 14, 0), utc(2026, 9, 26, 14, 15)),
        ("2026-09-27T02:30:00+12:45", "2026-09-27T03:45:00+13:45", "2026-09-27T04:00:00+13:45"),
        id="spring-forward-skipped-quarters-have-no-slot",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("day", "day_hours", "count", "first", "last", "around", "wall"), CHATHAM_EVERY_15)
def test_every_15_minutes_in_chatham_is_every_real_quarter_hour_across_dst(
    day: date,
    day_hours: int,
    count: int,
    first: datetime,
    last: datetime,
    around: tuple[datetime, ...],
    wall: tuple[str, ...],
) -> None:
    """Both Chatham offsets are whole quarter hours, so ``*/15 * * * *`` is every 15 real minutes.

    The repeated stretch 02:45-03:44 straddles two local hours: the second 02:45 (14:00Z) comes
    after the first 03:30 (13:45Z), so local hours do not map onto UTC in order.
    """
    after, until = local_day_window(CHATHAM, day)
    assert until - after == day_hours * HOUR, "the table row's transition claim disagrees with tzdata"
    assert walls(around, CHATHAM) == list(wall), "the table row itself disagrees with tzdata"
    schedule = Crontab(minute="*/15", timezone=CHATHAM)

    slots = slots_of_local_day(schedule, CHATHAM, day)

    assert len(slots) == count
    assert (slots[0], slots[-1]) == (first, last)
    assert all(b - a == QUARTER for a, b in pairwise(slots)), "a real quarter hour is missing or doubled"
    start = slots.index(around[0])
    assert tuple(slots[start : start + len(around)]) == around


# (minute, hour, local day, every slot of that local day in UTC, what they read on the local wall)
CHATHAM_SPECIFIC_AND_WILDCARD: list[Any] = [
    # A wildcard minute in an hour that is half repeated: the first pass, then the second.
    pytest.param(
        "*/15", "3", date(2026, 4, 5),
        (utc(2026, 4, 4, 13, 15), utc(2026, 4, 4, 13, 30), utc(2026, 4, 4, 13, 45),
         utc(2026, 4, 4, 14, 15), utc(2026, 4, 4, 14, 30), utc(2026, 4, 4, 14, 45), utc(2026, 4, 4, 15, 0)),
        ("2026-04-05T03:00:00+13:45", "2026-04-05T03:15:00+13:45", "2026-04-05T03:30:00+13:45",
         "2026-04-05T03:00:00+12:45", "2026-04-05T03:15:00+12:45", "2026-04-05T03:30:00+12:45",
         "2026-04-05T03:45:00+12:45"),
        id="fall-back-*/15-3-both-passes",
    ),
    pytest.param(
        "*/15", "2", date(2026, 4, 5),
        (utc(2026, 4, 4, 12, 15), utc(2026, 4, 4, 12, 30), utc(2026, 4, 4, 12, 45), utc(2026, 4, 4, 13, 0),
         utc(2026, 4, 4, 14, 0)),
        ("2026-04-05T02:00:00+13:45", "2026-04-05T02:15:00+13:45", "2026-04-05T02:30:00+13:45",
         "2026-04-05T02:45:00+13:45", "2026-04-05T02:45:00+12:45"),
        id="fall-back-*/15-2-only-02:45-twice",
    ),
    # Specific times: a repeated one runs at its first pass only, whichever local hour it is in.
    pytest.param(
        "30", "3", date(2026, 4, 5), (utc(2026, 4, 4, 13, 45),), ("2026-04-05T03:30:00+13:45",),
        id="fall-back-03:30-first-pass-only",
    ),
    pytest.param(
        "50", "2", date(2026, 4, 5), (utc(2026, 4, 4, 13, 5),), ("2026-04-05T02:50:00+13:45",),
        id="fall-back-02:50-first-pass-only",
    ),
    pytest.param(
        "30", "2,3", date(2026, 4, 5), (utc(2026, 4, 4, 12, 45), utc(2026, 4, 4, 13, 45)),
        ("2026-04-05T02:30:00+13:45", "2026-04-05T03:30:00+13:45"),
        id="fall-back-02:30-and-03:30-once-each",
    ),
    # A skipped specific time runs once, at the first instant after the gap (03:45 CHADT).
    pytest.param(
        "0", "3", date(2026, 9, 27), (utc(2026, 9, 26, 14, 0),), ("2026-09-27T03:45:00+13:45",),
        id="spring-forward-03:00-skipped-runs-at-03:45",
    ),
    pytest.param(
        "0,30", "2,3", date(2026, 9, 27),
        (utc(2026, 9, 26, 13, 15), utc(2026, 9, 26, 13, 45), utc(2026, 9, 26, 14, 0)),
        ("2026-09-27T02:00:00+12:45", "2026-09-27T02:30:00+12:45", "2026-09-27T03:45:00+13:45"),
        id="spring-forward-03:00-and-03:30-skipped-run-once-at-03:45",
    ),
    pytest.param(
        "*/30", "3", date(2026, 9, 27), (), (), id="spring-forward-*/30-3-has-no-slot",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("minute", "hour", "day", "expected", "wall"), CHATHAM_SPECIFIC_AND_WILDCARD)
def test_chatham_slots_across_dst_follow_vixie_cron(
    minute: str, hour: str, day: date, expected: tuple[datetime, ...], wall: tuple[str, ...]
) -> None:
    assert walls(expected, CHATHAM) == list(wall), "the table row itself disagrees with tzdata"
    schedule = Crontab(minute=minute, hour=hour, timezone=CHATHAM)

    assert slots_of_local_day(schedule, CHATHAM, day) == list(expected)


@pytest.mark.parametrize(
    ("minute", "hour", "after", "expected"),
    [
        # In the first pass, at 02:50 CHADT: 03:00 CHADT, not the second 02:45 an hour later.
        pytest.param("*/15", "*", utc(2026, 4, 4, 13, 5), utc(2026, 4, 4, 13, 15), id="*/15-first-pass-02:50"),
        # In the first pass, at 03:35 CHADT: the next quarter is the second 02:45, a quarter later.
        pytest.param("*/15", "*", utc(2026, 4, 4, 13, 50), utc(2026, 4, 4, 14, 0), id="*/15-first-pass"),
        # In the second pass, at 02:50 CHAST: 03:00 CHAST, although 03:00 CHADT is long gone.
        pytest.param("*/15", "*", utc(2026, 4, 4, 14, 5), utc(2026, 4, 4, 14, 15), id="*/15-second-pass"),
        # 03:30 ran in the first pass (13:45Z); from the second pass, the next is the next day's.
        pytest.param("30", "3", utc(2026, 4, 4, 14, 5), utc(2026, 4, 5, 14, 45), id="03:30-from-second-pass"),
        pytest.param("30", "3", utc(2026, 4, 4, 13, 45), utc(2026, 4, 5, 14, 45), id="03:30-from-its-slot"),
        pytest.param("50", "2", utc(2026, 4, 4, 13, 50), utc(2026, 4, 5, 14, 5), id="02:50-from-first-pass"),
    ],
)
def test_next_after_from_inside_chatham_repeated_stretch(
    minute: str, hour: str, after: datetime, expected: datetime
) -> None:
    """A beat (or a new leader) whose cursor sits inside the repeated stretch names the right next slot."""
    assert Crontab(minute=minute, hour=hour, timezone=CHATHAM).next_after(after) == expected


@pytest.mark.parametrize(
    ("zone", "change"),
    [
        pytest.param(CHATHAM, utc(2026, 4, 4, 14, 0), id="chatham-fall-back"),
        pytest.param(CHATHAM, utc(2026, 9, 26, 14, 0), id="chatham-spring-forward"),
        pytest.param("Australia/Lord_Howe", utc(2026, 4, 4, 15, 0), id="lord-howe-fall-back-30min"),
        pytest.param("Australia/Lord_Howe", utc(2026, 10, 3, 15, 30), id="lord-howe-spring-forward-30min"),
        pytest.param(BERLIN, utc(2026, 10, 25, 1, 0), id="berlin-fall-back"),
    ],
)
@pytest.mark.parametrize(
    ("minute", "hour", "wall_matches"),
    [
        pytest.param("*/15", "*", lambda h, m: m % 15 == 0, id="*/15-*"),
        pytest.param("*/20", "2", lambda h, m: h == 2 and m % 20 == 0, id="*/20-2"),
        pytest.param("0", "*/2", lambda h, m: h % 2 == 0 and m == 0, id="0-*/2"),
        pytest.param("*/5", "1-3", lambda h, m: 1 <= h <= 3 and m % 5 == 0, id="*/5-1-3"),
    ],
)
def test_a_real_time_job_has_a_slot_at_every_real_minute_whose_wall_time_matches(
    zone: str, change: datetime, minute: str, hour: str, wall_matches: Any
) -> None:
    """The real-time contract by its definition: walk every UTC minute and read the wall clock."""
    tz = ZoneInfo(zone)
    assert change.astimezone(tz).utcoffset() != (change - timedelta(minutes=1)).astimezone(tz).utcoffset()
    after, until = change - 30 * HOUR, change + 30 * HOUR
    expected = []
    moment = after + timedelta(minutes=1)
    while moment <= until:
        wall = moment.astimezone(tz)
        if wall_matches(wall.hour, wall.minute):
            expected.append(moment)
        moment += timedelta(minutes=1)

    assert list(Crontab(minute=minute, hour=hour, timezone=zone).slots(after, until)) == expected


# --- interval ----------------------------------------------------------------------------------------

SEVEN_HOURS = 7 * 3600  # 2026-01-01T00:00Z is 70128 * 7 h after the epoch, so it is on the epoch grid


@pytest.mark.parametrize(
    ("every", "anchor", "after", "expected"),
    [
        pytest.param(300, EPOCH, utc(2026, 3, 29, 1, 2, 3), utc(2026, 3, 29, 1, 5), id="5min-from-epoch"),
        pytest.param(
            SEVEN_HOURS, EPOCH, utc(2026, 1, 1, 3), utc(2026, 1, 1, 7), id="7h-from-epoch-not-aligned-to-days"
        ),
        pytest.param(SEVEN_HOURS, EPOCH, utc(2026, 1, 1, 7), utc(2026, 1, 1, 14), id="7h-strictly-after-a-slot"),
        pytest.param(
            600,
            datetime(2026, 3, 29, 3, 7, tzinfo=ZoneInfo(BERLIN)),  # 01:07Z
            utc(2026, 3, 29, 1, 20),
            utc(2026, 3, 29, 1, 27),
            id="10min-from-an-aware-berlin-anchor",
        ),
        pytest.param(
            90, utc(2026, 1, 1, 0, 0, 15), utc(2026, 1, 1, 0, 3), utc(2026, 1, 1, 0, 3, 15), id="90s-from-an-odd-anchor"
        ),
    ],
)
def test_interval_slots_are_anchor_plus_k_times_every(
    every: float, anchor: datetime, after: datetime, expected: datetime
) -> None:
    schedule = Interval(every, anchor)
    assert schedule.next_after(after) == expected
    assert schedule.next_after(expected) == expected + timedelta(seconds=every)


def test_interval_ignores_dst_it_counts_real_time() -> None:
    anchor = datetime(2026, 3, 29, 0, 0, tzinfo=ZoneInfo(BERLIN))  # 2026-03-28T23:00Z, CET
    slots = list(Interval(3600, anchor).slots(utc(2026, 3, 28, 23, 30), utc(2026, 3, 29, 3, 0)))
    assert slots == [utc(2026, 3, 29, 0), utc(2026, 3, 29, 1), utc(2026, 3, 29, 2), utc(2026, 3, 29, 3)]


@pytest.mark.parametrize(
    ("every", "anchor"),
    [
        pytest.param(SEVEN_HOURS, EPOCH, id="7h-epoch"),
        pytest.param(45, utc(2026, 1, 1, 0, 0, 13), id="45s-anchored"),
        pytest.param(1.5, EPOCH, id="fractional-seconds"),
    ],
)
def test_interval_grid_is_the_same_from_any_starting_point(every: float, anchor: datetime) -> None:
    """The determinism beat failover relies on: another process, another cursor, the same slots."""
    until = utc(2026, 1, 3)
    first = list(Interval(every, anchor).slots(utc(2026, 1, 1, 0, 0, 1), until))
    second = list(Interval(every, anchor).slots(datetime(2026, 1, 2, 5, 6, 7, 891011, tzinfo=UTC), until))
    assert second and first[-len(second) :] == second
    step = timedelta(seconds=every)
    assert all((slot - anchor) % step == timedelta(0) for slot in first)


def test_an_interval_anchored_in_the_future_yields_the_anchor_first() -> None:
    anchor = utc(2030, 1, 1, 12)
    schedule = Interval(60, anchor)
    assert schedule.next_after(utc(2026, 3, 29)) == anchor
    assert list(schedule.slots(utc(2026, 3, 29), utc(2030, 1, 1, 12, 2))) == [
        anchor,
        utc(2030, 1, 1, 12, 1),
        utc(2030, 1, 1, 12, 2),
    ]
    assert schedule.last_at_or_before(utc(2029, 12, 31), since=utc(2026, 1, 1)) is None


def test_interval_last_at_or_before_is_the_latest_slot_after_since() -> None:
    schedule = Interval(600)
    assert schedule.last_at_or_before(utc(2026, 3, 29, 12, 9), since=utc(2026, 3, 29, 11)) == utc(2026, 3, 29, 12)
    assert schedule.last_at_or_before(utc(2026, 3, 29, 12, 9), since=utc(2026, 3, 29, 12)) is None


# --- clocked -----------------------------------------------------------------------------------------


def test_clocked_has_one_slot_and_none_after_it() -> None:
    at = datetime(2026, 11, 1, 1, 30, tzinfo=ZoneInfo(NEW_YORK))  # fold=0: the first 01:30, EDT
    schedule = Clocked(at)
    assert schedule.at == utc(2026, 11, 1, 5, 30)
    assert schedule.next_after(utc(2026, 1, 1)) == utc(2026, 11, 1, 5, 30)
    assert list(schedule.slots(utc(2026, 1, 1), utc(2027, 1, 1))) == [utc(2026, 11, 1, 5, 30)]
    assert schedule.next_after(utc(2026, 11, 1, 5, 30)) is None
    assert schedule.next_after(utc(2026, 12, 1)) is None


# --- plan_due: misfire policies --------------------------------------------------------------------

TEN_MINUTES = Interval(600)
NOW = utc(2026, 3, 29, 12, 5)  # not on a slot: the last owed slot is 12:00
GRACE = 900  # slots at or after 11:50 are on time
WINDOW = 3600  # missed slots at or after 11:05 are caught up


def ten_minute_slots(first: datetime, last: datetime) -> tuple[datetime, ...]:
    """Literal helper: every 10 minutes from ``first`` to ``last`` inclusive (no code under test)."""
    out = []
    while first <= last:
        out.append(first)
        first += timedelta(minutes=10)
    return tuple(out)


@pytest.mark.parametrize("policy", [*MisfirePolicy, "skip", "run_once", "catch_up"], ids=str)
def test_on_time_slots_are_all_published_whatever_the_policy(policy: MisfirePolicy | str) -> None:
    plan = plan_due(
        TEN_MINUTES,
        cursor=utc(2026, 3, 29, 11, 45),
        now=NOW,
        policy=policy,
        grace_seconds=GRACE,
        catch_up_window_seconds=WINDOW,
    )
    on_time = (utc(2026, 3, 29, 11, 50), utc(2026, 3, 29, 12, 0))
    assert plan == DuePlan(publish=on_time, dropped=0, cursor=utc(2026, 3, 29, 12, 0))


# Cursor 09:00, now 12:05: owed 09:10 .. 12:00 (18 slots); on time 11:50, 12:00; missed 09:10 .. 11:40 (16),
# of which 11:10 .. 11:40 (4) are inside the one-hour catch-up window and 09:10 .. 11:00 (12) are not.
@pytest.mark.parametrize(
    ("policy", "publish", "dropped"),
    [
        pytest.param(MisfirePolicy.SKIP, (utc(2026, 3, 29, 11, 50), utc(2026, 3, 29, 12, 0)), 16, id="skip"),
        pytest.param(MisfirePolicy.RUN_ONCE, (utc(2026, 3, 29, 12, 0),), 17, id="run_once-latest-owed-only"),
        pytest.param(
            MisfirePolicy.CATCH_UP,
            ten_minute_slots(utc(2026, 3, 29, 11, 10), utc(2026, 3, 29, 12, 0)),
            12,
            id="catch_up-inside-window",
        ),
    ],
)
def test_missed_slots_follow_the_misfire_policy(
    policy: MisfirePolicy, publish: tuple[datetime, ...], dropped: int
) -> None:
    plan = plan_due(
        TEN_MINUTES,
        cursor=utc(2026, 3, 29, 9, 0),
        now=NOW,
        policy=policy,
        grace_seconds=GRACE,
        catch_up_window_seconds=WINDOW,
    )
    assert plan.publish == publish
    assert plan.dropped == dropped
    assert len(plan.publish) + plan.dropped == 18  # every owed slot is either published or dropped
    assert plan.cursor == utc(2026, 3, 29, 12, 0)  # the last owed slot, not "now"


@pytest.mark.parametrize(
    ("policy", "publish", "dropped"),
    [
        pytest.param("skip", (), 1, id="skip"),
        pytest.param("run_once", (utc(2026, 3, 29, 10, 0),), 0, id="run_once"),
        pytest.param("catch_up", (), 1, id="catch_up-older-than-window"),
    ],
)
def test_a_missed_slot_with_nothing_on_time_still_moves_the_cursor(
    policy: str, publish: tuple[datetime, ...], dropped: int
) -> None:
    plan = plan_due(
        Clocked(utc(2026, 3, 29, 10, 0)),
        cursor=utc(2026, 3, 29, 9, 0),
        now=NOW,
        policy=policy,
        grace_seconds=GRACE,
        catch_up_window_seconds=WINDOW,
    )
    assert plan == DuePlan(publish=publish, dropped=dropped, cursor=utc(2026, 3, 29, 10, 0))


def test_run_once_across_a_spring_forward_names_the_latest_owed_crontab_slot() -> None:
    schedule = Crontab(minute="30", hour="2", timezone=BERLIN)
    plan = plan_due(
        schedule,
        cursor=utc(2026, 3, 28, 0, 0),
        now=utc(2026, 3, 30, 12, 0),
        policy=MisfirePolicy.RUN_ONCE,
        grace_seconds=60,
        catch_up_window_seconds=86400,
    )
    # Owed: 03-28 02:30 CET (01:30Z), 03-29 03:00 CEST (01:00Z, the gap), 03-30 02:30 CEST (00:30Z).
    assert plan == DuePlan(publish=(utc(2026, 3, 30, 0, 30),), dropped=2, cursor=utc(2026, 3, 30, 0, 30))


@pytest.mark.parametrize(
    ("policy", "publish", "dropped", "cursor"),
    [
        # skip and run_once go straight to the tail of the backlog (the dropped count is capped at the limit).
        pytest.param(
            "skip", (utc(2026, 3, 29, 11, 59), utc(2026, 3, 29, 12, 0)), 5, utc(2026, 3, 29, 12, 0), id="skip"
        ),
        pytest.param("run_once", (utc(2026, 3, 29, 12, 0),), 5, utc(2026, 3, 29, 12, 0), id="run_once"),
        # catch_up publishes in order, ``limit`` at a time, and continues from its cursor.
        pytest.param(
            "catch_up", tuple(utc(2026, 3, 29, 0, m) for m in (1, 2, 3, 4, 5)), 0, utc(2026, 3, 29, 0, 5),
            id="catch_up",
        ),
    ],
)  # fmt: skip
def test_limit_bounds_one_plan_and_the_cursor_stops_at_the_last_slot_planned(
    policy: str, publish: tuple[datetime, ...], dropped: int, cursor: datetime
) -> None:
    plan = plan_due(
        Interval(60),
        cursor=utc(2026, 3, 29, 0, 0),
        now=utc(2026, 3, 29, 12, 0),  # 720 slots owed
        policy=policy,
        grace_seconds=60,
        catch_up_window_seconds=86400,
        limit=5,
    )
    assert plan == DuePlan(publish=publish, dropped=dropped, cursor=cursor)


def test_a_limited_plan_continues_from_its_cursor_without_gaps_or_repeats() -> None:
    def plan(cursor: datetime) -> DuePlan:
        return plan_due(
            Interval(60),
            cursor=cursor,
            now=utc(2026, 3, 29, 12, 0),
            policy=MisfirePolicy.SKIP,
            grace_seconds=3600,
            catch_up_window_seconds=0,
            limit=3,
        )

    first = plan(utc(2026, 3, 29, 11, 50))
    second = plan(first.cursor)
    assert first.publish == (utc(2026, 3, 29, 11, 51), utc(2026, 3, 29, 11, 52), utc(2026, 3, 29, 11, 53))
    assert second.publish == (utc(2026, 3, 29, 11, 54), utc(2026, 3, 29, 11, 55), utc(2026, 3, 29, 11, 56))
    assert second.cursor == utc(2026, 3, 29, 11, 56)


@pytest.mark.parametrize(
    ("schedule", "cursor"),
    [
        pytest.param(Interval(600), utc(2026, 3, 29, 12, 0), id="interval-next-slot-is-after-now"),
        pytest.param(Clocked(utc(2026, 3, 29, 10, 0)), utc(2026, 3, 29, 10, 0), id="clocked-already-done"),
        pytest.param(Crontab(minute="30", hour="2", timezone=BERLIN), utc(2026, 3, 29, 1, 0), id="crontab-not-due"),
    ],
)
def test_no_owed_slot_is_an_empty_plan_with_the_cursor_unchanged(schedule: Schedule, cursor: datetime) -> None:
    for policy in MisfirePolicy:
        plan = plan_due(
            schedule, cursor=cursor, now=NOW, policy=policy, grace_seconds=GRACE, catch_up_window_seconds=WINDOW
        )
        assert plan == DuePlan(publish=(), dropped=0, cursor=cursor)


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expression"),
    [
        pytest.param({"minute": "61"}, "61 * * * *", id="minute-61"),
        pytest.param({"hour": "25"}, "* 25 * * *", id="hour-25"),
        pytest.param({"minute": "*/0"}, "*/0 * * * *", id="minute-step-0"),
        pytest.param({"hour": "*/0"}, "* */0 * * *", id="hour-step-0"),
        pytest.param({"minute": "abc"}, "abc * * * *", id="minute-abc"),
        pytest.param({"day_of_month": "32"}, "* * 32 * *", id="day-of-month-32"),
        pytest.param({"day_of_month": "0"}, "* * 0 * *", id="day-of-month-0"),
        pytest.param({"month_of_year": "13"}, "* * * 13 *", id="month-13"),
        pytest.param({"day_of_week": "funday"}, "* * * * funday", id="day-of-week-funday"),
        pytest.param({"hour": "-1"}, "* -1 * * *", id="hour-negative"),
        pytest.param({"minute": ""}, " * * * *", id="minute-empty"),
    ],
)
@pytest.mark.scenario(35)
def test_a_malformed_crontab_field_is_a_configuration_error_naming_the_expression(
    fields: dict[str, str], expression: str, figures: Any
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Crontab(timezone=BERLIN, **fields)
    figures.record(refused=1)
    assert "invalid crontab" in str(caught.value)
    assert repr(expression) in str(caught.value)


@pytest.mark.scenario(35)
@pytest.mark.parametrize(
    ("expression", "zone", "fragment"),
    [
        pytest.param("* * * *", "UTC", "5 fields", id="four-fields"),
        pytest.param("0 0 * * * * 2026", "UTC", "5 fields", id="seven-fields"),
        pytest.param("", "UTC", "5 fields", id="empty"),
        pytest.param("\u0665 * * * *", "UTC", "invalid crontab", id="arabic-indic-digit"),
        pytest.param("0 0 30 2 *", "UTC", "never occurs", id="february-30-never-fires"),
        pytest.param("30 2 * * *", "Europe/Atlantis", "unknown time zone", id="unknown-zone"),
    ],
)
def test_a_malformed_cron_expression_is_refused_with_what_is_wrong(
    expression: str, zone: str, fragment: str, figures: Any
) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        parse_cron(expression, zone)
    figures.record(refused=1)


@pytest.mark.parametrize("zone", ["Mars/Olympus", "Europe/Berlinn", "", "../etc/passwd"])
def test_an_unknown_time_zone_is_a_configuration_error_naming_it(zone: str) -> None:
    with pytest.raises(ConfigurationError, match="unknown time zone") as caught:
        Crontab(minute="30", hour="2", timezone=zone)
    assert repr(zone) in str(caught.value)


NAIVE = datetime(2026, 3, 29, 2, 30)
AWARE = utc(2026, 3, 29, 1, 0)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: Crontab(timezone=BERLIN).next_after(NAIVE), id="crontab-next_after"),
        pytest.param(lambda: Interval(60).next_after(NAIVE), id="interval-next_after"),
        pytest.param(lambda: Interval(60, anchor=NAIVE), id="interval-anchor"),
        pytest.param(lambda: Interval(60).last_at_or_before(NAIVE, since=AWARE), id="interval-last_at_or_before"),
        pytest.param(lambda: Clocked(NAIVE), id="clocked-at"),
        pytest.param(lambda: Clocked(AWARE).next_after(NAIVE), id="clocked-next_after"),
        pytest.param(
            lambda: plan_due(
                Interval(60), cursor=NAIVE, now=AWARE, policy="skip", grace_seconds=60, catch_up_window_seconds=60
            ),
            id="plan_due-cursor",
        ),
        # A key must not depend on the zone of the process that formats it.
        pytest.param(lambda: slot_key("job", NAIVE), id="slot_key"),
    ],
)
def test_a_naive_datetime_is_refused(call: Any) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        call()


@pytest.mark.parametrize("every", [0, -1, -0.5, float("nan")])
def test_a_non_positive_interval_is_a_configuration_error(every: float) -> None:
    with pytest.raises(ConfigurationError, match="interval must be positive"):
        Interval(every)


# --- slot keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "moment",
    [
        pytest.param(utc(2026, 3, 29, 1, 0), id="utc"),
        pytest.param(datetime(2026, 3, 29, 3, 0, tzinfo=ZoneInfo(BERLIN)), id="berlin-cest"),
        pytest.param(datetime(2026, 3, 28, 21, 0, tzinfo=ZoneInfo(NEW_YORK)), id="new-york-edt"),
        pytest.param(datetime(2026, 3, 29, 12, 0, tzinfo=ZoneInfo(SYDNEY)), id="sydney-aedt"),
        pytest.param(datetime(2026, 3, 29, 6, 30, tzinfo=timezone(timedelta(hours=5, minutes=30))), id="fixed-+05:30"),
    ],
)
def test_slot_key_is_utc_with_a_trailing_z_whatever_the_input_zone(moment: datetime) -> None:
    assert slot_key("job", moment) == "job@2026-03-29T01:00:00Z"


def test_slot_key_tells_the_two_occurrences_of_a_repeated_local_time_apart() -> None:
    first = datetime(2026, 10, 25, 2, 30, tzinfo=ZoneInfo(BERLIN), fold=0)
    second = datetime(2026, 10, 25, 2, 30, tzinfo=ZoneInfo(BERLIN), fold=1)
    assert slot_key("job", first) == "job@2026-10-25T00:30:00Z"
    assert slot_key("job", second) == "job@2026-10-25T01:30:00Z"


def test_format_slot_keeps_sub_second_precision_only_when_present() -> None:
    assert format_slot(utc(2026, 3, 29, 1, 0)) == "2026-03-29T01:00:00Z"
    assert format_slot(datetime(2026, 3, 29, 1, 0, 0, 1500, tzinfo=UTC)) == "2026-03-29T01:00:00.001500Z"


def test_run_once_after_a_long_outage_is_one_execution_however_many_slots_were_missed() -> None:
    """A per-second job down for a year: one execution, and no walk over 31 million slots."""
    plan = plan_due(
        Interval(1),
        cursor=utc(2025, 3, 29, 12, 0),
        now=utc(2026, 3, 29, 12, 0),
        policy=MisfirePolicy.RUN_ONCE,
        grace_seconds=60,
        catch_up_window_seconds=3600,
        limit=500,
    )
    assert plan.publish == (utc(2026, 3, 29, 12, 0),) and plan.cursor == utc(2026, 3, 29, 12, 0)
    assert plan.dropped == 500  # counted up to the limit


def test_start_time_and_expiry_bound_the_slots() -> None:
    schedule = Bounded(Interval(600), not_before=utc(2026, 3, 29, 10, 0), not_after=utc(2026, 3, 29, 11, 0))
    assert list(schedule.slots(utc(2026, 3, 29, 0, 0), utc(2026, 3, 30))) == list(
        ten_minute_slots(utc(2026, 3, 29, 10, 0), utc(2026, 3, 29, 11, 0))
    )
    plan = plan_due(
        schedule, cursor=utc(2026, 3, 29, 0, 0), now=NOW, policy="run_once", grace_seconds=GRACE,
        catch_up_window_seconds=WINDOW,
    )  # fmt: skip
    assert plan.publish == (utc(2026, 3, 29, 11, 0),)  # not a slot after the expiry
