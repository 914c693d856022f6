"""submit(): bad input gets a clear error and records nothing; the row commits with the caller."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction
from django.test import override_settings

from taskplatform import submit
from taskplatform.exceptions import (
    IdempotencyKeyConflictError,
    InvalidArgumentsError,
    InvalidIdempotencyKeyError,
    NotIdempotentTaskError,
    PayloadTooLargeError,
    UnknownTaskError,
)
from taskplatform.models import Execution, ExecutionEvent, JobDefinition

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]


def nothing_recorded() -> bool:
    return Execution.objects.count() == 0 and ExecutionEvent.objects.count() == 0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: submit("no.such.task"), UnknownTaskError, "unknown task 'no.such.task'"),
        (lambda: submit("testapp.plain", [1]), NotIdempotentTaskError, "does not use taskplatform.tasks.Idempo"),
        (lambda: submit("testapp.effect", [dt.date(2026, 1, 1)]), InvalidArgumentsError, "must be JSON values"),
        (lambda: submit("testapp.effect", kwargs={"x": object()}), InvalidArgumentsError, "must be JSON values"),
        (lambda: submit("testapp.effect", idempotency_key=""), InvalidIdempotencyKeyError, "must not be empty"),
        (lambda: submit("testapp.effect", countdown=1, eta=dt.datetime.now(dt.UTC)), InvalidArgumentsError, "not both"),
        (lambda: submit("testapp.effect", eta=dt.datetime(2030, 1, 1)), InvalidArgumentsError, "timezone-aware"),
    ],
)
@pytest.mark.scenario(34, 36)
def test_bad_input_is_refused_with_a_clear_error_and_nothing_recorded(call, error, message, figures):
    with pytest.raises(error, match=message):
        call()
    figures.record(refused=1, rows_written=Execution.objects.count() + ExecutionEvent.objects.count())
    assert nothing_recorded()


@pytest.mark.scenario(36)
@override_settings(TASKPLATFORM_MAX_ARGS_BYTES=1024)
def test_oversized_arguments_are_refused_and_the_limit_is_configurable(figures):
    with pytest.raises(PayloadTooLargeError, match="the limit is 1024 bytes"):
        submit("testapp.effect", ["x" * 2000])
    figures.record(refused=1, rows_written=Execution.objects.count())
    assert nothing_recorded()
    submit("testapp.effect", ["x" * 500], on_commit=False)
    assert Execution.objects.count() == 1


def test_a_key_reused_for_other_arguments_is_refused():
    first = submit("testapp.effect", kwargs={"seconds": 1}, idempotency_key="k")
    assert submit("testapp.effect", kwargs={"seconds": 1}, idempotency_key="k").pk == first.pk
    with pytest.raises(IdempotencyKeyConflictError, match="already names execution"):
        submit("testapp.effect", kwargs={"seconds": 2}, idempotency_key="k")
    assert Execution.objects.count() == 1


def test_without_a_key_every_call_is_a_new_execution():
    a = submit("testapp.effect")
    b = submit("testapp.effect")
    assert a.pk != b.pk and a.idempotency_key != b.idempotency_key


def test_the_row_is_written_in_the_callers_transaction_and_published_only_after_commit():
    import redis
    from django.conf import settings

    queue = "tp-test-commit"
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete(queue)

    with pytest.raises(RuntimeError), transaction.atomic():
        submit("testapp.effect", idempotency_key="rolled-back", queue=queue)
        raise RuntimeError("the view failed after submitting")
    assert not Execution.objects.filter(idempotency_key="rolled-back").exists()
    assert broker.llen(queue) == 0  # nothing published for a rolled-back row

    with transaction.atomic():
        execution = submit("testapp.effect", idempotency_key="committed", queue=queue)
        assert broker.llen(queue) == 0  # not while the transaction is open
    assert broker.llen(queue) == 1
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.publish_count, row.celery_task_id) == ("PENDING", 1, execution.celery_task_id)
    broker.delete(queue)


def test_a_job_definition_supplies_task_arguments_and_queue():
    job = JobDefinition.objects.create(slug="j", task="testapp.effect", kwargs={"seconds": 0.1}, queue="q1")
    execution = submit(job, on_commit=False)
    assert (execution.task_name, execution.kwargs, execution.queue, execution.job_id) == (
        "testapp.effect",
        {"seconds": 0.1},
        "q1",
        job.pk,
    )


def test_a_far_eta_is_parked_in_the_ledger_instead_of_the_broker():
    eta = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    execution = submit("testapp.effect", eta=eta)
    row = Execution.objects.get(pk=execution.pk)
    assert row.publish_count == 0 and row.celery_task_id == "" and row.due_at == row.scheduled_for


def test_job_definition_validation_names_each_bad_field():
    """The jobs service validates a definition whole: the model's checks and the task registry's."""
    from django.core.exceptions import ValidationError

    from taskplatform import jobs

    job = JobDefinition(
        slug="bad",
        task="no.such.task",
        args="not-a-list",
        retry_on=["nowhere.Error"],
        soft_time_limit_seconds=10,
        time_limit_seconds=5,
        backoff_base_seconds=10,
        backoff_max_seconds=1,
    )
    with pytest.raises(ValidationError) as info:
        jobs.validate(job)
    errors = info.value.message_dict
    assert "unknown task" in errors["task"][0]
    assert "args must be a list" in errors["args"][0]
    assert "cannot be imported" in errors["retry_on"][0]
    assert "below the hard time limit" in errors["soft_time_limit_seconds"][0]
    assert "backoff cap" in errors["backoff_max_seconds"][0]
    assert JobDefinition.objects.count() == 0


def test_trigger_job_submits_the_job_once_per_trigger_message_and_skips_paused_jobs():
    from taskplatform.tasks import trigger_job

    job = JobDefinition.objects.create(slug="nightly", task="testapp.effect", kwargs={"seconds": 0})
    first = trigger_job.apply(args=["nightly"], task_id="beat-msg-1").get()
    again = trigger_job.apply(args=["nightly"], task_id="beat-msg-1").get()  # the trigger re-delivered
    assert first == again
    execution = Execution.objects.get(pk=first)
    assert (execution.idempotency_key, execution.trigger, execution.job_id) == ("nightly@beat-msg-1", "beat", job.pk)
    JobDefinition.objects.filter(pk=job.pk).update(enabled=False)
    assert trigger_job.apply(args=["nightly"], task_id="beat-msg-2").get() is None
    assert trigger_job.apply(args=["missing"], task_id="beat-msg-3").get() is None
    assert Execution.objects.count() == 1
