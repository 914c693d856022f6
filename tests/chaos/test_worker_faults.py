"""Worker and broker faults from the catalogue (``../shared/research/reliability-anchors.md`` §b):
a body longer than the Redis visibility timeout, a countdown longer than it, a warm shutdown
during a long body, and a hung broker. Effects are counted in tables without a unique
constraint; every process signalled is one the test started.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from django.db import connection
from django.test import override_settings

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, JobDefinition
from taskplatform.worker.owner import parse_owner
from tests.chaos.test_partitions import atomic_starts as redis_starts
from tests.helpers import event_kinds, state_of, tally
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.chaos, pytest.mark.worker, pytest.mark.fault, pytest.mark.timeout(180)]


def starts(key: str) -> int:
    return EffectRaw.objects.filter(key=key, phase="started").count()


@pytest.mark.slow
@pytest.mark.scenario(3)
def test_a_body_longer_than_the_visibility_timeout_runs_once(workers, poll, figures):
    """Scenario 3. Redis hands the unacknowledged message out again once the visibility timeout
    (here 3 s) passes; the second delivery finds the first attempt's lease live (renewed) and is
    absorbed as a duplicate."""
    workers.start(concurrency=2, env={"CELERY_VISIBILITY_TIMEOUT": "3", "CELERY_UNACKED_RESTORE_INTERVAL": "1"})
    execution = submit("testapp.effect", kwargs={"seconds": 14})

    def redelivered() -> bool:
        return "duplicate_delivery" in event_kinds(execution.pk)

    poll(redelivered, timeout=60, interval=0.25, what="the message handed out again and absorbed")
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="success")
    row = Execution.objects.get(pk=execution.pk)
    assert (row.attempts, row.fencing_token) == (1, 1)
    assert starts(execution.idempotency_key) == 1
    assert Effect.objects.filter(key=execution.idempotency_key).count() == 1
    figures.record(**tally([execution]), deliveries_absorbed=event_kinds(execution.pk).count("duplicate_delivery"))


@pytest.mark.slow
@pytest.mark.scenario(4)
def test_a_countdown_longer_than_the_visibility_timeout_is_parked_and_runs_once(workers, poll, figures):
    """Scenario 4. A countdown on the Redis broker longer than the visibility timeout would be
    handed out early and again; the platform parks delays above
    TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS in the ledger and publishes them when due."""
    workers.start(concurrency=2, env={"CELERY_VISIBILITY_TIMEOUT": "3"})
    with override_settings(TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS=1):
        execution = submit("testapp.effect", countdown=6)
    parked = Execution.objects.get(pk=execution.pk)
    assert (parked.publish_count, parked.celery_task_id) == (0, ""), "parked in the ledger, not on the broker"
    due = parked.due_at
    assert due is not None

    def published_and_done() -> bool:
        run_rescuer()  # as the beat leader does every 10 s
        return state_of(execution.pk) == "SUCCEEDED"

    poll(published_and_done, timeout=60, interval=0.5, what="published when due and run")
    row = Execution.objects.get(pk=execution.pk)
    assert row.started_at is not None and row.started_at >= due
    assert (row.attempts, row.publish_count) == (1, 1)
    assert starts(execution.idempotency_key) == 1
    figures.record(
        **tally([execution]), publications=row.publish_count, started_after_due_s=(row.started_at - due).total_seconds()
    )


@pytest.mark.slow
@pytest.mark.scenario(18)
def test_a_warm_shutdown_during_a_long_body_lets_it_finish_once(workers, poll, figures):
    """Scenario 18. SIGTERM to the worker (a deploy): Celery's warm shutdown stops taking work,
    lets the running body finish and records it; nothing runs twice, nothing is lost."""
    worker = workers.start(concurrency=1)
    execution = submit("testapp.effect", kwargs={"seconds": 4})
    poll(lambda: starts(execution.idempotency_key) == 1, timeout=60, what="body started")
    os.kill(worker.pid, signal.SIGTERM)
    poll(lambda: not worker.alive(), timeout=60, what="the worker exits after the body")
    assert state_of(execution.pk) == "SUCCEEDED"
    assert starts(execution.idempotency_key) == 1
    assert Effect.objects.filter(key=execution.idempotency_key).count() == 1
    workers.start(concurrency=1)  # a redelivered message, if any, is absorbed
    sentinel = submit("testapp.effect")
    poll(lambda: state_of(sentinel.pk) == "SUCCEEDED", timeout=60, what="the new worker drained the queue")
    assert event_kinds(execution.pk)[-1] in {"succeeded", "already_finished"}
    assert starts(execution.idempotency_key) == 1
    figures.record(**tally([execution, sentinel]))


@pytest.mark.scenario(11)
def test_a_hung_broker_loses_and_doubles_nothing(private_redis, workers, poll, use_broker, figures):
    """Scenario 11. The broker stops answering (SIGSTOP: a GC pause, a partition) while a body
    runs and while another submission is published. The body finishes on the database; the
    submission's row is committed before its publication hangs; after SIGCONT both run once."""
    use_broker(private_redis.url)
    workers.start(concurrency=2, broker=private_redis.url)
    first = submit("testapp.effect", kwargs={"seconds": 3})
    poll(lambda: starts(first.idempotency_key) == 1, timeout=60, what="first body started")
    assert private_redis.proc is not None
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        poll(lambda: state_of(first.pk) == "SUCCEEDED", timeout=30, what="the body finishes without the broker")
        submitted: list[Execution] = []

        def publish_one() -> None:
            try:
                submitted.append(submit("testapp.effect"))  # the row commits; the publication hangs
            finally:
                connection.close()

        publisher = threading.Thread(target=publish_one, daemon=True)
        publisher.start()
        poll(lambda: submitted or Execution.objects.filter(pk__gt=first.pk).exists(), timeout=30, what="row")
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
    publisher.join(timeout=60)
    second = submitted[0] if submitted else Execution.objects.get(pk__gt=first.pk)

    def both_done() -> bool:
        run_rescuer()
        return state_of(second.pk) == "SUCCEEDED"

    poll(both_done, timeout=90, interval=0.5, what="the second execution after the broker resumed")
    assert starts(first.idempotency_key) == 1 and starts(second.idempotency_key) == 1
    assert Effect.objects.filter(key__in=[first.idempotency_key, second.idempotency_key]).count() == 2
    figures.record(**tally([first, second]), recovery_s=time.monotonic() - resumed)


