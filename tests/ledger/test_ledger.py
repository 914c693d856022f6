"""The ledger's claim and transition protocol, against a real database.

These tests are marked ``portable``: ``make test`` runs them on PostgreSQL, SQLite and
MariaDB. The compare-and-set claim must hold on all three, including under real
concurrent connections.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from taskplatform.core import ledger
from taskplatform.core.rescuer import run_rescuer
from taskplatform.domain.states import State
from taskplatform.exceptions import IllegalTransitionError, LedgerError, StaleExecutionError
from taskplatform.models import EventKind, Execution, ExecutionEvent
from tests.helpers import race

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]


def new(key: str = "k1", **kw) -> Execution:
    execution, created = ledger.create(
        ledger.NewExecution(idempotency_key=key, task_name="testapp.effect", args=[], kwargs={}, **kw)
    )
    assert created
    return execution


def claim(execution: Execution, worker: str = "node-a:1", *, max_attempts: int = 3, lease: int = 30, alive=None):
    return ledger.claim(
        execution,
        worker=worker,
        celery_task_id="t-1",
        lease_seconds=lease,
        max_attempts=max_attempts,
        owner_alive=alive or (lambda w: None),
    )


def kinds(execution: Execution) -> list[str]:
    return list(ExecutionEvent.objects.filter(execution=execution).values_list("kind", flat=True))


def expire_lease(execution: Execution) -> None:
    """Test set-up: the owner stopped renewing long ago."""
    Execution.objects.filter(pk=execution.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def pass_due_time(execution: Execution) -> None:
    """Test set-up: the row's republish time has come by the database's clock (the rescuer
    compares ``due_at`` with the database's clock, so time is moved in the row, not the caller)."""
    Execution.objects.filter(pk=execution.pk).update(due_at=timezone.now() - timedelta(seconds=1))


def make_due(execution: Execution) -> None:
    """Test set-up: the retry's due time has come."""
    Execution.objects.filter(pk=execution.pk).update(scheduled_for=timezone.now() - timedelta(seconds=1))


def test_the_same_key_creates_one_row():
    first = new("same")
    again, created = ledger.create(
        ledger.NewExecution(idempotency_key="same", task_name="testapp.effect", args=[], kwargs={})
    )
    assert not created and again.pk == first.pk
    assert Execution.objects.count() == 1


def test_claim_increments_attempts_and_fencing_token():
    execution = new()
    result = claim(execution)
    assert result.outcome == "claimed"
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts, row.fencing_token, row.worker) == ("RUNNING", 1, 1, "node-a:1")
    assert row.lease_expires_at > timezone.now()
    assert kinds(execution) == [EventKind.CLAIMED]


def test_a_second_delivery_while_the_lease_is_live_is_absorbed():
    execution = new()
    claim(execution)
    second = claim(ledger.get(execution.pk), worker="node-b:2")
    assert second.outcome == "duplicate"
    row = Execution.objects.get(pk=execution.pk)
    assert (row.attempts, row.fencing_token, row.worker) == (1, 1, "node-a:1")
    assert kinds(execution) == [EventKind.CLAIMED, EventKind.DUPLICATE_DELIVERY]


def test_a_finished_execution_is_never_claimed_again():
    execution = new()
    c = claim(execution)
    ledger.succeed(c.execution, c.token, {"ok": True}, worker="node-a:1", data={})
    again = claim(ledger.get(execution.pk), worker="node-b:2")
    assert again.outcome == "finished"
    assert again.execution.result == {"ok": True}
    assert Execution.objects.get(pk=execution.pk).attempts == 1


def test_only_one_of_many_concurrent_claims_wins():
    """Eight connections race to claim the same row: exactly one compare-and-set succeeds."""
    execution = new("race")

    def contender(i: int, start) -> str:
        loaded = ledger.get(execution.pk)  # every contender saw the row PENDING
        start()
        return claim(loaded, worker=f"node-{i}:{i}").outcome

    outcomes = race(8, contender)
    assert sorted(outcomes) == ["claimed"] + ["duplicate"] * 7
    row = Execution.objects.get(pk=execution.pk)
    assert (row.attempts, row.fencing_token) == (1, 1)
    assert kinds(execution).count(EventKind.CLAIMED) == 1


