"""The success recorder's own logic (``worker/recorder.py``): order, flush, and a write that
raises. Its behaviour in a real worker is ``tests/integration/test_deferred_success.py``."""

from __future__ import annotations

import threading

from taskplatform.worker.recorder import SuccessRecorder


def test_writes_run_in_the_order_they_were_handed_over_and_flush_waits_for_them():
    recorder = SuccessRecorder()
    done: list[int] = []
    gate = threading.Event()
    recorder.record(lambda: gate.wait(10))
    for i in range(50):
        recorder.record(lambda i=i: done.append(i))
    assert recorder.pending == 51
    gate.set()
    assert recorder.flush(timeout=10)
    assert done == list(range(50))
    assert recorder.pending == 0


def test_a_write_that_raises_does_not_stop_the_ones_after_it():
    recorder = SuccessRecorder()
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("the database refused")

    recorder.record(boom)
    recorder.record(lambda: done.append("after"))
    assert recorder.flush(timeout=10)
    assert done == ["after"]


def test_flush_reports_a_write_that_does_not_finish_in_time():
    recorder = SuccessRecorder()
    gate = threading.Event()
    recorder.record(lambda: gate.wait(10))
    assert not recorder.flush(timeout=0.2)
    gate.set()
    assert recorder.flush(timeout=10)


def test_flush_with_nothing_handed_over_returns_at_once():
    assert SuccessRecorder().flush(timeout=0.01)