@pytest.mark.slow
@pytest.mark.scenario(6)
def test_a_hard_time_limit_kills_each_attempt_and_dead_letters_after_the_last(workers, poll, figures):
    """Scenario 6 (hard limit; the soft limit is in tests/integration/test_task_options.py).
    Celery kills the pool process at the hard limit; the attempt's lease then expires and the
    rescuer re-queues it, until the attempts are spent: a dead letter, each attempt run once."""
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(
        slug="hard-limit", task="testapp.sleepy", time_limit_seconds=1, lease_seconds=3, max_attempts=2
    )
    execution = submit(job, kwargs={"seconds": 30})

    def dead() -> bool:
        run_rescuer()
        return state_of(execution.pk) == "FAILED"

    poll(dead, timeout=90, interval=0.5, what="the dead letter after the last attempt")
    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 2 and "attempts exhausted: 2 of 2" in row.last_error
    assert starts(execution.idempotency_key) == 2
    figures.record(**tally([execution]), attempts=row.attempts, state=row.state)


@pytest.mark.scenario(7)
@pytest.mark.parametrize(("task", "effects"), [("testapp.atomic_gated", 1), ("testapp.effect_then_wait", 2)])
def test_a_crash_between_the_effect_and_the_ledger_commit(workers, poll, open_gate, task, effects, figures):
    """Scenario 7. The pool process dies after the body wrote its effect and before the ledger
    recorded success. Atomic: the effect rolled back with the attempt, the retry writes the
    only one. Not atomic: the effect is committed and the retry writes it again (the documented
    limit; downstream effects must be idempotent on ``idempotency_key``)."""
    worker = workers.start(concurrency=2)
    execution = submit(task, kwargs={"gate": "crash"})
    key = execution.idempotency_key
    row = poll(lambda: Execution.objects.filter(pk=execution.pk, state="RUNNING").first(), timeout=30, what="attempt 1")
    owner = parse_owner(row.worker)
    assert owner is not None and owner.pid in {c.pid for c in worker.pool_children()}
    if task == "testapp.effect_then_wait":
        poll(lambda: Effect.objects.filter(key=key).exists(), timeout=30, what="the effect committed")
    else:
        poll(lambda: redis_starts(key), timeout=30, what="the atomic body started")
    open_gate("crash:2")
    os.kill(owner.pid, signal.SIGKILL)
    killed = time.monotonic()
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="attempt 2 succeeded")
    assert Execution.objects.get(pk=execution.pk).attempts == 2
    assert Effect.objects.filter(key=key).count() == effects
    counter = (lambda k: len(redis_starts(k))) if task == "testapp.atomic_gated" else None
    figures.record(**tally([execution], starts=counter), recovery_s=time.monotonic() - killed)


@pytest.mark.slow
@pytest.mark.scenario(18)
def test_a_cold_shutdown_during_a_long_atomic_body_runs_it_again_once(workers, poll, open_gate, figures):
    """Scenario 18, the cold variant (SIGQUIT, or a warm shutdown cut short): the body is killed
    mid-way. Its message was not acknowledged, so it comes back; the next worker finds the dead
    attempt (its owner is gone) and runs attempt 2. Atomic: the first attempt's effect rolled
    back with it, one effect in all."""
    worker = workers.start(concurrency=1)
    execution = submit("testapp.atomic_gated", kwargs={"gate": "cold"})
    key = execution.idempotency_key
    poll(lambda: redis_starts(key), timeout=60, what="the atomic body started")
    os.kill(worker.pid, signal.SIGQUIT)
    stopped = time.monotonic()
    poll(lambda: not worker.alive(), timeout=60, what="the worker to exit at once")
    open_gate("cold:2")
    workers.start(concurrency=1)

    def done() -> bool:
        run_rescuer()  # the message is back on the queue, or the lease expires: either way once
        return state_of(execution.pk) == "SUCCEEDED"

    poll(done, timeout=90, interval=0.5, what="attempt 2 after the cold shutdown")
    figures.record(**tally([execution], starts=lambda k: len(redis_starts(k))), recovery_s=time.monotonic() - stopped)
    assert [s.split(":")[0] for s in redis_starts(key)] == ["1", "2"]
    assert Effect.objects.filter(key=key).count() == 1
    assert Execution.objects.get(pk=execution.pk).fencing_token == 2
