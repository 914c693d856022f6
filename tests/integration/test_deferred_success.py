"""The success recorder (``worker/recorder.py``): a non-atomic body's success written by a
thread of its pool process while the process takes its next message.

Bodies are counted in ``EffectRaw`` (one ``started`` row per body run, no unique constraint),
so a success the recorder dropped, which the rescuer would make run again, shows as a second
row, and an execution left ``RUNNING`` fails the poll.
"""

from __future__ import annotations

import pytest

from taskplatform import submit
from taskplatform.models import Execution
from tests.helpers import event_kinds
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.worker]


def test_pool_processes_recycled_after_every_task_record_every_success_once(workers, poll):
    """``--max-tasks-per-child 1``: every pool process exits right after its body returned,
    with its success still on the recorder's queue. The exit writes it first (Celery's
    ``worker_process_shutdown``); otherwise the attempt stays RUNNING (no rescuer runs here)."""
    workers.start(concurrency=2, extra_args=["--max-tasks-per-child", "1"])
    executions = [submit("testapp.effect") for _ in range(12)]
    pks = [e.pk for e in executions]
    poll(
        lambda: Execution.objects.filter(pk__in=pks, state="SUCCEEDED").count() == len(pks),
        timeout=60,
        what="every execution SUCCEEDED",
    )
    for execution in executions:
        key = execution.idempotency_key
        assert EffectRaw.objects.filter(key=key, phase="started").count() == 1
        assert Effect.objects.filter(key=key).count() == 1
        assert event_kinds(execution.pk) == ["claimed", "succeeded"]


@pytest.mark.timeout(120)
def test_a_task_whose_result_celery_stores_is_succeeded_in_the_ledger_once_get_returns(workers, private_redis):
    """Read-your-writes for ``.get()``: a task with ``ignore_result=False`` records its success
    in the pool process, before Celery stores the result, so the row says SUCCEEDED by the
    time ``.get()`` returns, every time (no poll: a deferred write loses this race often)."""
    from tests.helpers import result_backend_at
    from tests.testapp.tasks import doubled_with_result

    with result_backend_at(private_redis.url):
        workers.start(concurrency=1, env={"CELERY_RESULT_BACKEND": private_redis.url})
        for i in range(30):
            async_result = doubled_with_result.delay(i)
            assert async_result.get(timeout=60) == 2 * i
            assert Execution.objects.get(celery_task_id=async_result.id).state == "SUCCEEDED"
