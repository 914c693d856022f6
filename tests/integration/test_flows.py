"""Flows with real workers: steps in order, compensations in reverse, faults at every point.

The flow is ``tests/testapp/tasks.py``'s ``test-order``: atomic steps ``a``, ``b``, ``c``, the
first two with atomic compensations. Effects are counted in ``Effect`` (no unique
constraint): each forward effect and each compensation must be there exactly once where the
flow's outcome says it happened, and not at all otherwise. Body starts are logged outside
the transactions (a Redis list) to find the pool process to kill.
"""

from __future__ import annotations

import os
import signal
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings

from taskplatform import submit_flow
from taskplatform.console import interventions
from taskplatform.core import flows
from taskplatform.core.publisher import publish
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, FlowRun, FlowState
from tests.testapp.models import Effect, Gate
from tests.testapp.tasks import TEST_FLOW, TEST_FLOW_LATE, TEST_FLOW_ONE_SHOT, TEST_FLOW_REPLACING

pytestmark = [pytest.mark.worker]


def effects(order: str) -> list[str]:
    """The committed effects of ``order``, in commit order, without the order prefix."""
    keys = Effect.objects.filter(key__startswith=f"{order}:").order_by("id").values_list("key", flat=True)
    return [k[len(order) + 1 :] for k in keys]


def run_of(order: str) -> FlowRun:
    return FlowRun.objects.get(key=f"order:{order}")


def finished(order: str, state: str):
    def check() -> bool:
        return run_of(order).state == state

    return check


def start(order: str, **input) -> FlowRun:
    return submit_flow(TEST_FLOW, key=f"order:{order}", input={"order": order, **input})


def new_order() -> str:
    return uuid.uuid4().hex[:10]


def test_steps_run_in_order_and_each_result_feeds_the_next(workers, poll):
    workers.start(concurrency=2)
    order = new_order()
    start(order)
    poll(finished(order, FlowState.SUCCEEDED), timeout=60, what="the flow succeeded")
    assert effects(order) == ["a", "b", "c"]
    run = run_of(order)
    assert run.results["a"]["step"] == "a" and set(run.results) == {"a", "b", "c"}
    b = Execution.objects.get(idempotency_key=f"flow:{run.pk}:1:b")
    assert b.kwargs["previous"] == {"a": run.results["a"]}, "step b got a's result"
    assert b.flow_id == run.pk and b.trigger == "flow"


@pytest.mark.parametrize(
    ("fail_at", "expected"),
    [
        ("a", []),
        ("b", ["a", "a:undo"]),
        ("c", ["a", "b", "b:undo", "a:undo"]),
    ],
)
def test_a_step_failing_for_good_compensates_the_steps_before_it_in_reverse(workers, poll, fail_at, expected):
    workers.start(concurrency=2)
    order = new_order()
    start(order, fail_at=fail_at)
    poll(finished(order, FlowState.COMPENSATED), timeout=60, what="the flow compensated")
    assert effects(order) == expected
    run = run_of(order)
    assert run.failed_step == fail_at and "fails for good" in run.error


def test_a_failed_compensation_stops_the_flow_until_an_operator_retries_it(workers, poll):
    workers.start(concurrency=2)
    order = new_order()
    start(order, fail_at="c", undo_fails="a")
    poll(finished(order, FlowState.FAILED_TO_COMPENSATE), timeout=60, what="failed to compensate")
    assert effects(order) == ["a", "b", "b:undo"]
    run = run_of(order)
    undo = Execution.objects.get(idempotency_key=f"flow:{run.pk}:0:a:undo")
    assert undo.state == "FAILED", "the compensation is a dead letter in the console"
    Gate.objects.create(name=f"undo-ok:{order}", open=True)
    outcome = interventions.apply("retry_now", {undo.pk: "FAILED"}, user="ops", reason="gateway fixed")
    assert outcome.changed == [undo.pk]
    poll(finished(order, FlowState.COMPENSATED), timeout=60, what="compensated after the retry")
    assert effects(order) == ["a", "b", "b:undo", "a:undo"]


def test_an_operator_can_mark_a_failed_compensation_done(workers, poll):
    workers.start(concurrency=2)
    order = new_order()
    start(order, fail_at="b", undo_fails="a")
    poll(finished(order, FlowState.FAILED_TO_COMPENSATE), timeout=60, what="failed to compensate")
    run = run_of(order)
    undo = Execution.objects.get(idempotency_key=f"flow:{run.pk}:0:a:undo")
    interventions.apply("mark_succeeded", {undo.pk: "FAILED"}, user="ops", reason="refunded by hand")
    assert run_of(order).state == FlowState.COMPENSATED
    assert effects(order) == ["a"], "nothing more ran"


