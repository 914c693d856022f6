"""Who may run, and when, decided by the database's clock: fences, due times, leases, budgets.

Marked ``portable`` like the rest of the ledger tests (PostgreSQL, SQLite, MariaDB), except
the PostgreSQL fast-path race, which only exists there.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from taskplatform.core import ledger
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import EventKind, Execution, ExecutionEvent, Trigger
from tests.helpers import race
from tests.ledger.test_ledger import claim, expire_lease, kinds, make_due, new, pass_due_time

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]


def deliver(execution: Execution, worker: str = "node-b:2", task_id: str = "t-2") -> ledger.Claim:
    """A message for ``execution`` reaches a worker (the fast path first on PostgreSQL)."""
    claimed = ledger.claim_message(
        ledger.Delivery(execution.pk, execution.task_name, [], {}, worker, task_id),
        default_lease_seconds=30,
        lease_seconds_for=lambda job: 30,
        max_attempts_for=lambda job: 3,
    )
    assert claimed is not None
    return claimed


def row(execution: Execution) -> Execution:
    return Execution.objects.get(pk=execution.pk)


# --- item 2: stopping a running attempt leaves a fence --------------------------------------


@pytest.mark.parametrize("stop", ["FAILED", "CANCELLED"])
def test_retry_now_of_a_stopped_running_attempt_waits_for_its_fence(stop: str) -> None:
    execution = new()
    first = claim(execution, lease=30)
    ledger.operator_transition(execution.pk, stop, user="op", reason="looks stuck", expected_state="RUNNING")
    fence = row(execution).lease_expires_at
    assert fence is not None and fence > timezone.now() + timedelta(seconds=20)  # kept, not cleared
    assert not ledger.renew_lease(execution.pk, first.token, 30)  # the stopped attempt cannot extend it

    ledger.operator_transition(execution.pk, "PENDING", user="op", reason="retry now", expected_state=stop)
    parked = row(execution)
    assert (parked.state, parked.attempts, parked.lease_expires_at) == ("PENDING", 0, fence)
    assert (parked.due_at, parked.publish_count) == (fence, 0)  # the rescuer publishes it at the fence
    assert run_rescuer().published == 0

    early = deliver(execution)  # a copy of the message, "retry now" clicked twice, ...
    assert early.outcome == "early"
    after = row(execution)
    assert (after.state, after.fencing_token, after.attempts) == ("PENDING", 1, 0)
    assert kinds(execution)[-1] == EventKind.EARLY_DELIVERY

    pass_due_time(execution)  # the fence's time has come
    assert run_rescuer().published == 1
    Execution.objects.filter(pk=execution.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    second = deliver(execution)
    assert second.outcome == "claimed" and second.token == 2


def test_cancelling_a_parked_retry_keeps_the_fence_for_the_next_retry_now() -> None:
    """Found in review: mark failed, retry now (parked), cancel, retry now again. The cancel of
    the parked row used to clear the fence, and the second retry ran a body at once beside the
    stopped attempt, which may run until its fence."""
    execution = new()
    claim(execution, lease=30)
    ledger.operator_transition(execution.pk, "FAILED", user="op", reason="looks stuck", expected_state="RUNNING")
    fence = row(execution).lease_expires_at
    ledger.operator_transition(execution.pk, "PENDING", user="op", reason="retry now", expected_state="FAILED")
    ledger.operator_transition(execution.pk, "CANCELLED", user="op", reason="not now", expected_state="PENDING")
    assert row(execution).lease_expires_at == fence
    again = ledger.operator_transition(execution.pk, "PENDING", user="op", reason="now", expected_state="CANCELLED")
    assert (again.due_at, again.publish_count) == (fence, 0)  # parked again, not published
    assert deliver(execution).outcome == "early"
    assert row(execution).state == "PENDING"


def test_retry_now_of_an_ordinary_dead_letter_is_published_at_once() -> None:
    execution = new()
    c = claim(execution, max_attempts=1)
    ledger.dead_letter(c.execution, c.token, error="E", traceback="", worker="w")
    ledger.operator_transition(execution.pk, "PENDING", user="op", reason="fixed", expected_state="FAILED")
    requeued = row(execution)
    assert requeued.lease_expires_at is None and requeued.publish_count == 1
    assert deliver(execution).outcome == "claimed"


# --- item 4: a retry is not claimed before its due time ---------------------------------------


def test_a_stray_delivery_before_a_retry_is_due_is_absorbed_and_the_retry_still_runs() -> None:
    execution = new()
    c = claim(execution)
    assert ledger.schedule_retry(c.execution, c.token, delay_seconds=30, error="E", traceback="", worker="w")
    waiting = row(execution)
    assert waiting.due_at > waiting.scheduled_for  # on the broker: due_at is only a republish check

    stray = claim(ledger.get(execution.pk), worker="node-b:2")
    assert stray.outcome == "early"
    after = row(execution)
    assert (after.state, after.attempts, after.fencing_token) == ("RETRYING", 1, 1)
    # Pulled in: should the turned-away message have been the real one, the rescuer runs it when due.
    assert after.due_at == after.scheduled_for
    assert run_rescuer().published == 0
    pass_due_time(execution)
    assert run_rescuer().published == 1
    assert kinds(execution) == [EventKind.CLAIMED, EventKind.RETRY_SCHEDULED, EventKind.EARLY_DELIVERY, "republished"]

    make_due(execution)
    assert claim(ledger.get(execution.pk)).outcome == "claimed"


def test_a_retry_due_within_the_clock_tolerance_is_claimed() -> None:
    execution = new()
    c = claim(execution)
    ledger.schedule_retry(c.execution, c.token, delay_seconds=0.5, error="E", traceback="", worker="w")
    assert timedelta(seconds=0.5) <= ledger.EARLY_TOLERANCE
    assert claim(ledger.get(execution.pk)).outcome == "claimed"


# --- item 5: leases are judged by the database's clock, in the statement ------------------------


def test_a_renewal_after_the_lease_expired_is_refused() -> None:
    execution = new()
    c = claim(execution)
    expire_lease(execution)
    assert not ledger.renew_lease(execution.pk, c.token, 30)
    assert row(execution).lease_expires_at < timezone.now()
    assert run_rescuer().rescued == 1


def stale_view(execution: Execution) -> Execution:
    """The row as a rescuer or a second worker saw it before the owner renewed its lease
    (or through a clock that runs ahead): expired."""
    seen = ledger.get(execution.pk)
    seen.lease_expires_at = timezone.now() - timedelta(seconds=5)
    return seen


def test_a_takeover_of_a_lease_renewed_meanwhile_is_refused() -> None:
    execution = new()
    claim(execution, worker="node-a:1", lease=30)
    assert ledger.renew_lease(execution.pk, 1, 30)
    taken = claim(stale_view(execution), worker="node-b:2")
    assert taken.outcome == "duplicate"
    kept = row(execution)
    assert (kept.state, kept.fencing_token, kept.worker) == ("RUNNING", 1, "node-a:1")


@pytest.mark.parametrize("max_attempts", [3, 1], ids=["rescue", "dead-letter"])
def test_a_rescue_of_a_lease_renewed_meanwhile_is_refused(max_attempts: int) -> None:
    execution = new()
    claim(execution, lease=30)
    assert ledger.renew_lease(execution.pk, 1, 30)
    outcome = ledger.rescue_expired(stale_view(execution), max_attempts=max_attempts, now=timezone.now())
    assert outcome == "skipped"
    kept = row(execution)
    assert (kept.state, kept.fencing_token) == ("RUNNING", 1)
    assert ledger.renew_lease(execution.pk, 1, 30)  # the owner still holds it


def test_renewal_and_rescue_racing_at_expiry_never_both_win() -> None:
    """Around the instant a lease expires, either the owner keeps it or the rescuer takes it."""
    for i in range(6):
        execution = new(f"edge-{i}")
        claim(execution, lease=30)
        edge = timezone.now() + timedelta(milliseconds=30)
        Execution.objects.filter(pk=execution.pk).update(lease_expires_at=edge)
        seen = stale_view(execution)

        def contender(n: int, start: Any, pk: int = execution.pk, seen: Execution = seen) -> tuple[str, Any]:
            start()
            if n == 0:
                return "renewed", ledger.renew_lease(pk, 1, 30)
            return "rescued", ledger.rescue_expired(seen, max_attempts=3, now=timezone.now()) == "rescued"

        results = dict(race(2, contender))
        assert not (results["renewed"] and results["rescued"]), results
        final = row(execution)
        assert final.state == ("RETRYING" if results["rescued"] else "RUNNING")


def test_a_worker_whose_clock_runs_behind_still_writes_a_live_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN: "ownership is decided by one clock". A worker an hour behind must not write a
    lease that is already expired for everyone else (its live body would be rescued)."""
    execution = new()
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(hours=1))
    assert claim(execution, lease=30).outcome == "claimed"
    assert ledger.renew_lease(execution.pk, 1, 30)
    monkeypatch.setattr(timezone, "now", real_now)
    assert row(execution).lease_expires_at > timezone.now() + timedelta(seconds=20)
    assert run_rescuer().rescued == 0


