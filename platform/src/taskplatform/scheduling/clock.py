"""The ledger database's clock, as the beat leader reads it: measured at each sync, carried
forward by this process's monotonic clock in between.

Whether a slot is due is a decision about time, so it follows the rule every other one does
(``docs/reliability.md``): the database's clock decides. A leader whose host clock runs 90 s
ahead would otherwise publish every slot 90 s early (a 02:30 job at 02:28:30), and one 90 s
behind would publish them late and, on taking over, start its cursors in the past or future.
Asking the database on every tick would add a round trip to each; the database's time is
read at each schedule sync instead (every ``beat_sync_seconds``), half the round trip
allowed for.

Between two readings the time advances by ``time.monotonic()``, not by this host's wall
clock: the wall clock can step (an NTP correction, a VM restored from a snapshot, an
operator's ``date -s``) at any moment, and a step of +10 minutes between syncs would
otherwise make the leader publish the next 10 minutes of slots at once, and drop as misfires
the ones really due meanwhile, while a step of -10 minutes would hold every slot back until
the next sync. The monotonic clock never steps; its rate error over one sync interval is
negligible, and each sync starts from the database's time again.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from django.utils import timezone

from ..models import SchedulerFence, UtcNow

log = logging.getLogger("taskplatform.beat")

#: An offset above this is logged once per change of a second or more: the host's clock is off.
REPORT_OFFSET_SECONDS = 2.0


class DatabaseClock:
    """``now()``: the database's time at the last measurement plus the monotonic time since."""

    def __init__(self) -> None:
        #: The database's clock minus this host's wall clock, at the last measurement (reported).
        self.offset = timedelta(0)
        self._db_at: datetime | None = None  # the database's time, read at ...
        self._monotonic_at = 0.0  # ... this instant of this process's monotonic clock
        self._reported = 0.0

    def now(self) -> datetime:
        if self._db_at is None:  # not measured yet: this host's clock is all there is
            return timezone.now()
        return self._db_at + timedelta(seconds=time.monotonic() - self._monotonic_at)

    def measure(self, fence_name: str) -> None:
        """Read the database's clock once (on the fence row, which a leader always has)."""
        sent = time.monotonic()
        local = timezone.now()
        db_now = (
            SchedulerFence.objects.filter(name=fence_name)
            .annotate(db_now=UtcNow())
            .values_list("db_now", flat=True)
            .first()
        )
        if db_now is None:
            return
        if timezone.is_naive(db_now):
            db_now = timezone.make_aware(db_now, UTC)
        half_trip = (time.monotonic() - sent) / 2
        # The database read its clock about halfway through the round trip.
        self._db_at, self._monotonic_at = db_now, sent + half_trip
        self.offset = db_now - (local + timedelta(seconds=half_trip))
        seconds = self.offset.total_seconds()
        if abs(seconds) > REPORT_OFFSET_SECONDS and abs(seconds - self._reported) >= 1:
            log.warning("this host's clock is %.1f s off the database's; the beat follows the database", -seconds)
            self._reported = seconds
