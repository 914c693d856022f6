"""The success recorder's own logic (``worker/recorder.py``): order, the bound on outstanding
writes, flush, a write that raises, fork. Its behaviour in a real worker is
``tests/integration/test_deferred_success.py``."""

from __future__ import annotations

import os
import threading
import time

import pytest

from taskplatform.worker.recorder import SuccessRecorder


class _Watch:
    """Stands in for ``leases.Watch``: only ``lost`` is read."""

    def __init__(self, lost: bool = False) -> None:
        self.lost = lost


def test_writes_run_in_the_order_they_were_handed_over_and_flush_waits_for_them():
    recorder = SuccessRecorder()
    done: list[int] = []
    gate = threading.Event()
    recorder.record(lambda: gate.wait(10), limit=100)
    for i in range(50):
        recorder.record(lambda i=i: done.append(i), limit=100)
    assert recorder.pending == 51
    gate.set()
    assert recorder.flush(timeout=10)
    assert done == list(range(50))
    assert recorder.pending == 0


def test_a_second_write_is_handed_over_only_once_the_first_has_finished():
    """The default bound: one outstanding write, so a stuck recorder holds the pool process
    instead of letting finished attempts pile up behind it."""
    recorder = SuccessRecorder()
    gate = threading.Event()
    recorder.record(lambda: gate.wait(10))
    handed: list[float] = []
    second = threading.Thread(target=lambda: (recorder.record(lambda: None), handed.append(time.monotonic())))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive() and not handed, "the second handoff waits while the first write is stuck"
    gate.set()
    second.join(timeout=10)
    assert handed and recorder.flush(timeout=10)


def test_a_write_that_raises_does_not_stop_the_ones_after_it():
    recorder = SuccessRecorder()
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("the database refused")

    recorder.record(boom, limit=2)
    recorder.record(lambda: done.append("after"), limit=2)
    assert recorder.flush(timeout=10)
    assert done == ["after"]


def test_flush_waits_for_a_write_whose_lease_is_live_and_gives_up_once_it_is_lost():
    recorder = SuccessRecorder()
    gate = threading.Event()
    watch = _Watch()
    recorder.record(lambda: gate.wait(30), watch)  # type: ignore[arg-type]
    assert not recorder.flush(timeout=1.0), "a stuck write with a live lease is waited for (here up to 1 s)"
    watch.lost = True
    started = time.monotonic()
    assert not recorder.flush()  # no timeout: it returns because the write can no longer land
    assert time.monotonic() - started < 5
    gate.set()
    assert recorder.flush(timeout=10)


def test_flush_with_nothing_handed_over_returns_at_once():
    assert SuccessRecorder().flush(timeout=0.01)


def test_a_forked_child_starts_with_a_recorder_of_its_own():
    """A body that forks while the recorder thread holds its lock: the child's recorder is
    reset at the fork (``os.register_at_fork``), so the child can record and flush."""
    from taskplatform.worker.recorder import success_recorder

    recorder = success_recorder()
    gate = threading.Event()
    recorder.record(lambda: gate.wait(10))
    pid = os.fork()
    if pid == 0:  # the child: one write of its own, flushed, then out
        ok = False
        try:
            marks: list[int] = []
            recorder.record(lambda: marks.append(1))
            ok = recorder.flush(timeout=5) and marks == [1]
        finally:
            os._exit(0 if ok else 1)
    gate.set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert recorder.flush(timeout=10)


def test_which_successes_are_deferred(monkeypatch):
    """Not a result Celery stores (the request's ``ignore_result`` overriding the task's), not
    with a callback, chain or chord, not eager, and not on SQLite (one writer at a time: the
    recorder would wait for the next body's transaction, which may outlast the lease)."""
    from types import SimpleNamespace

    from celery.app.task import Context

    from taskplatform.worker import task as task_module

    ignoring, storing = SimpleNamespace(ignore_result=True), SimpleNamespace(ignore_result=False)

    def request(**fields):
        return Context({"is_eager": False, "callbacks": None, "chain": None, "chord": None, **fields})

    monkeypatch.setattr(task_module, "connection", SimpleNamespace(vendor="postgresql"))
    assert task_module._defer_success(ignoring, request())
    assert not task_module._defer_success(storing, request())
    assert not task_module._defer_success(ignoring, request(ignore_result=False))
    assert task_module._defer_success(storing, request(ignore_result=True))
    assert not task_module._defer_success(ignoring, request(callbacks=[{"task": "x"}]))
    assert not task_module._defer_success(ignoring, request(chain=[{"task": "x"}]))
    assert not task_module._defer_success(ignoring, request(chord={"task": "x"}))
    assert not task_module._defer_success(ignoring, request(is_eager=True))
    monkeypatch.setattr(task_module, "connection", SimpleNamespace(vendor="sqlite"))
    assert not task_module._defer_success(ignoring, request())


