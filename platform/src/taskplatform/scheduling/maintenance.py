"""The fleet's maintenance duties, off any hot thread: the rescuer, the counts snapshot and
ledger pruning.

One process in the fleet runs them: whichever holds the maintenance lease
(``MAINTENANCE_LOCK`` on the beat's lock backend). Candidates are the beat leader
(``LockedScheduler``) and every worker (``TASKPLATFORM_WORKER_MAINTENANCE``, on by default):
a project that keeps its own scheduler, or none, still gets its lost messages republished,
its parked retries published when due and its expired leases rescued. A holder that dies
frees the lease when it expires (``MaintenanceLease``); another candidate takes it on its
next look.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from django.db import close_old_connections, connections
from django.utils import timezone

from ..backends import get_lock_backend
from ..backends.base import Lease, new_owner
from ..conf import PlatformSettings, platform_settings
from ..core import ledger
from ..core.rescuer import run_rescuer
from ..models import CountsSnapshot

log = logging.getLogger("taskplatform.beat")

#: Executions deleted per pruning transaction.
PRUNE_BATCH = 1000
#: The longest a pruning pass runs: a backlog left after it is worked on at the next look (a
#: second later), between the rescuer's passes, not an interval later.
PRUNE_PASS_SECONDS = 10.0
#: The first pruning pass comes this long after the thread starts (not in a deploy's first minute).
FIRST_PRUNE_SECONDS = 60.0
#: The lease whose holder runs the maintenance duties (for the default beat lock name).
MAINTENANCE_LOCK = "taskplatform.maintenance"


def maintenance_lock_name(conf: PlatformSettings) -> str:
    """The maintenance lease of this deployment: one per ``TASKPLATFORM_BEAT_LOCK_NAME``, so two
    deployments that share a lock server (each with its own database) each have a rescuer. The
    default keeps the name earlier releases used."""
    if conf.beat_lock_name == "taskplatform.beat":
        return MAINTENANCE_LOCK
    return f"{conf.beat_lock_name}:maintenance"


class MaintenanceLease:
    """Whether this process holds the maintenance lease (``holds()`` is called every second).

    The lease lasts ``TASKPLATFORM_BEAT_LEASE_SECONDS``; its holder renews it every third of
    that, and a candidate that does not hold it tries every ``rescue_interval_seconds`` (a
    fleet of workers costs the lock backend one request per worker per interval). A dead
    holder's duties resume within the lease plus one interval. Released on ``release()``."""

    def __init__(self, conf: PlatformSettings, identity: str | None = None) -> None:
        self.conf = conf
        self.identity = identity or new_owner()
        self.ttl = float(conf.beat_lease_seconds)
        self.lease: Lease | None = None
        self._checked = float("-inf")

    def holds(self) -> bool:
        now = time.monotonic()
        period = self.ttl / 3 if self.lease is not None else float(self.conf.rescue_interval_seconds)
        if now - self._checked >= period:
            self._checked = now
            try:
                backend = get_lock_backend(self.conf.beat_lock_alias)
                if self.lease is not None:
                    self.lease = backend.renew(self.lease, self.ttl)
                if self.lease is None:
                    self.lease = backend.acquire(maintenance_lock_name(self.conf), self.ttl, identity=self.identity)
                    if self.lease is not None:
                        log.info("%s runs the maintenance duties (rescuer, pruning)", self.identity)
            except Exception:  # an unreachable lock server: not the holder until it answers
                log.warning("maintenance lease: the lock backend did not answer", exc_info=True)
                self.lease = None
                # The database lock backend uses this thread's connection: one the server closed
                # (a restart, a failover, pg_terminate_backend) would fail every later try.
                connections.close_all()
        return self.lease is not None and self.lease.remaining() > 0

    def release(self) -> None:
        if self.lease is not None:
            try:
                get_lock_backend(self.conf.beat_lock_alias).release(self.lease)
            except Exception:
                log.warning("maintenance lease: could not release it (it expires)", exc_info=True)
            self.lease = None