def _starts(key: str) -> list[tuple[int, int]]:
    raw = redis.Redis.from_url(settings.CELERY_BROKER_URL).lrange(f"tp-starts:{key}", 0, -1)
    return [tuple(int(x) for x in item.decode().split(":")) for item in raw]  # type: ignore[misc]


@pytest.mark.fault
@pytest.mark.parametrize("kill_at", ["a", "b", "c", "undo:a", "undo:b"])
def test_a_pool_process_killed_in_any_step_or_compensation_changes_nothing_but_time(workers, poll, kill_at):
    """SIGKILL of the pool process running one step or compensation: the attempt is taken
    over, the flow ends as its failures imply, and every effect is there exactly once."""
    worker = workers.start(concurrency=2)
    order = new_order()
    compensating = kill_at.startswith("undo:")
    start(order, kill_at=kill_at, fail_at="c" if compensating else "")
    run = poll(lambda: FlowRun.objects.filter(key=f"order:{order}").first(), timeout=30, what="the run")
    step = kill_at.removeprefix("undo:")
    index = "abc".index(step)
    key = f"flow:{run.pk}:{index}:{step}" + (":undo" if compensating else "")
    token, pid = poll(lambda: (_starts(key) or [None])[0], timeout=60, what=f"{kill_at} started")
    assert pid in {c.pid for c in worker.pool_children()}, "only our own pool child is signalled"
    os.kill(pid, signal.SIGKILL)
    Gate.objects.create(name=f"flow-kill:{order}:{kill_at}:{token + 1}", open=True)
    final = FlowState.COMPENSATED if compensating else FlowState.SUCCEEDED
    poll(finished(order, final), timeout=90, interval=0.2, what=f"the flow {final.lower()}")
    expected = ["a", "b", "b:undo", "a:undo"] if compensating else ["a", "b", "c"]
    assert effects(order) == expected
    assert [t for t, _ in _starts(key)] == [token, token + 1], "the killed attempt and its takeover"


@pytest.mark.fault
def test_a_step_an_operator_stops_while_it_runs_is_undone_too_once_its_lease_ends(workers, poll):
    """An operator cancels a running step and leaves its body running (no revoke): nothing is
    undone beside it; once the step's last lease has ended, its own compensation runs (it may
    have done its work), then the earlier steps', each exactly once. The stopped atomic body
    goes on, its success is refused, and its effect never commits."""
    workers.start(concurrency=2)
    order = new_order()
    run = start(order, kill_at="b")
    key = f"flow:{run.pk}:1:b"
    token, _pid = poll(lambda: (_starts(key) or [None])[0], timeout=60, what="b started")
    step = Execution.objects.get(idempotency_key=key)
    outcome = interventions.apply("cancel", {step.pk: "RUNNING"}, user="ops", reason="stuck", revoke=False)
    assert outcome.changed == [step.pk]
    fence = Execution.objects.get(pk=step.pk).lease_expires_at
    assert fence is not None, "the cancelled step keeps its last lease as a fence"
    Gate.objects.create(name=f"flow-kill:{order}:b:{token}", open=True)  # the stopped body goes on
    poll(
        lambda: step.events.filter(kind="stale_write_rejected").exists(),
        timeout=60,
        what="the stopped body's success refused",
    )

    def compensated() -> bool:
        run_rescuer()  # the backstop that looks again once the fence has passed (no maintenance in tests)
        return run_of(order).state == FlowState.COMPENSATED

    poll(compensated, timeout=60, interval=0.5, what="compensated once the fence passed")
    assert effects(order) == ["a", "b:undo", "a:undo"]
    undo = Execution.objects.get(idempotency_key=f"{key}:undo")
    assert undo.created_at >= fence, "the stopped step's compensation was submitted only after its lease ended"
    assert [t for t, _ in _starts(key)] == [token], "the stopped step did not run again"
    assert len(_starts(f"{key}:undo")) == 1


