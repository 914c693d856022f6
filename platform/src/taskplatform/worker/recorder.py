"""The success recorder: a non-atomic body's success written behind the pool process's back.

A pool process used to wait for two durable commits per task: the claim, before the body (it
must: a claim a crash could roll back lets a second body run under the same token), and the
success, after it. With Celery's ``acks_late`` and a prefetch of one, that second wait sits in
every task's cycle. Measured on the development machine (``docs/benchmarks.md``, "the
floor"): plain Celery whose task makes one commit runs at 0.67 of plain Celery end to end,
with two commits at 0.54, whatever writes them.

A non-atomic body's success does not need to be durable before the message is acknowledged.
Once the claim has committed, the ledger owns the execution: its lease and the rescuer bring
back an attempt that never recorded its end, whatever happened to the message. So the pool
process hands the success to this thread and takes its next message while the success
commits; the write itself is unchanged (a compare-and-set fenced by the token, retried while
the lease may be live), and the attempt's lease is renewed until it lands.

The exposure is bounded to one write: a process hands over its next success only once the
previous one has finished (``record`` waits for it), so a recorder that is stuck (a database
outage, a lock) holds the pool process as the synchronous write did, rather than letting
finished attempts pile up behind it. A process that leaves in an orderly way (``--max-tasks-
per-child``, a warm shutdown, the autoscaler, a cold shutdown's SIGTERM) writes what it holds
first (``flush``, on Celery's ``worker_process_shutdown``; ``worker_shutdown`` for the solo and
threads pools), for as long as the write may still succeed: until it lands or the attempt's
lease is certainly lost.

The success rides with the next claim. A success handed over is first parked
(``park``): if the same pool process claims its next message within ``RIDE_SECONDS``, that
claim's statement writes it too (``take``, ``settle``; ``core/_pg.py: _carrying``), so a
steady stream costs one durable commit a task, not two, and no handoff to this thread. If no
claim comes in time (the process is idle, or its next claim is not one statement: another
database, a retry), this thread writes it as before; so does a flush.

What changes is documented in ``docs/architecture.md`` ("The success, written behind the pool
process"): a pool process killed in the milliseconds between its body's return and the write
leaves the attempt to the rescuer, which runs the body again; the ledger says ``SUCCEEDED`` a
few milliseconds after Celery's ``task-succeeded``; every pool process holds a second database
connection. ``TASKPLATFORM_DEFERRED_SUCCESS = False`` records in the pool process as before.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.leases import Watch
    from ..core.types import FinishedAttempt

log = logging.getLogger("taskplatform.tasks")

#: How often a waiting ``flush`` looks whether the writes it waits for can still land.
FLUSH_CHECK_SECONDS = 0.5
#: How many writes a pool process may have handed over and not finished (parked included):
#: a recorder that is stuck holds the pool process rather than letting successes pile up.
OUTSTANDING = 1
#: How long a parked success waits for the pool process's next claim to carry it before the
#: recorder thread writes it: a pool process killed in that time leaves the attempt to the
#: rescuer, which runs the body again (``docs/architecture.md``). 10 ms: a busy pool process
#: claims its next message within a few milliseconds (1.03 commits a task at saturation, against
#: 1.02 with 50 ms, ``docs/benchmarks.md``), and the window of that re-run is a fifth of 50 ms's.
RIDE_SECONDS = 0.01


@dataclass(eq=False)
class Parked:
    """A success waiting for the next claim (``park``)."""

    attempt: FinishedAttempt  #: what the claim's statement writes
    write: Callable[[], None]  #: the recorder thread's own write of it, if no claim carries it
    finish: Callable[[bool], None]  #: after a claim carried it: called with True (written) or False (stale)
    watch: Watch | None
    deadline: float = 0.0


#: How long after its last parked success the recorder thread keeps waking every
#: ``RIDE_SECONDS`` on its own; a success parked after that wakes it (``_WAKE``). Waking it for
#: every success would cost the handoff that riding with the claim saves: the thread would
#: take the GIL from the pool process each time.
STAY_AWAKE_SECONDS = 1.0

#: Wakes the recorder thread out of an untimed wait: a success was parked.
_WAKE = object()


class SuccessRecorder:
    """One thread per process that runs success writes, one at a time, in order."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """A fresh state: at construction, and in a forked child (the parent's thread is not
        there, and its lock may have been held at the fork)."""
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Watch | None] | threading.Event | object] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._held: list[Watch | None] = []  # the watches of writes handed over, not finished
        self._parked: Parked | None = None
        self._parked_at = float("-inf")  # when the last success was parked
        self._timed = False  # the thread's wait ends by itself within ``RIDE_SECONDS``

    def record(self, write: Callable[[], None], watch: Watch | None = None, *, limit: int = OUTSTANDING) -> None:
        """Run ``write`` on the recorder thread (it handles its own errors); first wait until
        fewer than ``limit`` writes are outstanding. ``watch`` is the attempt's lease: ``flush``
        stops waiting for a write whose lease is lost."""
        with self._cond:
            self._wait_below(limit)
            self._held.append(watch)
            self._queue.put((write, watch))

    def _wait_below(self, limit: int) -> None:
        while len(self._held) >= limit:
            self._ensure_thread()
            self._cond.wait(FLUSH_CHECK_SECONDS)
        self._ensure_thread()

    def park(self, parked: Parked, *, limit: int = OUTSTANDING) -> None:
        """Hold a success for the next claim (``take``) for up to ``RIDE_SECONDS``; the
        recorder thread writes it after that. Waits as ``record`` does: a parked success is
        an outstanding write."""
        with self._cond:
            self._wait_below(limit)
            self._parked_at = time.monotonic()
            parked.deadline = self._parked_at + RIDE_SECONDS
            self._held.append(parked.watch)
            if self._parked is not None:  # more than one outstanding allowed: the older one is written now
                self._queue.put((self._parked.write, self._parked.watch))
            self._parked = parked
            if not self._timed:
                self._queue.put(_WAKE)

    def take(self) -> Parked | None:
        """The parked success, for the caller's claim to carry; the caller must ``settle`` it."""
        with self._cond:
            parked, self._parked = self._parked, None
            return parked

    def settle(self, parked: Parked) -> None:
        """After the claim that took ``parked``: done if the claim's statement wrote it (or
        found it stale); otherwise (the statement failed, or could not carry it) the recorder
        thread writes it now."""
        written = parked.attempt.written
        if written is None:
            self._queue.put((parked.write, parked.watch))
            return
        try:
            parked.finish(written)
        finally:
            with self._cond:
                self._held.remove(parked.watch)
                self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Writes handed over and not finished yet (in this process)."""
        with self._cond:
            return len(self._held)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write handed over so far has finished, or can no longer succeed
        (its lease is lost), or ``timeout`` passes; True if every write finished."""
        with self._cond:
            if not self._held:
                return True
            self._ensure_thread()
            parked, self._parked = self._parked, None
            if parked is not None:
                self._queue.put((parked.write, parked.watch))
            done = threading.Event()
            self._queue.put(done)
        waited = 0.0
        while not done.wait(FLUSH_CHECK_SECONDS):
            waited += FLUSH_CHECK_SECONDS
            with self._cond:
                hopeless = all(w is not None and w.lost for w in self._held)
            if hopeless or (timeout is not None and waited >= timeout):
                log.error("the success recorder did not finish; the rescuer will re-queue what it held")
                return False
        return True

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="taskplatform-success-recorder", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        from django.db import connection

        while True:
            with self._cond:
                now = time.monotonic()
                if self._parked is not None:
                    timeout: float | None = max(0.0, self._parked.deadline - now)
                elif now - self._parked_at < STAY_AWAKE_SECONDS:
                    timeout = RIDE_SECONDS
                else:
                    timeout = None
                self._timed = timeout is not None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                with self._cond:
                    parked = self._parked
                    if parked is None or parked.deadline > time.monotonic():
                        continue  # taken by a claim, or another success parked since
                    self._parked = None
                item = (parked.write, parked.watch)
            if item is _WAKE:
                continue
            if isinstance(item, threading.Event):
                item.set()
                continue
            assert isinstance(item, tuple)
            write, watch = item
            try:
                write()
            except BaseException:  # the thread must live on: each write reports its own failure
                log.exception("recording a success failed; the rescuer will re-queue the attempt")
                try:
                    connection.close()
                except Exception:
                    log.debug("closing the recorder's connection failed", exc_info=True)
            finally:
                with self._cond:
                    self._held.remove(watch)
                    self._cond.notify_all()


_recorder = SuccessRecorder()
os.register_at_fork(after_in_child=_recorder._reset)


def success_recorder() -> SuccessRecorder:
    """The process-wide success recorder."""
    return _recorder


def flush_on_exit(**_: object) -> None:
    """Celery's ``worker_process_shutdown`` and ``worker_shutdown``: write what is held."""
    _recorder.flush()


atexit.register(flush_on_exit)  # the solo and threads pools' cold shutdown (prefork children use os._exit)
