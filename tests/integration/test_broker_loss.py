"""G1: a broker that loses every queued message loses no execution."""

from __future__ import annotations

import time

import pytest
import redis
from django.test import override_settings

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, ExecutionEvent
from tests.helpers import tally
from tests.testapp.models import Effect

pytestmark = [pytest.mark.chaos, pytest.mark.worker, pytest.mark.fault]


@pytest.mark.scenario(9)
@override_settings(TASKPLATFORM_REPUBLISH_AFTER_SECONDS=1)
def test_flushall_with_executions_queued_then_the_rescuer_republishes_every_one(
    private_redis, use_broker, workers, poll, figures
):
    use_broker(private_redis.url)
    executions = [submit("testapp.effect", kwargs={"seconds": 0}) for _ in range(20)]
    client = redis.Redis.from_url(private_redis.url)
    poll(lambda: client.llen("celery") == 20, timeout=10, what="20 messages queued")
    client.flushall()  # the broker forgets everything (a restart without persistence)
    flushed = time.monotonic()
    assert client.llen("celery") == 0

    workers.start(broker=private_redis.url, concurrency=2)

    def all_done() -> bool:
        run_rescuer()
        return Execution.objects.filter(state="SUCCEEDED").count() == 20

    poll(all_done, timeout=60, interval=0.5, what="every execution completed")
    figures.record(**tally(executions), recovery_s=time.monotonic() - flushed)
    assert Effect.objects.count() == 20
    assert ExecutionEvent.objects.filter(kind="republished").count() >= 20
    assert all(e.attempts == 1 for e in Execution.objects.filter(pk__in=[x.pk for x in executions]))


@pytest.mark.scenario(8)
@pytest.mark.slow  # 33 s: in make chaos
@override_settings(TASKPLATFORM_REPUBLISH_AFTER_SECONDS=1)
def test_broker_down_at_submit_records_the_row_and_the_rescuer_publishes_it_later(
    private_redis, use_broker, workers, poll, figures
):
    """50 submissions while nothing listens at the broker's address: each returns (its row is
    committed, its publication fails fast and is recorded); once a broker is there the rescuer
    publishes every one, and each runs once."""
    from tests.conftest import free_port

    use_broker(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    executions = []
    slowest = 0.0
    for _ in range(50):
        began = time.monotonic()
        executions.append(submit("testapp.effect", kwargs={"seconds": 0}))  # does not raise
        slowest = max(slowest, time.monotonic() - began)
    assert Execution.objects.filter(pk__in=[e.pk for e in executions], state="PENDING").count() == 50

    use_broker(private_redis.url)
    back = time.monotonic()
    workers.start(broker=private_redis.url, concurrency=2)

    def done() -> bool:
        run_rescuer()
        return Execution.objects.filter(pk__in=[e.pk for e in executions], state="SUCCEEDED").count() == 50

    poll(done, timeout=90, interval=0.5, what="published by the rescuer and completed")
    figures.record(**tally(executions), recovery_s=time.monotonic() - back, slowest_submit_s=slowest)
    for execution in executions:
        assert Effect.objects.filter(key=execution.idempotency_key).count() == 1
