"""Scenario 6, the soft time limit, with real prefork workers (Celery sends the pool process
SIGUSR1 at the limit; ``SoftTimeLimitExceeded`` is raised wherever the body is).

A body that catches it and returns has succeeded: its clean-up is its result. A body that
lets it propagate has failed like any other error, and the job's retry policy decides: not
retried by default (a dead letter), retried when the policy retries ``Exception`` (Celery's
``autoretry_for=(Exception,)``), not retried when it also names ``SoftTimeLimitExceeded``
fatal. The hard limit is in ``tests/chaos/test_worker_faults.py``.
"""

from __future__ import annotations

import time

import pytest

from taskplatform import submit
from taskplatform.models import Execution, JobDefinition
from tests.helpers import event_kinds, state_of
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.scenario(6), pytest.mark.worker, pytest.mark.fault, pytest.mark.timeout(120)]

SOFT_LIMITED = "testapp.soft_limited"


def phases(key: str) -> list[str]:
    return list(EffectRaw.objects.filter(key=key).order_by("id").values_list("phase", flat=True))


def test_a_body_that_catches_the_soft_limit_cleans_up_and_succeeds(workers, poll, figures):
    """(A) The body catches ``SoftTimeLimitExceeded`` one second in, writes its clean-up and
    returns: the attempt succeeded, once, with the clean-up as its only effect."""
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(slug="soft-caught", task=SOFT_LIMITED, soft_time_limit_seconds=1)
    execution = submit(job, kwargs={"seconds": 30, "on_soft": "return"})
    submitted = time.monotonic()
    poll(lambda: state_of(execution.pk) in {"SUCCEEDED", "FAILED"}, timeout=60, what="the attempt's outcome")
    elapsed = time.monotonic() - submitted
    row = Execution.objects.get(pk=execution.pk)
    key = execution.idempotency_key
    body_starts = phases(key).count("started")
    effects = Effect.objects.filter(key=key).count()
    figures.record(executions=1, body_starts=body_starts, effects=effects, state=row.state, outcome_s=elapsed)
    assert row.state == "SUCCEEDED" and row.result == "cleaned up", row.last_error
    assert event_kinds(row.pk) == ["claimed", "succeeded"]
    assert phases(key) == ["started", "soft_limit"]
    assert (body_starts, effects) == (1, 1)
    assert elapsed < 20, "the soft limit did not interrupt the 30 s body"


POLICIES = {
    # The job's policy over testapp.sleepy (no autoretry_for of its own).
    "not-retried": ({}, ["claimed", "dead_lettered"], 1),
    "retry-on-Exception": (
        {"retry_on": ["builtins.Exception"], "max_attempts": 2},
        ["claimed", "retry_scheduled", "claimed", "dead_lettered"],
        2,
    ),
    "retry-on-Exception-soft-limit-fatal": (
        {"retry_on": ["builtins.Exception"], "fatal_errors": ["celery.exceptions.SoftTimeLimitExceeded"]},
        ["claimed", "dead_lettered"],
        1,
    ),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_soft_limit_that_propagates_is_a_failure_the_retry_policy_decides(workers, poll, figures, policy):
    """(B) The body lets ``SoftTimeLimitExceeded`` propagate: each attempt is stopped at one
    second and recorded as failed with it; the job's policy retries it or not, and the last
    failure is the dead letter. Each attempt's body started once."""
    fields, kinds, attempts = POLICIES[policy]
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(
        slug=f"soft-{policy}",
        task="testapp.sleepy",
        soft_time_limit_seconds=1,
        backoff_base_seconds=1,
        backoff_max_seconds=1,
        jitter=False,
        **fields,
    )
    execution = submit(job, kwargs={"seconds": 30})
    submitted = time.monotonic()
    poll(lambda: state_of(execution.pk) == "FAILED", timeout=60, what="the dead letter")
    elapsed = time.monotonic() - submitted
    row = Execution.objects.get(pk=execution.pk)
    body_starts = phases(execution.idempotency_key).count("started")
    figures.record(executions=1, body_starts=body_starts, attempts=row.attempts, state=row.state, outcome_s=elapsed)
    assert "SoftTimeLimitExceeded" in row.last_error
    assert event_kinds(row.pk) == kinds
    assert row.attempts == body_starts == attempts
    assert elapsed < 20, "the soft limit did not interrupt the 30 s bodies"
