"""Reading an execution's result: from the ledger, and through Celery's own API.

Found adopting the app: ``IdempotentTask`` sets ``ignore_result = True`` (the ledger is the
record of outcomes), so an existing ``task.delay(...).get()`` got nothing back, and no way to
read a result was documented. Both ways are documented in ``docs/writing-tasks.md``:
``Execution.result`` always; ``.get()`` for a task with ``ignore_result=False`` in a project
with a result backend.
"""

from __future__ import annotations

from typing import Any

import pytest

from taskplatform import submit
from taskplatform.models import Execution
from tests.helpers import result_backend_at, state_of, wait_for
from tests.testapp.tasks import doubled_with_result

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


@pytest.mark.timeout(120)
def test_a_delay_get_pattern_gets_the_result_and_the_ledger_holds_it(workers: Any, private_redis: Any) -> None:
    with result_backend_at(private_redis.url):
        workers.start(concurrency=1, env={"CELERY_RESULT_BACKEND": private_redis.url})
        async_result = doubled_with_result.delay(21)
        assert async_result.get(timeout=60) == 42
        row = Execution.objects.get(celery_task_id=async_result.id)
        assert (row.state, row.result) == ("SUCCEEDED", 42)

        # A submitted execution's result is the ledger's (its message ignores the backend).
        execution = submit(doubled_with_result, [5])
        wait_for(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="the submitted execution")
        assert Execution.objects.get(pk=execution.pk).result == 10
