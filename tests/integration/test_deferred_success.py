"""The success recorder (``worker/recorder.py``): a non-atomic body's success written by a
thread of its pool process while the process takes its next message.

Bodies are counted in ``EffectRaw`` (one ``started`` row per body run, no unique constraint),
so a success the recorder dropped, which the rescuer would make run again, shows as a second
row, and an execution left ``RUNNING`` fails the poll (no rescuer runs in these tests).
"""

from __future__ import annotations

import time
import uuid

import pytest
from django.db import connections

from taskplatform import submit
from taskplatform.models import Execution, ExecutionEvent
from tests.helpers import event_kinds, result_backend_at
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.worker]

#: How long the test holds the lock that keeps the recorders' writes waiting: longer than the
#: second billiard gives an exiting pool process before ``os._exit`` (a fault's duration, not a
#: wait for something to happen).
HOLD_SECONDS = 3.0


@pytest.mark.timeout(150)
def test_pool_processes_recycled_after_every_task_record_every_success_once(workers, poll, open_gate):
    """``--max-tasks-per-child 1``: every pool process exits right after its body returned,
    while its success is still with the recorder: the test holds a lock that blocks the write
    (a share lock on the event table, which the success's statement appends to) for longer
    than billiard's grace before ``os._exit``. The exit waits for the write (Celery's
    ``worker_process_shutdown``); otherwise the process is gone and the attempt stays
    RUNNING."""
    workers.start(concurrency=2, extra_args=["--max-tasks-per-child", "1"])
    executions = [submit("testapp.effect", kwargs={"gate": "recycle"}) for _ in range(2)]
    keys = [e.idempotency_key for e in executions]
    poll(lambda: EffectRaw.objects.filter(key__in=keys, phase="started").count() == 2, timeout=60, what="bodies")

    locker = connections.create_connection("default")
    try:
        locker.set_autocommit(False)
        with locker.cursor() as cursor:
            cursor.execute(f"LOCK TABLE {ExecutionEvent._meta.db_table} IN SHARE MODE")
        open_gate("recycle:1")
        poll(lambda: EffectRaw.objects.filter(key__in=keys, phase="done").count() == 2, timeout=60, what="returns")
        time.sleep(HOLD_SECONDS)  # the fault's duration: the writes stay blocked this long
    finally:
        locker.rollback()
        locker.close()

    pks = [e.pk for e in executions]
    poll(
        lambda: Execution.objects.filter(pk__in=pks, state="SUCCEEDED").count() == len(pks),
        timeout=30,
        what="every execution SUCCEEDED",
    )
    for execution in executions:
        key = execution.idempotency_key
        assert EffectRaw.objects.filter(key=key, phase="started").count() == 1
        assert Effect.objects.filter(key=key).count() == 1
        assert event_kinds(execution.pk) == ["claimed", "succeeded"]


@pytest.mark.timeout(120)
def test_a_task_whose_result_celery_stores_is_succeeded_in_the_ledger_once_get_returns(workers, private_redis):
    """Read-your-writes for ``.get()``: a task with ``ignore_result=False``, or a call with
    ``apply_async(ignore_result=False)``, records its success in the pool process, before
    Celery stores the result, so the row says SUCCEEDED by the time ``.get()`` returns,
    every time (no poll: a deferred write loses this race often)."""
    from tests.testapp.tasks import doubled_with_result, effect

    with result_backend_at(private_redis.url):
        workers.start(concurrency=1, env={"CELERY_RESULT_BACKEND": private_redis.url})
        for i in range(20):
            async_result = doubled_with_result.delay(i)
            assert async_result.get(timeout=60) == 2 * i
            assert Execution.objects.get(celery_task_id=async_result.id).state == "SUCCEEDED"
        for _ in range(20):
            async_result = effect.apply_async(ignore_result=False)
            assert async_result.get(timeout=60)["token"] == 1
            assert Execution.objects.get(celery_task_id=async_result.id).state == "SUCCEEDED"