@pytest.mark.fault
def test_a_stopped_step_whose_body_runs_past_its_lease_is_undone_only_after_the_body_ended(workers, poll):
    """A non-atomic step cancelled by an operator (no revoke) whose body goes on well past the
    lease it held when stopped: its worker keeps the fence while the body runs, so the run
    compensates only after the body ended, and the compensation finds the effect to undo."""
    from django.db import connection

    workers.start(concurrency=2)
    order = new_order()
    run = submit_flow(TEST_FLOW_LATE, key=f"order:{order}", input={"order": order})
    key = f"flow:{run.pk}:1:b"
    token, _pid = poll(lambda: (_starts(key) or [None])[0], timeout=60, what="b started")
    step = Execution.objects.get(idempotency_key=key)
    outcome = interventions.apply("cancel", {step.pk: "RUNNING"}, user="ops", reason="too slow", revoke=False)
    assert outcome.changed == [step.pk]
    first_fence = Execution.objects.get(pk=step.pk).lease_expires_at

    def db_now():
        with connection.cursor() as cursor:
            cursor.execute("SELECT CURRENT_TIMESTAMP")
            return cursor.fetchone()[0]

    # Well past the lease the attempt held when it was stopped, the body still runs: nothing is
    # undone yet, however often the run is looked at.
    poll(lambda: db_now() > first_fence + timedelta(seconds=2), timeout=60, interval=0.2, what="the first fence passed")
    run_rescuer()
    assert run_of(order).state == FlowState.RUNNING
    assert not Execution.objects.filter(idempotency_key=f"{key}:undo").exists()
    assert Execution.objects.get(pk=step.pk).lease_expires_at > first_fence, "the fence was kept"
    Gate.objects.create(name=f"flow-late:{order}:b:{token}", open=True)
    poll(lambda: "b" in effects(order), timeout=30, what="the stopped body's effect")
    body_ended = db_now()

    def compensated() -> bool:
        run_rescuer()
        return run_of(order).state == FlowState.COMPENSATED

    poll(compensated, timeout=60, interval=0.5, what="compensated after the body ended")
    assert effects(order) == ["a", "b", "b:undo", "a:undo"]
    undo = Execution.objects.get(idempotency_key=f"{key}:undo")
    assert undo.created_at >= body_ended, "the compensation was submitted after the stopped body's effect"


@pytest.mark.fault
def test_a_step_whose_only_attempt_is_lost_is_dead_lettered_and_undone_too_without_waiting(workers, poll):
    """SIGKILL of the pool process running a step's last attempt: its redelivery finds the
    attempts spent and dead-letters it as lost. The step may have done its work, so it is
    compensated too, then the steps before it, each exactly once; and the flow moves on at once
    (not at the rescuer's next look at the run, a minute later)."""
    worker = workers.start(concurrency=2)
    order = new_order()
    run = submit_flow(TEST_FLOW_ONE_SHOT, key=f"order:{order}", input={"order": order, "kill_at": "b"})
    key = f"flow:{run.pk}:1:b"
    token, pid = poll(lambda: (_starts(key) or [None])[0], timeout=60, what="b started")
    assert pid in {c.pid for c in worker.pool_children()}, "only our own pool child is signalled"
    os.kill(pid, signal.SIGKILL)
    # No rescuer runs here, and the run's own backstop look is CHECK_SECONDS (60 s) away.
    poll(finished(order, FlowState.COMPENSATED), timeout=flows.CHECK_SECONDS - 15, interval=0.2,
         what="compensated")  # fmt: skip
    assert effects(order) == ["a", "b:undo", "a:undo"]
    step = Execution.objects.get(idempotency_key=key)
    assert step.state == "FAILED" and step.attempts == 1
    assert step.events.filter(kind="dead_lettered", data__attempt_lost=True).exists()
    assert [t for t, _ in _starts(key)] == [token], "the lost attempt's body did not run again"


def test_a_step_that_replaces_itself_is_refused_with_a_clear_error_and_the_flow_compensates(workers, poll):
    """``self.replace()`` inside a step: the flow would have moved on before the replacement ran.
    Refused: the step fails with a clear error, nothing is replaced, the steps before it are
    undone."""
    from tests.testapp.models import EffectRaw

    workers.start(concurrency=2)
    order = new_order()
    run = submit_flow(TEST_FLOW_REPLACING, key=f"order:{order}", input={"order": order})
    poll(finished(order, FlowState.COMPENSATED), timeout=60, what="compensated")
    step = Execution.objects.get(idempotency_key=f"flow:{run.pk}:1:r")
    assert step.state == "FAILED" and "cannot replace itself" in step.last_error
    assert effects(order) == ["a", "a:undo"]
    assert not EffectRaw.objects.filter(key=step.idempotency_key, phase__startswith="replacement").exists()
    assert not Execution.objects.filter(idempotency_key__startswith=f"{step.idempotency_key}:replaced").exists()