# --- a success parked for the next claim (``park``, ``take``, ``settle``) ------------------------


def _parked(written: list[str], finished: list[bool], watch: object = None):
    from datetime import UTC, datetime

    from taskplatform.core.types import FinishedAttempt
    from taskplatform.worker.recorder import Parked

    attempt = FinishedAttempt(1, 1, None, "node-a:1", {}, datetime.now(UTC))
    return Parked(attempt, lambda: written.append("by the thread"), finished.append, watch)  # type: ignore[arg-type]


def test_a_parked_success_no_claim_takes_is_written_by_the_thread(poll):
    """An idle pool process: no claim comes, the recorder thread writes the success itself
    once ``RIDE_SECONDS`` have passed."""
    recorder, written, finished = SuccessRecorder(), [], []
    recorder.park(_parked(written, finished))
    poll(lambda: written == ["by the thread"], timeout=10, what="the thread's write")
    assert recorder.pending == 0 and finished == []


def test_a_claim_takes_the_parked_success_and_the_thread_does_not_write_it(monkeypatch):
    from taskplatform.worker import recorder as module

    monkeypatch.setattr(module, "RIDE_SECONDS", 60.0)
    recorder, written, finished = SuccessRecorder(), [], []
    recorder.park(_parked(written, finished))
    taken = recorder.take()
    assert taken is not None and recorder.take() is None
    assert recorder.pending == 1, "a taken success is outstanding until it is settled"
    taken.attempt.written = True  # what the claim's statement reports
    recorder.settle(taken)
    assert finished == [True] and recorder.pending == 0
    assert recorder.flush(timeout=10) and written == []


def test_a_success_the_claim_did_not_carry_is_written_by_the_thread(monkeypatch):
    """The claim's statement failed (or could not carry it): ``written`` stays None and the
    recorder thread writes the success, at once, not at the parking deadline."""
    from taskplatform.worker import recorder as module

    monkeypatch.setattr(module, "RIDE_SECONDS", 60.0)
    recorder, written, finished = SuccessRecorder(), [], []
    recorder.park(_parked(written, finished))
    taken = recorder.take()
    assert taken is not None
    recorder.settle(taken)
    assert recorder.flush(timeout=10)
    assert written == ["by the thread"] and finished == [] and recorder.pending == 0


def test_flush_writes_a_parked_success_at_once(monkeypatch):
    """A pool process leaving (``flush_on_exit``) writes what it parked, without waiting for a
    claim that will not come or for the parking deadline."""
    from taskplatform.worker import recorder as module

    monkeypatch.setattr(module, "RIDE_SECONDS", 60.0)
    recorder, written, finished = SuccessRecorder(), [], []
    recorder.park(_parked(written, finished))
    assert recorder.flush(timeout=10)
    assert written == ["by the thread"] and recorder.pending == 0 and recorder.take() is None


def test_a_success_is_parked_only_once_the_previous_write_has_finished():
    """The bound on outstanding writes holds for parked successes too."""
    recorder = SuccessRecorder()
    gate = threading.Event()
    recorder.record(lambda: gate.wait(10))
    written: list[str] = []
    parking = threading.Thread(target=lambda: recorder.park(_parked(written, [])))
    parking.start()
    parking.join(timeout=0.5)
    assert parking.is_alive() and recorder.take() is None, "the park waits while the first write is stuck"
    gate.set()
    parking.join(timeout=10)
    assert not parking.is_alive() and recorder.flush(timeout=10) and written == ["by the thread"]


@pytest.mark.django_db(transaction=True)
def test_a_claim_inside_a_transaction_leaves_the_parked_success_parked(monkeypatch):
    """A claim made inside a transaction (an eager call in an atomic block) must not carry the
    parked success: the transaction's rollback would take the success with it, and nothing
    would write it again. It stays parked for the next claim, or the thread."""
    from django.db import connection, transaction

    from taskplatform.worker import recorder as module
    from taskplatform.worker import task as task_module

    if connection.vendor != "postgresql":
        pytest.skip("claims carry successes on PostgreSQL only")
    monkeypatch.setattr(module, "RIDE_SECONDS", 60.0)
    recorder = SuccessRecorder()  # not the process's: its thread would be left in a 60 s wait
    monkeypatch.setattr(task_module, "success_recorder", lambda: recorder)
    written: list[str] = []
    recorder.park(_parked(written, []))
    try:
        with transaction.atomic():
            assert task_module._parked_for_claim() is None
        assert recorder.pending == 1
        taken = task_module._parked_for_claim()
        assert taken is not None, "outside the transaction, the next claim takes it"
        recorder.settle(taken)  # not carried (written is None): the thread writes it
        assert recorder.flush(timeout=10) and written == ["by the thread"]
    finally:
        recorder.flush(timeout=10)
