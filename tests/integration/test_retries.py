"""G5: retries back off within bounds, count exactly, and end in a dead letter with a traceback."""

from __future__ import annotations

import pytest

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, ExecutionEvent, JobDefinition
from tests.helpers import event_kinds, state_of, tally
from tests.testapp.models import EffectRaw

pytestmark = [pytest.mark.chaos, pytest.mark.worker]


@pytest.mark.scenario(5)
def test_retryable_failures_back_off_within_bounds_then_dead_letter_with_traceback(workers, poll, figures):
    workers.start(concurrency=2)
    # testapp.always_fails: retry_backoff=1, retry_backoff_max=2, retry_jitter, max_retries=3
    execution = submit("testapp.always_fails")
    poll(lambda: state_of(execution.pk) == "FAILED", timeout=60, interval=0.2, what="dead letter")

    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 4
    assert EffectRaw.objects.filter(key=row.idempotency_key, phase="started").count() == 4
    assert "TransientError: transient failure on attempt 4" in row.last_error
    assert "attempts exhausted: 4 of 4" in row.last_error
    assert "Traceback (most recent call last)" in row.last_traceback and "always_fails" in row.last_traceback

    retries = ExecutionEvent.objects.filter(execution=row, kind="retry_scheduled").order_by("id")
    assert [e.attempt for e in retries] == [1, 2, 3]
    for event in retries:
        bound = min(2, 1 * 2 ** (event.attempt - 1))
        assert 0 <= event.data["delay_seconds"] <= bound, (event.attempt, event.data)
        assert event.data["parked_in_ledger"] is False
    assert event_kinds(row.pk)[-1] == "dead_lettered"
    figures.record(
        **tally([execution]),
        attempts=row.attempts,
        delays_s=[event.data["delay_seconds"] for event in retries],
        state=row.state,
    )


@pytest.mark.scenario(5)
def test_a_non_retryable_error_fails_at_once(workers, poll, figures):
    workers.start(concurrency=1)
    execution = submit("testapp.fatal")  # FatalError is in dont_autoretry_for
    poll(lambda: state_of(execution.pk) == "FAILED", timeout=30, what="dead letter")
    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 1
    assert "FatalError: this input can never succeed" in row.last_error
    assert event_kinds(row.pk) == ["claimed", "dead_lettered"]
    figures.record(**tally([execution]), attempts=row.attempts, state=row.state)


def test_the_job_definition_overrides_the_task_retry_policy(workers, poll):
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(
        slug="strict", task="testapp.always_fails", max_attempts=2, backoff_base_seconds=1, jitter=False
    )
    execution = submit(job)
    poll(lambda: state_of(execution.pk) == "FAILED", timeout=30, what="dead letter")
    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 2 and row.job_id == job.pk
    retry = ExecutionEvent.objects.get(execution=row, kind="retry_scheduled")
    assert retry.data["delay_seconds"] == 1  # no jitter: exactly base·2⁰


def test_a_retry_longer_than_the_broker_bound_is_parked_and_published_when_due(workers, poll):
    # Workers treat delays above 1 s as too long for the broker.
    worker = workers.start(concurrency=1, env={"TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS": "1"})
    job = JobDefinition.objects.create(
        slug="slow-retry",
        task="testapp.fails_then_succeeds",
        backoff_base_seconds=3,
        backoff_max_seconds=10,
        jitter=False,
    )
    execution = submit(job, kwargs={"failures": 1})
    poll(lambda: state_of(execution.pk) == "RETRYING", timeout=30, what="first failure")
    row = Execution.objects.get(pk=execution.pk)
    assert row.publish_count == 0 and row.due_at == row.scheduled_for  # parked, not on the broker
    event = ExecutionEvent.objects.get(execution=row, kind="retry_scheduled")
    assert event.data["parked_in_ledger"] is True and event.data["delay_seconds"] == 3
    # Celery's own retry line says where the retry waits (it used to read as a broker countdown).
    retry_line = poll(
        lambda: next((line for line in worker.log().splitlines() if "retry: Retry in" in line), None),
        timeout=10,
        what="Celery's retry line",
    )
    assert "Retry in 3.0s (parked in the ledger" in retry_line, retry_line

    assert run_rescuer().published == 0  # not due yet: nothing goes to the broker early

    def published_and_done() -> bool:
        run_rescuer()
        return state_of(execution.pk) == "SUCCEEDED"

    poll(published_and_done, timeout=30, interval=0.25, what="published when due and completed")
    row.refresh_from_db()
    assert row.attempts == 2 and row.result == 2
    assert ExecutionEvent.objects.get(execution=row, kind="republished").reason == "due"
