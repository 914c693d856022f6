"""The success recorder's own logic (``worker/recorder.py``): order, the bound on outstanding
writes, flush, a write that raises, fork. Its behaviour in a real worker is
``tests/integration/test_deferred_success.py``."""

from __future__ import annotations

import os
import threading
import time

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
