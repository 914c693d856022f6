"""G3 when an atomic body ends with ``Ignore`` or ``self.replace()``.

``Ignore`` ends a body as a success with no result, so in atomic mode its writes must commit
with the success mark: the ledger says ``SUCCEEDED`` if and only if the writes exist. A
replacement is published only after that commit, so it sees its parent's writes, and a stale
attempt (rolled back by its fencing token) publishes none. Rows are counted in ``EffectRaw``,
which has no unique constraint.
"""

from __future__ import annotations

import os
import signal

import pytest

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, ExecutionEvent, JobDefinition
from taskplatform.worker.owner import parse_owner
from tests.helpers import event_kinds, state_of
from tests.testapp.models import EffectRaw

pytestmark = [pytest.mark.worker]


def phases(key: str) -> list[tuple[str, int]]:
    return sorted(EffectRaw.objects.filter(key=key).values_list("phase", "fencing_token"))


def run_twice_with_the_first_attempt_paused(workers, poll, open_gate, task: str, gate: str) -> Execution:
    """Attempt 1 reaches its gate and is paused (SIGSTOP: a long GC pause, a frozen VM) past its
    lease; the rescuer re-queues it and attempt 2 runs to success; then attempt 1 wakes up and
    goes on. Returns once attempt 1's write-back was refused."""
    worker = workers.start(concurrency=2)
    job = JobDefinition.objects.create(slug=f"{gate}-job", task=task, lease_seconds=3)
    execution = submit(job, kwargs={"gate": gate})
    row = poll(lambda: Execution.objects.filter(pk=execution.pk, state="RUNNING").first(), timeout=30, what="attempt 1")
    owner = parse_owner(row.worker)
    assert owner is not None and owner.pid in {c.pid for c in worker.pool_children()}
    os.kill(owner.pid, signal.SIGSTOP)
    try:

        def rescued() -> bool:
            run_rescuer()
            return "rescued" in event_kinds(execution.pk)

        poll(rescued, timeout=30, interval=0.25, what="lease expiry and rescue")
        open_gate(f"{gate}:2")
        poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=30, what="attempt 2 succeeds")
    finally:
        open_gate(f"{gate}:1")
        os.kill(owner.pid, signal.SIGCONT)
    poll(lambda: "stale_write_rejected" in event_kinds(execution.pk), timeout=30, what="attempt 1's write refused")
    return execution


def test_an_atomic_body_ending_with_ignore_commits_its_writes_with_the_success(workers, poll):
    workers.start(concurrency=1)
    execution = submit("testapp.atomic_ignore")
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=30, what="success")
    assert phases(execution.idempotency_key) == [("written", 1)]
    assert event_kinds(execution.pk) == ["claimed", "succeeded"]
    succeeded = ExecutionEvent.objects.get(execution_id=execution.pk, kind="succeeded")
    assert succeeded.data["note"] == "body raised Ignore"


def test_an_atomic_body_replaced_commits_its_writes_and_its_replacement_sees_them(workers, poll):
    workers.start(concurrency=2)
    execution = submit("testapp.atomic_replace")
    key = execution.idempotency_key
    poll(
        lambda: EffectRaw.objects.filter(key=key, phase__startswith="replacement").exists(),
        timeout=30,
        what="replacement",
    )
    assert state_of(execution.pk) == "SUCCEEDED"
    # The parent's write committed, and the replacement ran once, after the commit.
    assert phases(key) == [("replacement:1:SUCCEEDED", 0), ("written", 1)]


@pytest.mark.fault
def test_a_stale_atomic_attempt_that_replaces_itself_publishes_no_replacement(workers, poll, open_gate):
    """Attempt 1 writes and is paused (SIGSTOP) past its lease; attempt 2 runs, replaces itself
    and commits; attempt 1 wakes up and replaces itself too: its fencing token is stale, so its
    write rolls back and its replacement is never published."""
    execution = run_twice_with_the_first_attempt_paused(workers, poll, open_gate, "testapp.atomic_replace", "stale")
    key = execution.idempotency_key
    poll(
        lambda: EffectRaw.objects.filter(key=key, phase__startswith="replacement").exists(),
        timeout=30,
        what="replacement",
    )

    # A message published after attempt 1's commit attempt and run to its end: anything attempt 1
    # published before it (a replacement sent ahead of the commit) has been delivered by then.
    sentinel = submit("testapp.effect")
    poll(lambda: state_of(sentinel.pk) == "SUCCEEDED", timeout=30, what="sentinel")
    poll(
        lambda: not Execution.objects.filter(task_name="testapp.replacement").exclude(state="SUCCEEDED").exists(),
        timeout=30,
        what="replacements finished",
    )

    # Attempt 2's write and its one replacement; attempt 1 left nothing and published nothing.
    # (Its replacement would have been a new execution, keyed by attempt 1's task id.)
    assert Execution.objects.filter(task_name="testapp.replacement").count() == 1
    assert phases(key) == [("replacement:1:SUCCEEDED", 0), ("written", 2)]


def test_a_plain_celery_call_replaced_runs_its_replacement_once(workers, poll):
    """A ``.delay()`` call is keyed by its task id, which ``replace()`` hands on to the replacement:
    the replacement must get an execution of its own, not be absorbed by its parent's."""
    from tests.testapp.tasks import atomic_replace

    workers.start(concurrency=2)
    result = atomic_replace.delay()
    parent = poll(
        lambda: Execution.objects.filter(celery_task_id=result.id, task_name="testapp.atomic_replace").first(),
        timeout=30,
        what="parent",
    )
    key = parent.idempotency_key
    poll(
        lambda: EffectRaw.objects.filter(key=key, phase__startswith="replacement").exists(),
        timeout=30,
        what="replacement",
    )
    assert state_of(parent.pk) == "SUCCEEDED"
    assert phases(key) == [("replacement:1:SUCCEEDED", 0), ("written", 1)]
    # The replacement is not atomic: its success is written just after its body returned.
    replacement = poll(
        lambda: Execution.objects.filter(task_name="testapp.replacement", state="SUCCEEDED").first(),
        timeout=30,
        what="the replacement SUCCEEDED",
    )
    assert replacement.idempotency_key != key


@pytest.mark.fault
def test_a_parent_run_twice_replaces_itself_once(workers, poll, open_gate):
    """Found in review: a non-atomic parent whose attempt is paused past its lease and rescued
    runs twice; both attempts call ``self.replace()``. The replacement is keyed from the parent's
    execution, so the second is absorbed: one replacement runs, not two."""
    execution = run_twice_with_the_first_attempt_paused(workers, poll, open_gate, "testapp.plain_replace", "twice")
    key = execution.idempotency_key
    sentinel = submit("testapp.effect")
    poll(lambda: state_of(sentinel.pk) == "SUCCEEDED", timeout=30, what="sentinel")
    poll(
        lambda: not Execution.objects.filter(task_name="testapp.replacement").exclude(state="SUCCEEDED").exists(),
        timeout=30,
        what="replacements finished",
    )
    replacements = Execution.objects.filter(task_name="testapp.replacement")
    assert [r.idempotency_key for r in replacements] == [f"{key}:replaced"]
    assert EffectRaw.objects.filter(key=key, phase__startswith="replacement").count() == 1
    assert sorted(EffectRaw.objects.filter(key=key, phase="written").values_list("fencing_token", flat=True)) == [1, 2]