# --- item 10: an explicit retry(max_retries=N) is this execution's budget -----------------------


def test_an_explicit_attempts_budget_outlives_the_policy_at_claim_and_rescue() -> None:
    execution = new()
    c = claim(execution, max_attempts=1)
    ledger.schedule_retry(c.execution, c.token, delay_seconds=0, error="E", traceback="", worker="w", max_attempts=3)
    assert row(execution).max_attempts == 3
    second = claim(ledger.get(execution.pk), max_attempts=1)  # the policy alone says: exhausted
    assert second.outcome == "claimed" and second.execution.attempts == 2
    expire_lease(execution)
    # testapp.effect's policy allows 4; give the rescuer a policy of 1 to show the row wins.
    assert ledger.rescue_expired(ledger.get(execution.pk), max_attempts=1, now=timezone.now()) == "rescued"
    make_due(execution)
    third = claim(ledger.get(execution.pk), max_attempts=1)
    assert third.outcome == "claimed" and third.execution.attempts == 3
    expire_lease(execution)
    assert claim(ledger.get(execution.pk), max_attempts=1).outcome == "exhausted"
    assert "attempts exhausted: 3 of 3" in row(execution).last_error


def test_retry_now_gives_back_the_policy_budget() -> None:
    execution = new()
    c = claim(execution)
    ledger.schedule_retry(c.execution, c.token, delay_seconds=0, error="E", traceback="", worker="w", max_attempts=9)
    ledger.operator_transition(execution.pk, "PENDING", user="op", reason="run it now", expected_state="RETRYING")
    assert row(execution).max_attempts is None


