"""G2: one idempotency key, one body run — against a real worker pool on a real broker."""

from __future__ import annotations

import pytest

from taskplatform import submit
from taskplatform.core.publisher import publish
from taskplatform.models import Execution
from tests.helpers import event_kinds, race, state_of, tally
from tests.testapp.models import Effect, EffectRaw
from tests.testapp.tasks import effect

pytestmark = [pytest.mark.chaos, pytest.mark.worker]


@pytest.mark.scenario(16)
def test_the_same_message_delivered_twice_runs_the_body_once(workers, poll, open_gate, figures):
    workers.start(concurrency=2)
    execution = submit("testapp.effect", kwargs={"gate": "dup"})
    poll(lambda: EffectRaw.objects.filter(key=execution.idempotency_key).exists(), timeout=30, what="first run")
    # A byte-for-byte duplicate of the message: same task id, same headers (a broker
    # re-delivery or a double publish), while the first copy is still running.
    publish(execution, task_id=execution.celery_task_id)
    poll(lambda: "duplicate_delivery" in event_kinds(execution.pk), timeout=30, what="duplicate absorbed")
    open_gate("dup:1")
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=30, what="success")

    # And once more after success: the stored result is returned, the body does not run.
    publish(execution, task_id=execution.celery_task_id)
    poll(lambda: "already_finished" in event_kinds(execution.pk), timeout=30, what="late duplicate absorbed")

    assert EffectRaw.objects.filter(key=execution.idempotency_key, phase="started").count() == 1
    assert Effect.objects.filter(key=execution.idempotency_key).count() == 1
    assert Execution.objects.count() == 1
    row = Execution.objects.get(pk=execution.pk)
    assert (row.attempts, row.fencing_token) == (1, 1)
    kinds = event_kinds(execution.pk)
    absorbed = kinds.count("duplicate_delivery") + kinds.count("already_finished")
    figures.record(**tally([execution]), messages=3, absorbed=absorbed)


@pytest.mark.scenario(16)
def test_the_same_key_submitted_from_eight_threads_is_one_execution(workers, poll, figures):
    workers.start(concurrency=2)

    def client(i: int, start) -> int:
        start()
        return submit("testapp.effect", kwargs={"seconds": 0.2}, idempotency_key="order-42").pk

    ids = race(8, client)
    assert len(set(ids)) == 1 and len(ids) == 8
    poll(lambda: state_of(ids[0]) == "SUCCEEDED", timeout=30, what="success")
    assert Execution.objects.count() == 1
    assert EffectRaw.objects.filter(key="order-42", phase="started").count() == 1
    assert Effect.objects.filter(key="order-42").count() == 1
    figures.record(**tally(Execution.objects.filter(pk=ids[0])), submissions=8)


@pytest.mark.scenario(16)
def test_a_plain_celery_call_is_keyed_by_its_task_id_so_a_redelivery_is_absorbed(workers, poll, figures):
    workers.start(concurrency=2)
    effect.apply_async(kwargs={"seconds": 0.5}, task_id="plain-call-1")
    effect.apply_async(kwargs={"seconds": 0.5}, task_id="plain-call-1")
    poll(lambda: Execution.objects.filter(idempotency_key="plain-call-1", state="SUCCEEDED").exists(), timeout=30)
    poll(lambda: len(event_kinds(Execution.objects.get().pk)) >= 3, timeout=30, what="second copy handled")
    assert Execution.objects.count() == 1
    assert Execution.objects.get().trigger == "celery"
    assert Effect.objects.filter(key="plain-call-1").count() == 1
    assert EffectRaw.objects.filter(key="plain-call-1", phase="started").count() == 1
    figures.record(**tally(Execution.objects.all()), messages=2)


@pytest.mark.parametrize("child", ["testapp.forwarding_parent", "testapp.effect"])
def test_a_child_sent_with_its_parents_forwarded_headers_runs_once_and_so_does_the_parent(workers, poll, child):
    """A body that sends a child with ``headers=self.request.headers`` copies the ledger's
    headers, which name its own execution, into the child's message. The child, of the same
    task (other arguments) or of another, must neither be absorbed into the parent's execution
    (then it silently never runs) nor claim it: it runs once, as an execution of its own keyed
    by its task id, and the parent's row records the parent's one attempt. One pool process,
    so the parent's success is still with the recorder when the child is claimed (carried in
    the child's claim). Body runs are counted in ``EffectRaw`` (no unique constraint)."""
    workers.start(concurrency=1)
    parent = submit("testapp.forwarding_parent", kwargs={"child": child, "child_task_id": f"child-of-{child}"})
    poll(
        lambda: Execution.objects.filter(idempotency_key=f"child-of-{child}", state="SUCCEEDED").exists(),
        timeout=60,
        what="the child's own execution succeeded",
    )
    poll(lambda: state_of(parent.pk) == "SUCCEEDED", timeout=30, what="the parent succeeded")
    row = Execution.objects.get(pk=parent.pk)
    assert (row.attempts, row.fencing_token, event_kinds(parent.pk)) == (1, 1, ["claimed", "succeeded"])
    own = Execution.objects.get(idempotency_key=f"child-of-{child}")
    assert (own.task_name, own.kwargs, own.attempts) == (child, {}, 1)
    assert EffectRaw.objects.filter(key=parent.idempotency_key, phase="started").count() == 1
    assert EffectRaw.objects.filter(key=own.idempotency_key, phase="started").count() == 1
