"""G3: in atomic mode the body's writes commit if and only if the ledger records success."""

from __future__ import annotations

import os
import signal

import pytest

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, JobDefinition
from taskplatform.worker.owner import parse_owner
from tests.helpers import event_kinds, state_of
from tests.testapp.models import Effect

pytestmark = [pytest.mark.worker]


def test_a_body_that_writes_then_raises_leaves_no_write(workers, poll):
    workers.start(concurrency=1)
    execution = submit("testapp.atomic_effect", kwargs={"fail": True})
    poll(lambda: state_of(execution.pk) == "FAILED", timeout=30, what="failure recorded")
    assert Effect.objects.count() == 0
    assert "FatalError: failing after the write" in Execution.objects.get(pk=execution.pk).last_error


def test_a_successful_atomic_body_commits_with_the_ledger(workers, poll):
    workers.start(concurrency=1)
    execution = submit("testapp.atomic_effect")
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=30, what="success")
    assert list(Effect.objects.values_list("key", "fencing_token")) == [(f"{execution.idempotency_key}#1", 1)]


@pytest.mark.fault
def test_a_stale_worker_cannot_overwrite_a_newer_attempt(workers, poll, open_gate):
    """Attempt 1 is paused (SIGSTOP) past its lease; attempt 2 runs and succeeds; attempt 1
    wakes up and tries to commit: its fencing token is stale, so its writes roll back."""
    worker = workers.start(concurrency=2)
    job = JobDefinition.objects.create(slug="fenced", task="testapp.atomic_effect", lease_seconds=3)
    execution = submit(job, kwargs={"gate": "stale"})
    row = poll(lambda: Execution.objects.filter(pk=execution.pk, state="RUNNING").first(), timeout=30, what="attempt 1")
    owner = parse_owner(row.worker)
    assert owner is not None
    pid = owner.pid
    assert pid in {c.pid for c in worker.pool_children()}
    os.kill(pid, signal.SIGSTOP)  # a long GC pause / a frozen VM
    try:

        def rescued() -> bool:
            run_rescuer()
            return "rescued" in event_kinds(execution.pk)

        poll(rescued, timeout=30, interval=0.25, what="lease expiry and rescue")
        open_gate("stale:2")
        poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=30, what="attempt 2 succeeds")
    finally:
        open_gate("stale:1")
        os.kill(pid, signal.SIGCONT)
    poll(lambda: "stale_write_rejected" in event_kinds(execution.pk), timeout=30, what="stale write refused")

    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts, row.fencing_token, row.result) == ("SUCCEEDED", 2, 2, {"token": 2})
    # Only the second attempt's write exists: the paused attempt's write was rolled back.
    assert list(Effect.objects.values_list("key", flat=True)) == [f"{execution.idempotency_key}#2"]