def test_an_expired_lease_is_taken_over_under_a_new_token_and_the_old_writer_is_refused():
    execution = new()
    first = claim(execution, worker="node-a:1")
    expire_lease(execution)
    second = claim(ledger.get(execution.pk), worker="node-b:2")
    assert second.outcome == "claimed" and second.token == 2
    with pytest.raises(StaleExecutionError):
        ledger.succeed(first.execution, 1, {"from": "stale"}, worker="node-a:1", data={})
    ledger.succeed(second.execution, 2, {"from": "new"}, worker="node-b:2", data={})
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.result, row.attempts) == ("SUCCEEDED", {"from": "new"}, 2)
    assert EventKind.TAKEN_OVER in kinds(execution)


def test_a_dead_owner_on_the_same_node_is_taken_over_before_its_lease_expires():
    execution = new()
    claim(execution, worker="node-a:1")
    taken = claim(ledger.get(execution.pk), worker="node-a:2", alive=lambda w: False)
    assert taken.outcome == "claimed" and taken.execution.attempts == 2


def test_a_stale_attempt_cannot_renew_its_lease():
    execution = new()
    claim(execution)
    assert ledger.renew_lease(execution.pk, 1, 30)
    expire_lease(execution)
    claim(ledger.get(execution.pk), worker="node-b:2")
    assert not ledger.renew_lease(execution.pk, 1, 30)


def test_attempts_exhausted_at_claim_dead_letters():
    execution = new()
    claim(execution, max_attempts=1)
    expire_lease(execution)
    result = claim(ledger.get(execution.pk), worker="node-b:2", max_attempts=1)
    assert result.outcome == "exhausted"
    row = Execution.objects.get(pk=execution.pk)
    assert row.state == "FAILED" and "attempts exhausted: 1 of 1" in row.last_error


def test_retry_then_dead_letter_record_errors_and_tracebacks():
    execution = new()
    c = claim(execution)
    assert ledger.schedule_retry(c.execution, c.token, delay_seconds=5, error="E: boom", traceback="tb1", worker="w")
    row = Execution.objects.get(pk=execution.pk)
    assert row.state == "RETRYING" and row.publish_count == 1 and row.scheduled_for > timezone.now()
    make_due(execution)
    c2 = claim(ledger.get(execution.pk))
    assert ledger.dead_letter(c2.execution, c2.token, error="E: boom again", traceback="tb2", worker="w")
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.last_error, row.last_traceback) == ("FAILED", "E: boom again", "tb2")
    assert kinds(execution) == ["claimed", "retry_scheduled", "claimed", "dead_lettered"]


def test_long_retry_delays_are_parked_in_the_ledger_not_published():
    execution = new()
    c = claim(execution)
    ledger.schedule_retry(c.execution, c.token, delay_seconds=3600, error="E", traceback="", worker="w")
    row = Execution.objects.get(pk=execution.pk)
    assert row.state == "RETRYING" and row.publish_count == 0 and row.celery_task_id == "t-1"
    assert row.due_at == row.scheduled_for
    assert run_rescuer().published == 0  # not due yet
    pass_due_time(row)
    assert run_rescuer().published == 1
    row.refresh_from_db()
    assert row.publish_count == 1 and row.celery_task_id != "t-1"


def test_rescuer_requeues_an_expired_lease_and_dead_letters_when_exhausted():
    a, b = new("a"), new("b")
    claim(a)
    claim(b)
    expire_lease(a)
    expire_lease(b)
    # testapp.effect allows max_retries + 1 = 4 attempts; b has used them all.
    Execution.objects.filter(pk=b.pk).update(attempts=4)
    report = run_rescuer()
    assert (report.rescued, report.dead_lettered) == (1, 1)
    a.refresh_from_db()
    b.refresh_from_db()
    assert a.state == "RETRYING" and a.publish_count == 1
    assert "lease expired" in ExecutionEvent.objects.get(execution=a, kind="rescued").reason
    assert b.state == "FAILED" and "attempts exhausted: 4 of 4" in b.last_error


