"""G1: a broker that loses every queued message loses no execution."""

from __future__ import annotations

import pytest
import redis
from django.test import override_settings

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, ExecutionEvent
from tests.testapp.models import Effect

pytestmark = [pytest.mark.chaos, pytest.mark.worker, pytest.mark.fault]


@override_settings(TASKPLATFORM_REPUBLISH_AFTER_SECONDS=1)
def test_flushall_with_executions_queued_then_the_rescuer_republishes_every_one(
    private_redis, use_broker, workers, poll
):
    use_broker(private_redis.url)
    executions = [submit("testapp.effect", kwargs={"seconds": 0}) for _ in range(20)]
    client = redis.Redis.from_url(private_redis.url)
    poll(lambda: client.llen("celery") == 20, timeout=10, what="20 messages queued")
    client.flushall()  # the broker forgets everything (a restart without persistence)
    assert client.llen("celery") == 0

    workers.start(broker=private_redis.url, concurrency=2)

    def all_done() -> bool:
        run_rescuer()
        return Execution.objects.filter(state="SUCCEEDED").count() == 20

    poll(all_done, timeout=60, interval=0.5, what="every execution completed")
    assert Effect.objects.count() == 20
    assert ExecutionEvent.objects.filter(kind="republished").count() >= 20
    assert all(e.attempts == 1 for e in Execution.objects.filter(pk__in=[x.pk for x in executions]))


@override_settings(TASKPLATFORM_REPUBLISH_AFTER_SECONDS=1)
def test_broker_down_at_submit_records_the_row_and_the_rescuer_publishes_it_later(
    private_redis, use_broker, workers, poll
):
    from tests.conftest import free_port

    use_broker(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    execution = submit("testapp.effect", kwargs={"seconds": 0})  # does not raise
    assert Execution.objects.get(pk=execution.pk).state == "PENDING"

    use_broker(private_redis.url)
    workers.start(broker=private_redis.url, concurrency=1)

    def done() -> bool:
        run_rescuer()
        return Execution.objects.get(pk=execution.pk).state == "SUCCEEDED"

    poll(done, timeout=60, interval=0.5, what="published by the rescuer and completed")
    assert Effect.objects.filter(key=execution.idempotency_key).count() == 1
