"""The ledger database's clock, as the beat leader reads it: its own clock plus a measured offset.

Whether a slot is due is a decision about time, so it follows the rule every other one does
(``docs/reliability.md``): the database's clock decides. A leader whose host clock runs 90 s
ahead would otherwise publish every slot 90 s early (a 02:30 job at 02:28:30), and one 90 s
behind would publish them late and, on taking over, start its cursors in the past or future.
Asking the database on every tick would add a round trip to each; the offset is measured at
each schedule sync instead (every ``beat_sync_seconds``), half the round trip allowed for.
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
    """``now()``: this host's time corrected to the database's, as last measured."""

    def __init__(self) -> None:
        self.offset = timedelta(0)
        self._reported = 0.0

    def now(self) -> datetime:
        return timezone.now() + self.offset

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
        half_trip = timedelta(seconds=(time.monotonic() - sent) / 2)
        self.offset = db_now - (local + half_trip)
        seconds = self.offset.total_seconds()
        if abs(seconds) > REPORT_OFFSET_SECONDS and abs(seconds - self._reported) >= 1:
            log.warning("this host's clock is %.1f s off the database's; the beat follows the database", -seconds)
            self._reported = seconds