class Maintenance(threading.Thread):
    """A candidate for the fleet's maintenance duties (rescuer, counts snapshot, ledger pruning),
    in a thread of its own: it runs them while it holds the maintenance lease and
    ``is_leading()`` says it may (a beat's leadership; always, in a worker)."""

    def __init__(
        self, conf: PlatformSettings, is_leading: Callable[[], bool], lease: MaintenanceLease | None = None
    ) -> None:
        super().__init__(name="taskplatform-maintenance", daemon=True)
        self.conf = conf
        self.lease = lease or MaintenanceLease(conf)
        self.is_leading = lambda: is_leading() and self.lease.holds()
        self._stop_event = threading.Event()

    def _keep_going(self) -> bool:
        """Asked between rows of a pass: renews the lease when due; False once it is
        another's, or once ``stop()`` was called (a long pass must not outlast the join)."""
        return not self._stop_event.is_set() and self.is_leading()

    def stop(self) -> None:
        """Stop after the current pass (joined, so its database connection is closed)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=30)

    def run(self) -> None:
        next_rescue = time.monotonic()
        next_count = time.monotonic()
        next_prune = time.monotonic() + min(FIRST_PRUNE_SECONDS, self.conf.prune_interval_seconds)
        while not self._stop_event.wait(min(1.0, self.conf.rescue_interval_seconds)):
            try:
                close_old_connections()
                if not self.is_leading():
                    continue
            except Exception:  # this thread must outlive any error: it is the fleet's rescuer
                log.exception("maintenance: could not tell whether this process holds the duties")
                connections.close_all()
                continue
            now = time.monotonic()
            try:
                if now >= next_rescue:
                    next_rescue = now + self.conf.rescue_interval_seconds
                    run_rescuer(keep_going=self._keep_going)  # renews the lease during a long pass
                    if not self._keep_going():
                        continue  # the lease is another's now (or this thread is stopping)
                if now >= next_count:
                    next_count = now + self.conf.counts_interval_seconds
                    CountsSnapshot.take()
                if now >= next_prune and self.conf.retention_days > 0:
                    next_prune = now + self.conf.prune_interval_seconds
                    if self._prune_pass():
                        next_prune = now  # a backlog is left: the next look goes on with it
            except Exception:
                log.exception("beat maintenance pass failed; retrying next interval")
            finally:
                close_old_connections()
        self.lease.release()
        connections.close_all()  # this thread's connections

    def _prune_pass(self) -> bool:
        """Batch after batch for up to ``PRUNE_PASS_SECONDS``; True if a backlog is left.

        Once an interval is not enough at volume: the measured rate is about 4,000 executions
        a second (1 M rows, 5 M events; docs/benchmarks.md), so a pass of a minute an hour
        kept up with about 70 finished executions a second. A backlog is worked off in passes
        of a few seconds, one after another, with the rescuer's passes between them."""
        cutoff = timezone.now() - timedelta(days=self.conf.retention_days)
        budget = time.monotonic() + PRUNE_PASS_SECONDS
        while True:
            full = ledger.prune(cutoff, batch_size=PRUNE_BATCH) == PRUNE_BATCH
            if not full:
                return False
            if time.monotonic() >= budget or not self._keep_going():
                return True


#: The worker's maintenance thread (its main process), if it runs one.
_worker_maintenance: Maintenance | None = None


def start_worker_maintenance(sender: object = None, **kwargs: object) -> None:
    """Celery's ``worker_ready``: run the maintenance duties from this worker when it holds the
    lease (``TASKPLATFORM_WORKER_MAINTENANCE``)."""
    global _worker_maintenance
    conf = platform_settings()
    if not conf.worker_maintenance or _worker_maintenance is not None:
        return
    _worker_maintenance = Maintenance(conf, is_leading=lambda: True)
    _worker_maintenance.start()


def stop_worker_maintenance(sender: object = None, **kwargs: object) -> None:
    """Celery's ``worker_shutdown``: stop the thread and release the lease."""
    global _worker_maintenance
    if _worker_maintenance is not None:
        _worker_maintenance.stop()
        _worker_maintenance = None
