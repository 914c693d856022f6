"""Lease renewal for running executions: one daemon thread per worker process.

A claimed attempt holds a lease of ``lease_seconds``; this thread renews it every third of
that while the body runs, on its own database connection. Short bodies finish before the
first renewal and cost nothing. If a renewal is refused (the execution was rescued,
re-claimed or cancelled), the attempt is marked lost: the body can check
``task.lease_lost`` and its final write-back will be refused by the fencing token anyway.
If the process is stopped (SIGSTOP) or dies, renewals stop and the lease expires, which is
how the rescuer learns the attempt is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from django.db import DatabaseError, connection

from . import ledger

log = logging.getLogger("taskplatform.heartbeat")


@dataclass(eq=False)
class Watch:
    """One attempt whose lease is being renewed."""

    execution_id: int
    token: int
    lease_seconds: int
    worker: str
    next_renewal: float = field(default=0.0)
    lost: bool = False

    def interval(self) -> float:
        return max(0.5, self.lease_seconds / 3)


class LeaseKeeper:
    """Renews the leases of the attempts running in this process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watches: set[Watch] = set()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._wake_at = float("inf")  # when the thread wakes next on its own

    def watch(self, execution_id: int, token: int, lease_seconds: int, worker: str) -> Watch:
        """Start renewing the lease of the attempt ``(execution_id, token)``."""
        w = Watch(execution_id, token, lease_seconds, worker)
        w.next_renewal = time.monotonic() + w.interval()
        if self._pid != os.getpid():
            # A forked pool child inherits this object (and possibly a held lock) but not
            # the thread: start afresh.
            self._cond = threading.Condition()
            self._watches = set()
            self._thread = None
            self._pid = os.getpid()
        with self._cond:
            self._ensure_thread()
            self._watches.add(w)
            if w.next_renewal < self._wake_at:  # only wake the thread when it would sleep past this
                self._cond.notify()
        return w

    def unwatch(self, w: Watch) -> None:
        """Stop renewing (the attempt finished)."""
        with self._cond:
            self._watches.discard(w)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="taskplatform-lease-keeper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [w for w in self._watches if w.next_renewal <= now]
                if not due:
                    self._wake_at = min((w.next_renewal for w in self._watches), default=now + 60)
                    self._cond.wait(timeout=max(0.05, self._wake_at - now))
                    self._wake_at = float("-inf")  # awake: new watches need no notification
                    continue
            for w in due:
                try:
                    renewed = ledger.renew_lease(w.execution_id, w.token, w.lease_seconds)
                except DatabaseError:
                    log.warning("lease renewal failed; retrying", exc_info=True, extra={"execution_id": w.execution_id})
                    connection.close()
                    w.next_renewal = time.monotonic() + min(1.0, w.interval())
                    continue
                if renewed:
                    w.next_renewal = time.monotonic() + w.interval()
                    continue
                w.lost = True
                self.unwatch(w)
                log.warning(
                    "lease lost",
                    extra={"execution_id": w.execution_id, "fencing_token": w.token, "worker": w.worker},
                )
                try:
                    ledger.record_lease_lost(w.execution_id, w.token, w.worker)
                except DatabaseError:
                    connection.close()


_keeper = LeaseKeeper()


def lease_keeper() -> LeaseKeeper:
    """The process-wide lease keeper."""
    return _keeper