# --- item 11: rows a worker creates for a plain .delay() get a due time ---------------------------


def test_a_row_created_for_a_plain_celery_message_is_republished_if_never_claimed() -> None:
    before = timezone.now()
    execution = ledger.ensure(
        ledger.NewExecution(
            idempotency_key="celery-task-id-1",
            task_name="testapp.effect",
            args=[],
            kwargs={},
            trigger=Trigger.CELERY,
            celery_task_id="celery-task-id-1",
            publish_count=1,
        )
    )
    created = row(execution)
    assert created.due_at is not None and created.due_at >= before + ledger.republish_interval(1)
    # The claim failed (database errors twice): the message is gone, the row is not.
    assert run_rescuer().published == 0
    pass_due_time(execution)
    assert run_rescuer().published == 1
    assert row(execution).publish_count == 2


# --- the PostgreSQL fast path under concurrency ----------------------------------------------------


def test_the_postgresql_fast_path_lets_exactly_one_of_many_concurrent_claims_win() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim exists on PostgreSQL only")
    execution = new("fast-race")

    def contender(i: int, start: Any) -> str:
        start()
        return deliver(execution, worker=f"node-{i}:{i}", task_id=f"t-{i}").outcome

    outcomes = race(8, contender)
    assert sorted(outcomes) == ["claimed"] + ["duplicate"] * 7
    claimed = row(execution)
    assert (claimed.attempts, claimed.fencing_token) == (1, 1)
    assert ExecutionEvent.objects.filter(execution=execution, kind=EventKind.CLAIMED).count() == 1

    # Once it succeeded, a burst of late copies is absorbed: none of them runs it again.
    ledger.succeed(ledger.get(execution.pk), 1, None, worker=claimed.worker, data={})
    assert sorted(race(8, contender)) == ["finished"] * 8
    assert row(execution).attempts == 1