def test_rescuer_republishes_unclaimed_rows_with_doubling_intervals():
    execution = new(due_at=timezone.now() - timedelta(seconds=1), publish_count=1)
    now = timezone.now()
    assert run_rescuer().published == 1
    execution.refresh_from_db()
    first_gap = execution.due_at - now
    assert run_rescuer().published == 0  # the next check is not due yet
    pass_due_time(execution)
    now = timezone.now()
    assert run_rescuer().published == 1
    execution.refresh_from_db()
    assert execution.publish_count == 3
    assert execution.due_at - now >= first_gap * 2 - timedelta(seconds=1)


def test_operator_transition_is_audited_and_the_same_form_twice_acts_once():
    execution = new()
    c = claim(execution, max_attempts=1)
    ledger.dead_letter(c.execution, c.token, error="E", traceback="", worker="w")
    ledger.operator_transition(execution.pk, "PENDING", user="alice", reason="fixed upstream", expected_state="FAILED")
    with pytest.raises(IllegalTransitionError, match="is PENDING now, not FAILED"):
        ledger.operator_transition(
            execution.pk, "PENDING", user="alice", reason="fixed upstream", expected_state="FAILED"
        )
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts) == ("PENDING", 0)
    event = ExecutionEvent.objects.get(execution=execution, kind="operator")
    assert (event.actor, event.reason, event.data) == ("alice", "fixed upstream", {"action": "retry_now"})


def test_illegal_operator_transition_changes_nothing():
    execution = new()
    claim(execution)
    before = Execution.objects.get(pk=execution.pk)
    with pytest.raises(IllegalTransitionError, match="RUNNING → PENDING is not a legal transition"):
        ledger.operator_transition(execution.pk, "PENDING", user="bob", reason="please")
    after = Execution.objects.get(pk=execution.pk)
    assert (after.state, after.fencing_token, after.updated_at) == (
        before.state,
        before.fencing_token,
        before.updated_at,
    )
    assert kinds(execution) == ["claimed"]


def test_operator_action_needs_a_reason():
    execution = new()
    with pytest.raises(LedgerError, match="reason is required"):
        ledger.operator_transition(execution.pk, "CANCELLED", user="bob", reason="  ")
    assert Execution.objects.get(pk=execution.pk).state == State.PENDING


def test_cancel_while_running_refuses_the_late_write_back():
    execution = new()
    c = claim(execution)
    ledger.operator_transition(execution.pk, "CANCELLED", user="carol", reason="wrong customer")
    with pytest.raises(StaleExecutionError):
        ledger.succeed(c.execution, c.token, None, worker="w", data={})
    assert Execution.objects.get(pk=execution.pk).state == "CANCELLED"


def test_a_takeover_read_before_the_owner_succeeded_never_reopens_the_execution():
    """The taker read the row RUNNING with an expired lease; the slow owner then succeeded (the
    token does not change on success). The takeover's compare-and-set must fail on the state,
    not run a succeeded execution again."""
    execution = new("late-success")
    first = claim(execution, lease=30)
    expire_lease(execution)
    seen = Execution.objects.get(pk=execution.pk)  # the taker's read: RUNNING, lease expired
    ledger.succeed(first.execution, first.token, {"ok": True}, worker="node-a:1", data={})
    second = claim(seen, worker="node-b:2")
    assert second.outcome == "finished"
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts, row.fencing_token) == ("SUCCEEDED", 1, 1)


def test_a_rescue_read_before_the_owner_succeeded_never_reopens_the_execution():
    execution = new("late-success-rescue")
    first = claim(execution, lease=30)
    expire_lease(execution)
    seen = Execution.objects.select_related("job").get(pk=execution.pk)  # the rescuer's read
    ledger.succeed(first.execution, first.token, None, worker="node-a:1", data={})
    assert ledger.rescue_expired(seen, max_attempts=3, now=timezone.now()) == "skipped"
    assert Execution.objects.get(pk=execution.pk).state == "SUCCEEDED"
