"""The leader's maintenance duties, off the tick thread: the rescuer and ledger pruning.

Without a leader these duties run nowhere, which is why they live with the beat: one
process in the fleet runs them, and a successor picks them up when it takes over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from django.db import close_old_connections, connections
from django.utils import timezone

from ..conf import PlatformSettings
from ..core import ledger
from ..core.rescuer import run_rescuer

log = logging.getLogger("taskplatform.beat")

#: Executions deleted per pruning transaction.
PRUNE_BATCH = 1000


class Maintenance(threading.Thread):
    """The leader's maintenance duties, off the tick thread: rescuer and ledger pruning."""

    def __init__(self, conf: PlatformSettings, is_leading: Callable[[], bool]) -> None:
        super().__init__(name="taskplatform-maintenance", daemon=True)
        self.conf = conf
        self.is_leading = is_leading
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """Stop after the current pass (joined, so its database connection is closed)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=30)

    def run(self) -> None:
        next_rescue = time.monotonic()
        next_prune = time.monotonic() + min(60.0, self.conf.prune_interval_seconds)
        while not self._stop_event.wait(min(1.0, self.conf.rescue_interval_seconds)):
            if not self.is_leading():
                continue
            now = time.monotonic()
            try:
                if now >= next_rescue:
                    next_rescue = now + self.conf.rescue_interval_seconds
                    run_rescuer()
                if now >= next_prune and self.conf.retention_days > 0:
                    next_prune = now + self.conf.prune_interval_seconds
                    cutoff = timezone.now() - timedelta(days=self.conf.retention_days)
                    # Batch after batch for up to a minute: retention keeps up with the load.
                    budget = time.monotonic() + 60
                    while self.is_leading() and time.monotonic() < budget and ledger.prune(cutoff) == PRUNE_BATCH:
                        pass
            except Exception:
                log.exception("beat maintenance pass failed; retrying next interval")
            finally:
                close_old_connections()
        connections.close_all()  # this thread's connections
