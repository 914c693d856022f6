"""G6 without false alarms, under faults: the lease keeper survives any renewal error.

A keeper thread that died on an error would leave long bodies unrenewed: they would be rescued
as crashed and run twice, each believing it owns the key. These tests run a real keeper thread
against the real database; the only thing injected is the error a renewal raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from django.db import connection
from django.utils import timezone

from taskplatform import submit
from taskplatform.core import ledger
from taskplatform.core.leases import LeaseKeeper
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import EventKind, Execution, JobDefinition
from tests.helpers import event_kinds, wait_for
from tests.testapp.models import EffectRaw

pytestmark = [pytest.mark.django_db(transaction=True)]


class Renewals:
    """Wraps ``ledger.renew_lease``: raises ``RuntimeError`` for the first ``failures`` calls
    (an error that is not a ``DatabaseError``), then renews for real and counts successes."""

    def __init__(self, real: Callable[[int, int, int], bool], failures: int) -> None:
        self.real = real
        self.failures = failures
        self.failed = 0
        self.renewed = 0

    def __call__(self, execution_id: int, token: int, lease_seconds: int) -> bool:
        if self.failed < self.failures:
            self.failed += 1
            raise RuntimeError(f"injected renewal failure {self.failed}")
        try:
            ok = self.real(execution_id, token, lease_seconds)
        finally:
            connection.close()  # the keeper thread's own connection: leave none open after the test
        self.renewed += ok
        return ok


@pytest.fixture
def renewals(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], Renewals]]:
    real_record = ledger.record_lease_lost

    def record_lease_lost(execution_id: int, token: int, worker: str) -> None:
        try:
            real_record(execution_id, token, worker)
        finally:
            connection.close()

    monkeypatch.setattr(ledger, "record_lease_lost", record_lease_lost)

    def install(failures: int) -> Renewals:
        wrapper = Renewals(ledger.renew_lease, failures)
        monkeypatch.setattr(ledger, "renew_lease", wrapper)
        return wrapper

    yield install


def running(key: str, lease: int, worker: str = "node-a:1:test.0:1") -> Execution:
    execution, _ = ledger.create(
        ledger.NewExecution(idempotency_key=key, task_name="testapp.effect", args=[], kwargs={})
    )
    claim = ledger.claim(execution, worker=worker, celery_task_id="t-1", lease_seconds=lease, max_attempts=3)
    assert claim.outcome == "claimed"
    return claim.execution


def lease_left(pk: int) -> float:
    expires = Execution.objects.values_list("lease_expires_at", flat=True).get(pk=pk)
    return (expires - timezone.now()).total_seconds()


def test_renewals_resume_after_errors_that_are_not_database_errors(renewals):
    injected = renewals(2)
    execution = running("flaky", lease=6)
    keeper = LeaseKeeper()
    # Renewals every 2 s; the errors take the first two (retried after 1 s), the third renews
    # with 2 s of the lease left.
    watch = keeper.watch(execution.pk, execution.fencing_token, 6, "node-a:1")
    try:
        # Several renewals after the injected errors, each keeping the lease live.
        wait_for(lambda: injected.renewed >= 4, timeout=20, what="renewals after the injected errors")
        assert injected.failed == 2
        assert lease_left(execution.pk) > 0
        assert not watch.lost
    finally:
        keeper.unwatch(watch)
    assert event_kinds(execution.pk) == [EventKind.CLAIMED]


def test_a_refused_renewal_marks_the_attempt_lost(renewals):
    injected = renewals(0)
    execution = running("taken", lease=2)
    keeper = LeaseKeeper()
    watch = keeper.watch(execution.pk, execution.fencing_token, 2, "node-a:1")
    try:
        wait_for(lambda: injected.renewed >= 1, timeout=10, what="a first renewal")
        assert not watch.lost
        # Another worker takes the key over (it judged this owner dead).
        again = ledger.claim(
            ledger.get(execution.pk),
            worker="node-b:2",
            celery_task_id="t-2",
            lease_seconds=30,
            max_attempts=3,
            owner_alive=lambda worker: False,
        )
        assert again.outcome == "claimed"
        wait_for(lambda: watch.lost, timeout=10, what="the refused renewal to mark the attempt lost")
    finally:
        keeper.unwatch(watch)
    wait_for(lambda: EventKind.LEASE_LOST in event_kinds(execution.pk), timeout=10, what="the lease_lost event")
    assert Execution.objects.get(pk=execution.pk).fencing_token == 2  # the new owner keeps it


def test_renewals_failing_past_the_lease_mark_the_attempt_lost(renewals):
    injected = renewals(10**6)  # every renewal fails
    execution = running("cut-off", lease=2)
    keeper = LeaseKeeper()
    watch = keeper.watch(execution.pk, execution.fencing_token, 2, "node-a:1")
    try:
        wait_for(lambda: injected.failed >= 1, timeout=10, what="a failed renewal")
        assert not watch.lost  # a failure alone does not lose the lease
        wait_for(lambda: watch.lost, timeout=10, what="the attempt marked lost once its lease ran out")
        assert lease_left(execution.pk) <= 0.5  # the database agrees: it was never renewed
        wait_for(lambda: watch not in keeper._watches, timeout=5, what="the lost attempt no longer renewed")
    finally:
        keeper.unwatch(watch)
    wait_for(lambda: EventKind.LEASE_LOST in event_kinds(execution.pk), timeout=10, what="the lease_lost event")


def test_a_dead_keeper_thread_is_started_again(renewals):
    renewals(0)
    execution = running("revived", lease=3)
    keeper = LeaseKeeper()
    watch = keeper.watch(execution.pk, execution.fencing_token, 3, "node-a:1")
    try:
        thread = keeper._thread
        assert thread is not None
        keeper._thread = _dead_thread()  # as if it had died
        keeper.ensure_running()
        assert keeper._thread is not None and keeper._thread.is_alive()
    finally:
        keeper.unwatch(watch)


def _dead_thread():
    import threading

    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    return t


@pytest.mark.worker
def test_a_long_body_keeps_its_lease_across_renewal_errors_in_a_real_worker(workers, poll):
    """The body injects two non-database errors into its own process's renewals, then runs for
    more than twice its lease: it must not be rescued, and must run once."""
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(slug="flaky-heartbeat", task="testapp.flaky_heartbeat", lease_seconds=6)
    execution = submit(job, kwargs={"seconds": 13, "failures": 2})

    def finished_without_rescue() -> bool:
        report = run_rescuer()
        assert report.rescued == 0, "a live attempt was rescued"
        return Execution.objects.get(pk=execution.pk).state == "SUCCEEDED"

    poll(finished_without_rescue, timeout=60, interval=0.25, what="success")
    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 1
    assert event_kinds(row.pk) == ["claimed", "succeeded"]
    raw = EffectRaw.objects.filter(key=row.idempotency_key)
    assert raw.filter(phase="started").count() == 1
    assert raw.filter(phase="injected:2").count() == 1  # both errors really were raised
    assert raw.filter(phase="lease_lost").count() == 0
    assert row.result == {"lease_lost": False}


@pytest.mark.worker
def test_a_body_sees_lease_lost_once_an_operator_fails_its_running_attempt(workers, poll):
    """The refused renewal reaches the body: ``self.lease_lost`` turns True in a real worker."""
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(slug="watcher", task="testapp.until_lease_lost", lease_seconds=3)
    execution = submit(job)
    key = execution.idempotency_key
    poll(lambda: EffectRaw.objects.filter(key=key, phase="started").exists(), timeout=30, what="body started")
    ledger.operator_transition(execution.pk, "FAILED", user="alice", reason="stuck", expected_state="RUNNING")
    poll(lambda: EffectRaw.objects.filter(key=key, phase="lease_lost").exists(), timeout=30, what="lease_lost seen")
    poll(lambda: EventKind.LEASE_LOST in event_kinds(execution.pk), timeout=10, what="the lease_lost event")
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts) == ("FAILED", 1)  # the attempt's own write-back was refused
