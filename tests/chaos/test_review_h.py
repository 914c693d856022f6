"""Hostile review (review/h) of the changes since 5453a2c: real-worker repros.

Uses the PostgreSQL-aware proxy of ``tests/chaos/test_ledger_commit.py`` (scenario 14).
"""

from __future__ import annotations

import time

import pytest

from taskplatform import submit
from taskplatform.models import Execution
from tests.chaos.pgproxy import Cut
from tests.chaos.test_ledger_commit import FIRST_CLAIM, fired, lost, pg_proxy, raw_starts, row, settle, through
from tests.helpers import event_kinds

__all__ = ["pg_proxy"]  # the fixture, imported for this module's tests


@pytest.mark.scenario(14)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.timeout(180)
def test_an_in_doubt_claim_whose_retry_meets_the_outage_still_runs_its_body(pg_proxy, workers, poll, figures):
    """G1/G6: the in-doubt claim of scenario 14, as a partition makes it: the server committed
    the claim, the reply is lost, and the database is still unreachable when the worker
    retries. Found in review: the claim gave up after one retry and sent the message back;
    the redelivery, a new call with a new start mark, no longer recognised the attempt its own
    message had claimed and absorbed itself as a duplicate: the attempt expired unrun, counted
    as spent, and with no attempt to spare the execution was dead-lettered, its body never run.
    Now the claim is retried in place (same start mark) for up to the lease; when the database
    is back within it, the claim is adopted (through a renewal by the database's clock)."""
    execution = submit("testapp.effect")
    key = execution.idempotency_key
    Execution.objects.filter(pk=execution.pk).update(max_attempts=1)  # no attempt to spare
    in_doubt = pg_proxy.arm(Cut(FIRST_CLAIM, when="after"))  # committed; the reply is lost
    retry_cut = pg_proxy.arm(Cut(FIRST_CLAIM, when="outage"))  # the retry finds the database gone
    worker = workers.start(concurrency=1, env=through(pg_proxy, TASKPLATFORM_LEASE_SECONDS="20"))
    fired(poll, in_doubt, worker, pg_proxy)
    assert in_doubt.server_reply[:1] == ["C:SELECT 1"], f"the claim committed: {in_doubt.server_reply}"
    fired(poll, retry_cut, worker, pg_proxy)
    poll(lambda: worker.log().count("retrying the claim") >= 2, timeout=60, what="the worker retrying in place")
    pg_proxy.up()  # back within the lease
    back = time.monotonic()
    settle(
        poll, lambda: row(execution.pk).state in ("SUCCEEDED", "FAILED"), proxy=pg_proxy, worker=worker,
        what="a final state",
    )  # fmt: skip

    final = row(execution.pk)
    starts = raw_starts(key)
    kinds = event_kinds(execution.pk)
    figures.record(
        executions=1, body_starts=len(starts), lost=lost(final), recovery_s=time.monotonic() - back,
        attempts=final.attempts, duplicate_deliveries=kinds.count("duplicate_delivery"),
    )  # fmt: skip
    assert "goes back to the queue" not in worker.log()
    assert (final.state, final.attempts) == ("SUCCEEDED", 1), (
        f"{final.state}: {final.last_error} (events {kinds}, body starts {starts})"
    )
    assert starts == [1]


@pytest.mark.scenario(37)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.timeout(120)
def test_a_plain_call_whose_row_cannot_be_written_is_not_requeued_forever(workers, poll, figures):
    """G5 ("retries that converge") and scenario 37 (foreign content is refused and logged).
    Every ``DatabaseError`` of the claim sends the message back to the queue, a deterministic
    one too. A plain Celery call whose arguments PostgreSQL cannot store (a NUL in a JSON
    string: ``DataError``, jsonb has no \\u0000) fails the row's insert on every delivery and
    is requeued once a second per pool process, forever: never acknowledged, never recorded,
    never dead-lettered. (Plain calls were requeued on any DatabaseError before 5453a2c too;
    the change extends the rule, and no deterministic error is told apart.)"""
    from celery import current_app

    worker = workers.start(concurrency=1)
    current_app.send_task("testapp.effect", kwargs={"gate": "nul\x00"}, task_id="poison-1")
    after = submit("testapp.effect")  # behind it on the queue
    poll(lambda: row(after.pk).state == "SUCCEEDED", timeout=60, what="the worker to serve the next execution")
    # Observe for a while (an absence cannot be polled for): a message refused for good is
    # requeued at most once.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and worker.log().count("goes back to the queue") < 4:
        time.sleep(0.5)
    requeues = worker.log().count("goes back to the queue")
    figures.record(poison_messages=1, requeues=requeues)
    assert requeues <= 1, f"the message went back to the queue {requeues} times and is still looping"
