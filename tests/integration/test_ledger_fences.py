"""Fences, due times and attempt budgets, observed on real workers.

A stopped body cannot be forced to stop (a revoke is best effort, and none is sent here, as
on thread or solo pools), so "retry now" must wait for the stopped attempt's fence; a stray
early copy of a retry must not run it before its time; an explicit ``retry(max_retries=N)``
must be the execution's budget.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
import redis

from taskplatform import submit
from taskplatform.core import ledger
from taskplatform.core.publisher import new_task_id, publish
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, ExecutionEvent, JobDefinition
from tests.conftest import broker_url
from tests.helpers import state_of, wait_for
from tests.testapp.models import EffectRaw

pytestmark = [pytest.mark.worker]

CLAIMED, EARLY = "claimed", "early_delivery"  # event kinds


def raw(key: str, token: int, phase: str) -> EffectRaw | None:
    return EffectRaw.objects.filter(key=key, fencing_token=token, phase=phase).first()


def events_after(pk: int, event_id: int) -> list[ExecutionEvent]:
    return list(ExecutionEvent.objects.filter(execution_id=pk, id__gt=event_id).order_by("id"))


def test_retry_now_after_mark_failed_never_runs_two_bodies_at_once(workers: Any, open_gate: Any) -> None:
    # Two pool processes: a second body could start while the first is still running.
    workers.start(concurrency=2, env={"TASKPLATFORM_LEASE_SECONDS": "9"})
    execution = submit("testapp.effect", kwargs={"gate": "overlap"})
    key = execution.idempotency_key
    wait_for(lambda: raw(key, 1, "started"), timeout=60, what="the first body to start")

    ledger.operator_transition(execution.pk, "FAILED", user="op", reason="looks stuck", expected_state="RUNNING")
    retried = ledger.operator_transition(
        execution.pk, "PENDING", user="op", reason="retry now", expected_state="FAILED"
    )
    mark = ExecutionEvent.objects.filter(execution_id=execution.pk).latest("id").id
    open_gate("overlap:2")  # a second body, whenever it starts, runs straight through
    publish(retried, task_id=new_task_id())  # and a copy of the message, as a double click would send

    def decided() -> list[str]:
        kinds = [e.kind for e in events_after(execution.pk, mark)]
        return [k for k in kinds if k in (CLAIMED, EARLY)]

    first_decision = wait_for(decided, timeout=30, what="a worker to decide on the retried execution")[0]
    # The first body is still blocked: had a second one been claimed, they now overlap.
    open_gate("overlap:1")

    def first_ended() -> ExecutionEvent | None:
        # The stopped body's last act: its write-back (success, or failure) refused as stale.
        return ExecutionEvent.objects.filter(
            execution_id=execution.pk, kind="stale_write_rejected", data__attempt_token=1
        ).first()

    first_end = wait_for(first_ended, timeout=30, what="the first body to finish").at

    def second_started() -> EffectRaw | None:
        run_rescuer()  # the beat leader's duty: publishes the row once its fence has passed
        return raw(key, 2, "started")

    second_start = wait_for(second_started, timeout=30, interval=0.2, what="the retried attempt to start")
    assert second_start.created_at >= first_end, "two bodies of one execution overlapped"
    assert first_decision == EARLY
    fence = ExecutionEvent.objects.get(execution_id=execution.pk, kind="operator", to_state="FAILED").data["fence"]
    claimed = ExecutionEvent.objects.get(execution_id=execution.pk, kind=CLAIMED, fencing_token=2)
    assert claimed.at >= datetime.fromisoformat(fence)
    # The stopped body's success was refused; it had committed its effect meanwhile, which
    # the second body finds (the unique constraint of testapp's Effect): why they must not overlap.
    wait_for(lambda: state_of(execution.pk) in ("SUCCEEDED", "FAILED"), timeout=30, what="the retry to end")
    assert EffectRaw.objects.filter(key=key, phase="started").count() == 2


def test_an_early_stray_copy_of_a_retry_is_absorbed_and_the_retry_runs_when_due(workers: Any) -> None:
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(
        slug="later", task="testapp.fails_then_succeeds", backoff_base_seconds=4, backoff_max_seconds=4, jitter=False
    )
    execution = submit(job, kwargs={"failures": 1})
    wait_for(lambda: state_of(execution.pk) == "RETRYING", timeout=60, what="the first failure")
    waiting = ledger.get(execution.pk)
    assert waiting.scheduled_for is not None and waiting.publish_count == 1  # its countdown is on the broker
    publish(waiting, task_id=new_task_id())  # a stray copy, delivered at once

    def decided() -> list[str]:
        kinds = [e.kind for e in ExecutionEvent.objects.filter(execution_id=execution.pk).order_by("id")][2:]
        return [k for k in kinds if k in (CLAIMED, EARLY)]

    assert wait_for(decided, timeout=30, what="the stray copy to be handled")[0] == EARLY
    assert Execution.objects.get(pk=execution.pk).attempts == 1

    wait_for(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="the retry, when due")
    second = ExecutionEvent.objects.get(execution_id=execution.pk, kind=CLAIMED, attempt=2)
    assert second.at >= waiting.scheduled_for - ledger.EARLY_TOLERANCE
    assert EffectRaw.objects.filter(key=execution.idempotency_key, phase="started").count() == 2
    # The stray copy was dropped, not kept for a later attempt: nothing is left on the broker.
    broker = redis.Redis.from_url(broker_url())
    wait_for(lambda: broker.llen("celery") == 0 and broker.hlen("unacked") == 0, timeout=30, what="an empty broker")
    kinds = [e.kind for e in ExecutionEvent.objects.filter(execution_id=execution.pk)]
    assert kinds.count(EARLY) == 1 and kinds.count(CLAIMED) == 2


def test_an_explicit_max_retries_above_the_policy_is_honoured(workers: Any) -> None:
    workers.start(concurrency=1)
    # The policy allows one attempt; the body asks for retry(max_retries=2), i.e. three in all.
    job = JobDefinition.objects.create(slug="budget", task="testapp.explicit_retry", max_attempts=1)
    execution = submit(job, kwargs={"succeed_on": 3})
    wait_for(lambda: state_of(execution.pk) in ("SUCCEEDED", "FAILED"), timeout=60, what="the execution to end")
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts, row.result) == ("SUCCEEDED", 3, 3), row.last_error
    assert row.max_attempts == 3
    assert EffectRaw.objects.filter(key=row.idempotency_key, phase="started").count() == 3