def test_duplicate_advances_and_duplicate_messages_run_nothing_twice(workers, poll):
    """Every message of a finished flow published again, and ``advance`` called again and
    again meanwhile: each step and compensation has run once."""
    workers.start(concurrency=2)
    order = new_order()
    start(order, fail_at="c")
    run = run_of(order)
    for _ in range(20):
        flows.advance(run.pk)
    poll(finished(order, FlowState.COMPENSATED), timeout=60, what="compensated")
    for execution in Execution.objects.filter(flow_id=run.pk):
        publish(execution, task_id=execution.celery_task_id)
        publish(execution, task_id=f"dup-{uuid.uuid4()}")
    flows.advance(run.pk)
    run_rescuer()
    poll(
        lambda: (
            Execution.objects.filter(flow_id=run.pk, events__kind="already_finished").distinct().count()
            == Execution.objects.filter(flow_id=run.pk).count()
        ),
        timeout=60,
        what="every duplicate delivered and absorbed",
    )
    assert effects(order) == ["a", "b", "b:undo", "a:undo"]
    assert run_of(order).state == FlowState.COMPENSATED


@pytest.mark.parametrize("fail_at", ["", "c"])
def test_every_message_delivered_twice_while_the_flow_runs_runs_nothing_twice(workers, poll, fail_at):
    """Duplicate delivery of every message: each step's and compensation's message is published
    a second time (the same task id) as soon as its row appears, while the first is queued or
    running. Each forward effect and each compensation still happens exactly once."""
    import threading

    from django.db import connection

    workers.start(concurrency=4)
    order = new_order()
    run = start(order, fail_at=fail_at)
    final = FlowState.COMPENSATED if fail_at else FlowState.SUCCEEDED
    seen: set[int] = set()
    stop = threading.Event()

    def duplicate() -> None:
        try:
            while not stop.is_set():
                for execution in Execution.objects.filter(flow_id=run.pk).exclude(pk__in=seen):
                    if execution.celery_task_id:
                        publish(execution, task_id=execution.celery_task_id)
                        seen.add(execution.pk)
                stop.wait(0.02)  # the duplicator's own pace, not synchronisation
        finally:
            connection.close()

    thread = threading.Thread(target=duplicate, daemon=True)
    thread.start()
    try:
        poll(finished(order, final), timeout=60, what=f"the flow {final.lower()}")
    finally:
        stop.set()
        thread.join(timeout=10)
    expected = ["a", "b", "b:undo", "a:undo"] if fail_at else ["a", "b", "c"]
    assert effects(order) == expected
    assert len(seen) == len(expected) + (1 if fail_at else 0), "every message was duplicated"
    poll(
        lambda: (
            Execution.objects.filter(flow_id=run.pk, events__kind__in=("already_finished", "duplicate_delivery"))
            .distinct()
            .count()
            == len(seen)
        ),
        timeout=60,
        what="every duplicate absorbed",
    )
    assert effects(order) == expected


def test_the_rescuer_moves_a_flow_on_when_its_worker_died_before_advancing(transactional_db):
    """The backstop: a step finished but nobody advanced (the worker died in between)."""
    from datetime import timedelta

    from django.utils import timezone

    from taskplatform.core import ledger

    order = new_order()
    run = start(order)
    first = Execution.objects.get(idempotency_key=f"flow:{run.pk}:0:a")
    claim = ledger.claim(first, worker="n:1", celery_task_id=first.celery_task_id, lease_seconds=30, max_attempts=3)
    ledger.succeed(claim.execution, claim.token, {"step": "a"}, worker="n:1", data={})
    assert not Execution.objects.filter(idempotency_key=f"flow:{run.pk}:1:b").exists()
    FlowRun.objects.filter(pk=run.pk).update(check_at=timezone.now() - timedelta(seconds=1))
    assert run_rescuer().flows_advanced == 1
    assert Execution.objects.filter(idempotency_key=f"flow:{run.pk}:1:b", flow_id=run.pk).exists()


def test_the_console_shows_a_flow_with_its_steps_and_compensations_on_one_timeline(workers, poll, admin_client):
    workers.start(concurrency=2)
    order = new_order()
    start(order, fail_at="c")
    poll(finished(order, FlowState.COMPENSATED), timeout=60, what="compensated")
    run = run_of(order)
    listing = admin_client.get("/admin/taskplatform/flowrun/?state__exact=COMPENSATED").content.decode()
    assert f"order:{order}" in listing
    assert (
        f"order:{order}" not in admin_client.get("/admin/taskplatform/flowrun/?state__exact=RUNNING").content.decode()
    )
    page = admin_client.get(f"/admin/taskplatform/flowrun/{run.pk}/change/").content.decode()
    assert page.count("not submitted") == 0 and "undo <b>a</b>" in page and "undo <b>b</b>" in page
    for part in ("a", "b", "c", "b (compensation)", "a (compensation)"):
        assert f">{part}</a>" in page, part
    assert "dead_lettered" in page and "fails for good" in page
