"""The success recorder: a non-atomic body's success written behind the pool process's back.

A pool process used to wait for two durable commits per task: the claim, before the body (it
must: a claim a crash could roll back lets a second body run under the same token), and the
success, after it. With Celery's ``acks_late`` and a prefetch of one, that second wait sits in
every task's cycle. Measured on the development machine (``docs/benchmarks.md``, "the
floor"): plain Celery whose task makes one commit runs at 0.67 of plain Celery end to end,
with two commits at 0.54, whatever writes them.

A non-atomic body's success does not need to be durable before the message is acknowledged.
Once the claim has committed, the ledger owns the execution: its lease and the rescuer bring
back an attempt that never recorded its end, whatever happened to the message (a pool
process SIGKILLed after its body already takes that path today: Celery acknowledges the
message of a lost pool process). So the pool process hands the success to this thread and
takes its next message while the success commits; the write itself is unchanged (a
compare-and-set fenced by the token, retried while the lease may be live,
``_record_while_leased``), and the attempt's lease is renewed until it lands.

What changes, and is documented (``docs/guarantees.md``):

* a pool process killed in the few milliseconds between the body's return and the commit
  leaves its attempt to the rescuer, which runs the body again (a re-run explained by a
  fault, as for a kill a moment earlier);
* the ledger shows ``SUCCEEDED`` a few milliseconds after Celery's ``task-succeeded``;
* every pool process holds a second database connection, the recorder's.

A pool process that exits in an orderly way (``max_tasks_per_child``, a warm shutdown, the
autoscaler) writes what it holds first (``flush``, on Celery's ``worker_process_shutdown``
and at interpreter exit). ``TASKPLATFORM_DEFERRED_SUCCESS = False`` records in the pool
process as before. Atomic bodies always record in their own transaction.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("taskplatform.tasks")

#: How long an orderly exit waits for the recorder to write what it holds.
FLUSH_SECONDS = 30.0


class SuccessRecorder:
    """One thread per process that runs success writes in the order they were handed over."""

    def __init__(self) -> None:
        self._pid = 0
        self._queue: queue.SimpleQueue[Callable[[], None] | threading.Event] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0

    def record(self, write: Callable[[], None]) -> None:
        """Run ``write`` on the recorder thread (it handles its own errors)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked pool process: the parent's thread is not here
                self._queue = queue.SimpleQueue()
                self._thread = None
                self._pending = 0
                self._pid = os.getpid()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="taskplatform-success-recorder", daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put(write)

    @property
    def pending(self) -> int:
        """Writes handed over and not finished yet (in this process)."""
        return self._pending if self._pid == os.getpid() else 0

    def flush(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Wait until every write handed over so far has finished; False on timeout."""
        with self._lock:
            if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
                return True
            done = threading.Event()
            self._queue.put(done)
        finished = done.wait(timeout)
        if not finished:
            log.error("the success recorder did not finish in %.0f s; the rescuer will re-run what it held", timeout)
        return finished

    def _run(self) -> None:
        from django.db import connection

        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                item()
            except BaseException:  # the thread must live on: each write reports its own failure
                log.exception("recording a success failed; the rescuer will re-queue the attempt")
                try:
                    connection.close()
                except Exception:
                    log.debug("closing the recorder's connection failed", exc_info=True)
            finally:
                with self._lock:
                    self._pending -= 1


_recorder = SuccessRecorder()


def success_recorder() -> SuccessRecorder:
    """The process-wide success recorder."""
    return _recorder


def flush_on_exit(**_: object) -> None:
    """Celery's ``worker_process_shutdown`` (and interpreter exit): write what is held."""
    _recorder.flush()


atexit.register(flush_on_exit)
