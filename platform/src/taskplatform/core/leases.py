"""Lease renewal for running executions: one daemon thread per worker process.

A claimed attempt holds a lease of ``lease_seconds``; this thread renews it every third of
that while the body runs, on its own database connection. Short bodies finish before the
first renewal and cost nothing. If a renewal is refused (the execution was rescued,
re-claimed or cancelled), the attempt is marked lost: the body can check
``task.lease_lost`` and its final write-back will be refused by the fencing token anyway.
If the process is stopped (SIGSTOP) or dies, renewals stop and the lease expires, which is
how the rescuer learns the attempt is gone.

The thread must outlive every error: if it died, the bodies of this process would run on
without renewals, be rescued as crashed and run a second time while they still believe they
own their keys. So a failed renewal, whatever it raised (a ``DatabaseError``, a driver error
Django did not wrap, a bug), is logged and retried shortly on a fresh connection; the loop
itself runs under a supervisor that restarts it after anything unexpected; and a keeper
thread found dead is started again by the next ``watch()`` or ``ensure_running()`` (which
``task.lease_lost`` calls). When renewals keep failing until the lease has certainly run
out — measured on this process's monotonic clock from the last renewal known to have
succeeded, which is later than the moment the database extended it — the attempt is marked
lost without waiting for the database to say so, and is no longer renewed.

A renewal refused because an operator stopped the attempt (cancel, "mark failed") is lost
too, but the body runs on (a revoke is best effort): its lease is then the row's *fence*,
which no new attempt and no flow compensation passes, and the keeper goes on extending it
(``ledger.extend_fence``) until the body ends, so the fence ends within one lease of the body's
end or of this process's death.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from django.db import connection

from . import ledger

log = logging.getLogger("taskplatform.heartbeat")

#: Delay before retrying a failed renewal (capped by a third of the lease).
RETRY_SECONDS = 1.0
#: Delay before the supervisor restarts the renewal loop after an unexpected error.
RESTART_SECONDS = 0.5


@dataclass(eq=False)
class Watch:
    """One attempt whose lease is being renewed."""

    execution_id: int
    token: int
    lease_seconds: int
    worker: str
    next_renewal: float = field(default=0.0)
    #: Monotonic time by which the lease was last known extended (claim or renewal returned).
    renewed_at: float = field(default_factory=time.monotonic)
    #: Stopped by an operator while the body runs: the lease is kept as the row's fence
    #: (``ledger.extend_fence``) until the body ends.
    fencing: bool = False
    _lost: bool = False

    def interval(self) -> float:
        return max(0.5, self.lease_seconds / 3)

    def expired(self, now: float | None = None) -> bool:
        """True once the lease has certainly run out: no renewal for ``lease_seconds``."""
        return (time.monotonic() if now is None else now) - self.renewed_at >= self.lease_seconds

    @property
    def lost(self) -> bool:
        """Whether this attempt no longer owns its key (renewal refused, or the lease ran out).

        Computed on read as well as by the thread, so a body sees it even while the keeper
        is stuck in a renewal that does not return. Once lost, always lost.
        """
        if not self._lost and self.expired():
            self._lost = True
        return self._lost

    def mark_lost(self) -> None:
        self._lost = True


class LeaseKeeper:
    """Renews the leases of the attempts running in this process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watches: set[Watch] = set()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._wake_at = float("inf")  # when the thread wakes next on its own

    def watch(
        self, execution_id: int, token: int, lease_seconds: int, worker: str, *, renewed_at: float | None = None
    ) -> Watch:
        """Start renewing the lease of the attempt ``(execution_id, token)``, last extended at
        ``renewed_at`` (monotonic, taken before the request that extended it; default: now,
        for a claim just made). The loss of the lease is counted from it, and the first
        renewal is due a third of the lease after it."""
        w = Watch(execution_id, token, lease_seconds, worker)
        if renewed_at is not None:
            w.renewed_at = min(renewed_at, w.renewed_at)
        w.next_renewal = w.renewed_at + w.interval()
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

    def ensure_running(self) -> None:
        """Start the keeper thread again if it is not running while leases need renewing."""
        if self._pid != os.getpid():
            return  # nothing watched in this process yet
        with self._cond:
            if self._watches:
                self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            if self._thread is not None:
                log.error("the lease keeper thread was dead; restarting it")
            self._thread = threading.Thread(target=self._supervise, name="taskplatform-lease-keeper", daemon=True)
            self._thread.start()

    def _supervise(self) -> None:
        """Run the renewal loop forever, restarting it after any error it lets through."""
        while True:
            try:
                self._run()
            except BaseException:  # the keeper must not die: see the module docstring
                try:
                    log.exception("lease keeper loop failed; restarting it")
                    self._close_connection()
                except BaseException:  # even logging failed: keep renewing
                    pass
                time.sleep(RESTART_SECONDS)  # back off, not synchronisation

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [w for w in self._watches if w.next_renewal <= now or (w.lost and not w.fencing)]
                if not due:
                    self._wake_at = min((w.next_renewal for w in self._watches), default=now + 60)
                    self._cond.wait(timeout=max(0.05, self._wake_at - now))
                    self._wake_at = float("-inf")  # awake: new watches need no notification
                    continue
            for w in due:
                self._renew(w)

    def _watched(self, w: Watch) -> bool:
        with self._cond:
            return w in self._watches

    def _renew(self, w: Watch) -> None:
        """Renew one lease; on any error retry soon, and give up once it has certainly expired."""
        if not self._watched(w):
            return  # finished while we were renewing others: nothing to renew, nothing lost
        if w.fencing:
            self._keep_fence(w)
            return
        if w.lost:  # ran out while renewals were failing (or the keeper was stuck)
            self._lost(w, "lease expired locally: no renewal succeeded for its whole duration")
            return
        try:
            renewed = ledger.renew_lease(w.execution_id, w.token, w.lease_seconds)
        except Exception:
            log.warning("lease renewal failed; retrying", exc_info=True, extra={"execution_id": w.execution_id})
            self._close_connection()
            if w.lost:
                self._lost(w, "lease expired locally: no renewal succeeded for its whole duration")
            else:
                w.next_renewal = time.monotonic() + min(RETRY_SECONDS, w.interval())
            return
        if renewed:
            w.renewed_at = time.monotonic()
            w.next_renewal = w.renewed_at + w.interval()
        elif self._watched(w):  # refused while still running: somebody else owns the key now
            # Or an operator stopped the attempt: its lease is then the row's fence, kept while
            # the body runs (``ledger.extend_fence``).
            try:
                fencing = ledger.extend_fence(w.execution_id, w.token, w.lease_seconds)
            except Exception:
                log.warning("could not keep the fence", exc_info=True, extra={"execution_id": w.execution_id})
                self._close_connection()
                fencing = False
            self._lost(w, "lease renewal refused", fencing=fencing)

    def _keep_fence(self, w: Watch) -> None:
        """Extend the fence of a stopped attempt whose body still runs; stop once there is none."""
        try:
            kept = ledger.extend_fence(w.execution_id, w.token, w.lease_seconds)
        except Exception:
            log.warning("could not keep the fence; retrying", exc_info=True, extra={"execution_id": w.execution_id})
            self._close_connection()
            kept = None
        now = time.monotonic()
        if kept:
            w.renewed_at = now
            w.next_renewal = now + w.interval()
        elif kept is None and not w.expired(now):
            w.next_renewal = now + min(RETRY_SECONDS, w.interval())
        else:
            self.unwatch(w)  # the fence is gone (or ran out while extensions failed)

    def _lost(self, w: Watch, why: str, *, fencing: bool = False) -> None:
        w.mark_lost()
        if fencing:
            w.fencing = True
            w.renewed_at = time.monotonic()
            w.next_renewal = w.renewed_at + w.interval()
        else:
            self.unwatch(w)
        log.warning(
            "lease lost: %s",
            why,
            extra={"execution_id": w.execution_id, "fencing_token": w.token, "worker": w.worker},
        )
        try:
            ledger.record_lease_lost(w.execution_id, w.token, w.worker)
        except Exception:
            log.warning("could not record the lost lease", exc_info=True, extra={"execution_id": w.execution_id})
            self._close_connection()

    @staticmethod
    def _close_connection() -> None:
        """Drop this thread's connection after an error: the next renewal opens a fresh one."""
        try:
            connection.close()
        except Exception:
            log.debug("closing the lease keeper's connection failed", exc_info=True)


_keeper = LeaseKeeper()


def lease_keeper() -> LeaseKeeper:
    """The process-wide lease keeper."""
    return _keeper
