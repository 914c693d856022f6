"""The same protocol on RabbitMQ: completion, and a duplicate message absorbed."""

from __future__ import annotations

import contextlib

import pytest

from taskplatform import submit
from taskplatform.core.publisher import publish
from tests.conftest import require_service
from tests.helpers import event_kinds, state_of
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.chaos, pytest.mark.worker]

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def rabbitmq(use_broker):
    require_service("RabbitMQ", "127.0.0.1", 5672)
    from kombu import Connection

    with Connection(AMQP_URL) as conn, contextlib.suppress(Exception):  # absent queue: nothing to purge
        conn.default_channel.queue_purge("celery")
    use_broker(AMQP_URL)
    return AMQP_URL


def test_rabbitmq_worker_runs_a_submitted_execution_once_despite_a_duplicate(rabbitmq, workers, poll, open_gate):
    workers.start(broker=rabbitmq, concurrency=2)
    execution = submit("testapp.effect", kwargs={"gate": "amqp"})
    poll(lambda: EffectRaw.objects.filter(key=execution.idempotency_key).exists(), timeout=30, what="running")
    publish(execution, task_id=execution.celery_task_id)
    poll(lambda: "duplicate_delivery" in event_kinds(execution.pk), timeout=30, what="duplicate absorbed")
    open_gate("amqp:1")
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=30, what="success")
    assert Effect.objects.filter(key=execution.idempotency_key).count() == 1
