"""Django's task API (django-tasks) on the ledger, with real workers: ``taskplatform.task_backend``.

A function decorated with ``@task`` and enqueued with ``.enqueue()`` is an execution: the same
key, retry, dead-letter and console semantics as ``submit()``, run by a Celery worker, its
result read through Django's ``TaskResult`` API. Body runs are counted in ``EffectRaw`` (no
unique constraint).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone
from django_tasks import TaskResultStatus, task_backends
from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist

from taskplatform.core import ledger
from taskplatform.exceptions import (
    IdempotencyKeyConflictError,
    InvalidArgumentsError,
    InvalidIdempotencyKeyError,
    LeaseLostError,
    TaskPlatformError,
)
from taskplatform.models import Execution
from tests.testapp.models import Effect, EffectRaw
from tests.testapp.tasks import TransientError, flaky_receipt, hopeless, keyless, receipt

pytestmark = [pytest.mark.worker]


def finished(result: Any) -> bool:
    result.refresh()
    return bool(result.is_finished)


def test_an_enqueued_task_is_an_execution_run_once_by_a_worker_and_its_result_reads_back(workers, poll):
    workers.start(concurrency=2)
    with transaction.atomic():
        result = receipt.enqueue("A-1", 42)
        again = receipt.enqueue("A-1", 42)  # the same key and arguments: the same execution
        assert result.status == TaskResultStatus.READY
    assert again.id == result.id
    poll(lambda: finished(result), timeout=30, what="the task to finish")

    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"order": "A-1", "amount": 42}
    assert (result.attempts, result.errors, result.args) == (1, [], ["A-1", 42])
    assert result.started_at is not None and result.finished_at is not None
    assert receipt.get_result(result.id).return_value == {"order": "A-1", "amount": 42}
    row = Execution.objects.get(pk=int(result.id))
    assert (row.idempotency_key, row.task_name, row.state) == (
        "receipt:A-1",
        "tests.testapp.tasks.receipt",
        "SUCCEEDED",
    )
    assert EffectRaw.objects.filter(key="receipt:A-1").count() == 1
    assert Effect.objects.filter(key="receipt:A-1").count() == 1

    # After success, the same key is still the same execution: the body does not run again.
    assert receipt.enqueue("A-1", 42).id == result.id
    with pytest.raises(IdempotencyKeyConflictError):
        receipt.enqueue("A-1", 43)  # the same key with other arguments
    assert Execution.objects.count() == 1


def test_nothing_is_published_when_the_callers_transaction_rolls_back(workers, poll):
    from celery.signals import before_task_publish

    workers.start(concurrency=1)
    published: list[str] = []

    def count(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
        published.append(str((headers or {}).get("tp_key")))

    before_task_publish.connect(count, weak=False)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            receipt.enqueue("B-1", 1)
            raise RuntimeError("the view failed after enqueueing")
        assert published == [], "nothing is published before the commit, nor after a rollback"
    finally:
        before_task_publish.disconnect(count)
    later = receipt.enqueue("B-2", 2)
    poll(lambda: finished(later), timeout=30, what="a later task to finish")
    assert Execution.objects.count() == 1
    assert EffectRaw.objects.filter(key="receipt:B-1").count() == 0


def test_a_retryable_failure_is_retried_with_backoff_and_the_attempts_are_in_the_result(workers, poll):
    workers.start(concurrency=2)
    result = flaky_receipt.enqueue("C-1")
    poll(lambda: finished(result), timeout=60, what="the retried task to finish")
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 2  # the attempt the body saw in its context
    assert result.attempts == 2
    assert [e.exception_class_path for e in result.errors] == ["tests.testapp.tasks.TransientError"]
    assert EffectRaw.objects.filter(key="flaky:C-1").count() == 2


def test_the_last_failure_is_a_dead_letter_in_the_console_and_a_failed_result(workers, poll):
    workers.start(concurrency=2)
    result = hopeless.enqueue("D-1")
    poll(lambda: finished(result), timeout=60, what="the task to be dead-lettered")
    assert result.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="failed"):
        _ = result.return_value
    assert [e.exception_class_path for e in result.errors] == ["tests.testapp.tasks.TransientError"] * 2
    assert "cannot be done" in result.errors[-1].traceback
    row = Execution.objects.get(pk=int(result.id))
    assert (row.state, row.attempts) == ("FAILED", 2)
    assert EffectRaw.objects.filter(key="hopeless:D-1").count() == 2


def test_run_after_defers_the_execution(workers, poll):
    workers.start(concurrency=1)
    at = timezone.now() + timedelta(seconds=2)
    result = receipt.using(run_after=at).enqueue("E-1", 5)
    assert Execution.objects.get(pk=int(result.id)).scheduled_for == at
    poll(lambda: finished(result), timeout=30, what="the deferred task to finish")
    assert Execution.objects.get(pk=int(result.id)).started_at >= at


@pytest.mark.django_db
def test_bad_input_is_refused_and_nothing_is_recorded() -> None:
    with pytest.raises(InvalidTaskError, match="priority"):
        receipt.using(priority=5)
    with pytest.raises(InvalidArgumentsError, match="JSON"):
        receipt.enqueue("F-1", object())  # not JSON
    with pytest.raises(TaskResultDoesNotExist):
        receipt.get_result("999999")
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result("not-a-number")
    assert Execution.objects.count() == 0


def not_imported_by_workers(n: int) -> int:
    return n


@pytest.mark.django_db
def test_a_function_no_worker_imports_is_refused_when_decorated() -> None:
    """Found in review: a function outside an installed app's tasks module (and not in
    CELERY_IMPORTS) was registered only where its module happened to be imported; the worker
    rejected its messages and the row was republished forever, never run."""
    from django_tasks import task

    with pytest.raises(InvalidTaskError, match=r"a worker never imports 'tests\.integration\.test_django_tasks'"):
        task(not_imported_by_workers)


@pytest.mark.django_db
def test_arguments_by_position_or_by_name_are_one_call_and_a_keyless_key_is_refused() -> None:
    first = receipt.enqueue("H-1", 10)
    assert receipt.enqueue(order="H-1", amount=10).id == first.id
    assert receipt.enqueue("H-1", amount=10).id == first.id
    assert receipt.enqueue("H-1").id == first.id, "a default given or left out is one call (review of issue 14)"
    with pytest.raises(TypeError):
        receipt.enqueue("H-2", 10, 11)  # more than the function takes: nothing recorded
    with pytest.raises(InvalidIdempotencyKeyError, match="returned None"):
        keyless.enqueue("H-3")
    assert Execution.objects.count() == 1


@pytest.mark.django_db
def test_a_lost_attempt_rescued_or_taken_over_is_an_error_with_its_own_story() -> None:
    """Review of issue 14: a rescued attempt after a raised one carried the raised one's
    traceback (the rescue keeps the row's last traceback), and an attempt whose worker died
    and whose redelivery took it over was no error at all."""
    result = flaky_receipt.enqueue("L-1")
    pk = int(result.id)

    def attempt(worker: str) -> Any:
        claim = ledger.claim(
            Execution.objects.get(pk=pk), worker=worker, celery_task_id=worker, lease_seconds=60, max_attempts=5
        )
        assert claim is not None and claim.outcome == "claimed"
        return claim

    claim = attempt("w:1")  # raised: a retry with a traceback
    error = f"{TransientError.__module__}.TransientError: boom"
    assert ledger.schedule_retry(claim.execution, claim.token, delay_seconds=0, error=error,
                                 traceback="Traceback: boom", worker="w:1")  # fmt: skip
    attempt("w:2")  # lost: its lease runs out and the rescuer re-queues it
    Execution.objects.filter(pk=pk).update(lease_expires_at=timezone.now() - timedelta(seconds=5))
    assert ledger.rescue_expired(Execution.objects.get(pk=pk), max_attempts=5, now=timezone.now()) == "rescued"
    rescued = flaky_receipt.get_result(result.id)
    assert [e.exception_class for e in rescued.errors] == [TransientError, LeaseLostError]
    assert rescued.errors[0].traceback == "Traceback: boom"
    assert "Traceback: boom" not in rescued.errors[1].traceback and "w:2 lost or stalled" in rescued.errors[1].traceback

    attempt("w:3")  # lost too, but a redelivery takes it over before the rescuer looks
    Execution.objects.filter(pk=pk).update(lease_expires_at=timezone.now() - timedelta(seconds=5))
    attempt("w:4")
    taken = flaky_receipt.get_result(result.id)
    assert [e.exception_class for e in taken.errors] == [TransientError, LeaseLostError, LeaseLostError]
    assert "w:3" in taken.errors[2].traceback and "taken over by w:4" in taken.errors[2].traceback
    assert taken.attempts == 4 and taken.worker_ids == ["w:1", "w:2", "w:3", "w:4"]


@pytest.mark.django_db
def test_the_result_counts_from_the_last_operator_requeue_and_names_failures_the_body_did_not_raise() -> None:
    result = hopeless.enqueue("I-1")
    pk = int(result.id)

    def attempt(worker: str) -> Any:
        claim = ledger.claim(
            Execution.objects.get(pk=pk), worker=worker, celery_task_id="t", lease_seconds=60, max_attempts=2
        )
        assert claim is not None and claim.outcome == "claimed"
        return claim

    claim = attempt("w:1")
    ledger.dead_letter(claim.execution, claim.token, error=f"{TransientError.__module__}.TransientError: boom",
                       traceback="Traceback: boom", worker="w:1")  # fmt: skip
    failed = hopeless.get_result(result.id)
    assert (failed.status, failed.worker_ids, failed.attempts) == (TaskResultStatus.FAILED, ["w:1"], 1)
    assert [(e.exception_class, e.traceback) for e in failed.errors] == [(TransientError, "Traceback: boom")]
    assert failed.started_at is not None

    ledger.operator_transition(pk, "PENDING", user="op", reason="try again", expected_state="FAILED")
    fresh = hopeless.get_result(result.id)
    assert (fresh.status, fresh.errors, fresh.worker_ids, fresh.started_at) == (TaskResultStatus.READY, [], [], None)

    claim = attempt("w:2")  # a rescuer's dead letter: the worker was lost, nothing was raised
    lost_worker = "lease expired during attempt 1 (worker w:2 lost or stalled)"
    ledger.dead_letter(claim.execution, claim.token, error=lost_worker, traceback="", worker="rescuer")
    lost = hopeless.get_result(result.id)
    assert [e.exception_class for e in lost.errors] == [LeaseLostError] and lost.worker_ids == ["w:2"]

    ledger.operator_transition(pk, "PENDING", user="op", reason="and again", expected_state="FAILED")
    attempt("w:4")  # a rescued attempt: its lease ran out, the rescuer re-queued it
    Execution.objects.filter(pk=pk).update(lease_expires_at=timezone.now() - timedelta(seconds=5))
    rescued = ledger.rescue_expired(Execution.objects.get(pk=pk), max_attempts=2, now=timezone.now())
    assert rescued == "rescued"
    requeued = hopeless.get_result(result.id)
    assert [e.exception_class for e in requeued.errors] == [LeaseLostError], "the rescued attempt is an error"
    assert "worker w:4 lost or stalled" in requeued.errors[0].traceback
    claim = attempt("w:5")
    ledger.dead_letter(claim.execution, claim.token, error=lost_worker, traceback="", worker="rescuer")
    assert [e.exception_class for e in hopeless.get_result(result.id).errors] == [LeaseLostError] * 2

    ledger.operator_transition(pk, "PENDING", user="op", reason="once more", expected_state="FAILED")
    attempt("w:3")
    ledger.operator_transition(pk, "FAILED", user="op", reason="the gateway is gone", expected_state="RUNNING")
    stopped = hopeless.get_result(result.id)
    assert stopped.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in stopped.errors] == [TaskPlatformError]
    assert "the gateway is gone" in stopped.errors[0].traceback
    with pytest.raises(TaskResultDoesNotExist):
        hopeless.get_result("99999999999999999999")  # beyond a bigint: not a database error