def test_a_plain_calls_create_and_claim_lets_exactly_one_of_many_concurrent_deliveries_run() -> None:
    """``task.delay()``: the worker inserts the row already claimed. Copies of the same call
    racing on one key: one creates and claims it; every other finds the key and is absorbed by
    the portable claim (the live attempt's lease), none runs a second attempt."""
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement create-and-claim exists on PostgreSQL only")
    spec = ledger.NewExecution(
        idempotency_key="plain-race", task_name="testapp.effect", args=[1], kwargs={"a": 2}, trigger=Trigger.CELERY
    )

    def contender(i: int, start: Any) -> str:
        start()
        mark = timezone.now()
        worker, task_id = f"node-{i}:{i}", "t-plain"
        created = ledger.create_claimed(spec, worker=worker, celery_task_id=task_id, lease_seconds=60, started_at=mark)
        if created is not None:
            assert (created.execution.args, created.execution.kwargs, created.token) == ([1], {"a": 2}, 1)
            assert created.execution.started_at == mark
            return "created"
        existing = ledger.ensure(spec)
        return ledger.claim(
            existing, worker=worker, celery_task_id=task_id, lease_seconds=60, max_attempts=3, started_at=mark
        ).outcome

    outcomes = race(8, contender)
    assert sorted(outcomes) == ["created"] + ["duplicate"] * 7
    stored = Execution.objects.get(idempotency_key="plain-race")
    assert (stored.state, stored.attempts, stored.fencing_token, stored.args) == ("RUNNING", 1, 1, [1])
    assert stored.lease_expires_at is not None and stored.lease_expires_at > timezone.now()
    assert ExecutionEvent.objects.filter(execution=stored, kind=EventKind.CLAIMED).count() == 1


# --- review: MariaDB/MySQL sessions not set to UTC ----------------------------------------------


@pytest.mark.parametrize("zone", ["+02:00", "-05:00"])
def test_leases_and_due_times_ignore_the_session_time_zone_on_mariadb(zone: str) -> None:
    """Found in review: ``Now()`` on MariaDB is the session zone's wall time while Django stores
    UTC. A server set ahead of UTC wrote leases hours into the future (a crash not rescued, a
    parked retry claimable at once); one behind UTC made live leases look expired."""
    if connection.vendor != "mysql":
        pytest.skip("the session time zone is a MariaDB/MySQL matter")
    with connection.cursor() as cursor:
        cursor.execute("SET time_zone = %s", [zone])
    try:
        execution = new()
        first = claim(execution, lease=60)
        lease = row(execution).lease_expires_at
        assert lease is not None
        assert abs((lease - timezone.now()).total_seconds() - 60) < 10, f"lease written off by the zone: {lease}"
        other = ledger.claim(row(execution), worker="node-b:2", celery_task_id="t-2", lease_seconds=60, max_attempts=3)
        assert other.outcome == "duplicate"  # the live lease is live for everyone
        assert ledger.renew_lease(execution.pk, first.token, 60)

        ledger.schedule_retry(
            row(execution), first.token, delay_seconds=3600, error="e", traceback="", worker="node-a:1"
        )
        early = ledger.claim(row(execution), worker="node-b:2", celery_task_id="t-3", lease_seconds=60, max_attempts=3)
        assert early.outcome == "early"  # an hour's backoff is not skipped
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET time_zone = '+00:00'")
