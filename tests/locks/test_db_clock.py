"""The database lock backend judges expiry by one clock, whatever the session's time zone.

MariaDB/MySQL's ``NOW()`` is the session time zone's wall time: at a daylight-saving
fall-back (summer ``+02:00`` to winter ``+01:00``) a lease written before the change
looked valid for an extra hour, and at the spring change a live lease looked expired.
The zone changes are simulated with offset strings (MariaDB may lack the named zone
tables); PostgreSQL runs the same test with its session ``TimeZone``. SQLite has no
session zone (its ``'now'`` is UTC).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from taskplatform.backends.db import DatabaseLockBackend
from tests.helpers import wait_for

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]

SUMMER, WINTER = "+02:00", "+01:00"


def set_session_zone(offset: str) -> None:
    with connection.cursor() as cur:
        if connection.vendor == "mysql":
            cur.execute("SET time_zone = %s", [offset])
        else:
            cur.execute("SELECT set_config('TimeZone', %s, false)", [offset])


@pytest.fixture
def zoned_session() -> Iterator[None]:
    if connection.vendor not in ("mysql", "postgresql"):
        pytest.skip("SQLite has no session time zone")
    yield
    set_session_zone("+00:00")


@pytest.fixture
def backend() -> DatabaseLockBackend:
    return DatabaseLockBackend("test", {})


def test_a_dead_leaders_lease_expires_on_time_across_a_fall_back(
    zoned_session: None, backend: DatabaseLockBackend
) -> None:
    set_session_zone(SUMMER)
    granted = timezone.now()
    dead = backend.acquire("dst-fall-back", 1.0, identity="dead-leader")
    assert dead is not None
    info = backend.inspect("dst-fall-back")
    assert info is not None and info.expires_at is not None
    # Stored as the instant it is, not an hour off.
    assert abs((info.expires_at - (granted + timedelta(seconds=1))).total_seconds()) < 5, info.expires_at

    set_session_zone(WINTER)  # the clocks go back an hour; the leader never renews again
    successor = wait_for(
        lambda: backend.acquire("dst-fall-back", 5.0, identity="successor"),
        timeout=10,
        interval=0.1,
        what="the dead leader's 1-second lease to expire",
    )
    assert successor.token > dead.token
    assert (timezone.now() - granted).total_seconds() < 10


def test_a_live_lease_stays_held_across_a_spring_change(zoned_session: None, backend: DatabaseLockBackend) -> None:
    set_session_zone(WINTER)
    leader = backend.acquire("dst-spring", 30.0, identity="leader")
    assert leader is not None

    set_session_zone(SUMMER)  # the clocks go forward an hour
    assert backend.acquire("dst-spring", 30.0, identity="usurper") is None, "a live lease was taken"
    info = backend.inspect("dst-spring")
    assert info is not None and info.owner == leader.owner
    renewed = backend.renew(leader, 30.0)
    assert renewed is not None
    assert backend.acquire("dst-spring", 30.0, identity="usurper") is None