@pytest.mark.timeout(120)
def test_a_callback_finds_its_parent_succeeded_in_the_ledger(workers, poll, open_gate):
    """Celery publishes a ``link`` callback right after the body: the parent's success is
    recorded before that (not deferred), so the callback reads SUCCEEDED. The test holds the
    parent's row locked as its body ends, so a success written behind the pool process would
    still be waiting when the callback reads the row (a plain read is not blocked). The
    callback runs on another worker: a claim in the parent's own pool process would carry the
    parked success and wait for the lock with it (``worker/recorder.py``), hiding the fault."""
    from tests.testapp.tasks import effect, parent_state

    workers.start(concurrency=1)
    workers.start(concurrency=1, queues="callbacks")
    task_id = str(uuid.uuid4())
    effect.apply_async(kwargs={"gate": "parent"}, task_id=task_id, link=parent_state.si(task_id).set(queue="callbacks"))
    poll(lambda: EffectRaw.objects.filter(key=task_id, phase="started").exists(), timeout=60, what="parent body")
    parent = Execution.objects.get(idempotency_key=task_id)
    locker = connections.create_connection("default")
    try:
        locker.set_autocommit(False)
        with locker.cursor() as cursor:
            cursor.execute(f"SELECT id FROM {Execution._meta.db_table} WHERE id = %s FOR UPDATE", [parent.pk])
        open_gate("parent:1")
        poll(lambda: EffectRaw.objects.filter(key=task_id, phase="done").exists(), timeout=60, what="parent returns")
        time.sleep(HOLD_SECONDS)  # the fault's duration: the parent's success write waits this long
    finally:
        locker.rollback()
        locker.close()
    seen = poll(lambda: EffectRaw.objects.filter(key=f"parent-state:{task_id}").first(), timeout=60, what="callback")
    assert seen.phase == "SUCCEEDED"


@pytest.mark.timeout(120)
def test_the_ledger_keeps_what_the_body_returned_though_a_hook_changes_it_afterwards(workers, poll):
    """The recorder writes later, on another thread: the result is encoded in the pool
    process at the handoff, before Celery's ``after_return`` changes the returned object."""
    workers.start(concurrency=1)
    executions = [submit("testapp.shared_result", [n]) for n in range(15)]
    pks = [e.pk for e in executions]
    poll(
        lambda: Execution.objects.filter(pk__in=pks, state="SUCCEEDED").count() == len(pks),
        timeout=60,
        what="every execution SUCCEEDED",
    )
    assert [Execution.objects.get(pk=pk).result for pk in pks] == [{"value": n} for n in range(15)]


@pytest.mark.timeout(120)
def test_a_busy_pool_process_commits_each_success_with_its_next_claim(workers, poll):
    """One pool process, a queue already full: each body's success is parked and the next
    claim's statement writes it (``core/_pg.py: _carrying``), so the success of one execution
    and the claim of the next share a transaction: their event rows have the same ``xmin``.
    Every body still ran once (``EffectRaw``, no unique constraint) and every execution has one
    claim and one success."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("claims carry successes on PostgreSQL only")
    executions = [submit("testapp.effect") for _ in range(20)]
    pks = [e.pk for e in executions]
    workers.start(concurrency=1)
    poll(
        lambda: Execution.objects.filter(pk__in=pks, state="SUCCEEDED").count() == len(pks),
        timeout=60,
        what="every execution SUCCEEDED",
    )
    for execution in executions:
        key = execution.idempotency_key
        assert EffectRaw.objects.filter(key=key, phase="started").count() == 1
        assert event_kinds(execution.pk) == ["claimed", "succeeded"]
    table = ExecutionEvent._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM {table} s JOIN {table} c ON s.xmin::text = c.xmin::text "
            f"WHERE s.kind = 'succeeded' AND c.kind = 'claimed' AND s.execution_id <> c.execution_id "
            f"AND s.execution_id = ANY(%s) AND c.execution_id = ANY(%s)",
            [pks, pks],
        )
        (shared,) = cursor.fetchone()
    # 19 could ride (the last has no next claim); a success whose next claim came later than
    # RIDE_SECONDS on a loaded machine is written alone, which is allowed. Without riding: none.
    assert shared >= 1, f"none of {len(pks) - 1} successes rode with the next claim"
