"""Celery-style retries from the body and job time limits, through the ledger."""

from __future__ import annotations

import pytest

from taskplatform import submit
from taskplatform.models import Execution, ExecutionEvent, JobDefinition
from tests.helpers import event_kinds, state_of

pytestmark = [pytest.mark.worker]


def test_self_retry_is_scheduled_by_the_ledger_and_honours_max_retries(workers, poll):
    workers.start(concurrency=1)
    ok = submit("testapp.explicit_retry", kwargs={"succeed_on": 2})
    exhausted = submit("testapp.explicit_retry")
    poll(lambda: state_of(ok.pk) == "SUCCEEDED", timeout=30, what="success on attempt 2")
    poll(lambda: state_of(exhausted.pk) == "FAILED", timeout=30, what="dead letter after max_retries")
    assert Execution.objects.get(pk=ok.pk).result == 2
    row = Execution.objects.get(pk=exhausted.pk)
    assert row.attempts == 3  # max_retries=2
    assert "attempt 3 not good enough" in row.last_error
    delays = [e.data["delay_seconds"] for e in ExecutionEvent.objects.filter(execution=row, kind="retry_scheduled")]
    assert delays == [0, 0]  # the countdown asked for, not the backoff policy


def test_a_job_soft_time_limit_reaches_the_worker_and_fails_the_attempt(workers, poll):
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(slug="bounded", task="testapp.sleepy", soft_time_limit_seconds=1)
    execution = submit(job, kwargs={"seconds": 10})
    poll(lambda: state_of(execution.pk) == "FAILED", timeout=30, what="soft time limit")
    row = Execution.objects.get(pk=execution.pk)
    assert "SoftTimeLimitExceeded" in row.last_error
    assert event_kinds(row.pk) == ["claimed", "dead_lettered"]
