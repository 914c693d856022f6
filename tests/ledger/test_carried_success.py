"""A claim that carries the previous attempt's success (``core/_pg.py: _carrying``).

A busy pool process parks each non-atomic body's success (``worker/recorder.py``) and its next
claim writes it in the same statement: one durable commit a task. The success keeps its own
compare-and-set (state and fencing token) and its event; it commits with the claim or not at
all; and the caller learns which (``FinishedAttempt.written``).
"""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection
from django.utils import timezone

from taskplatform.core import ledger
from taskplatform.core.types import Delivery, FinishedAttempt
from taskplatform.domain.states import State
from taskplatform.models import Execution, ExecutionEvent, Trigger
from tests.ledger.test_ledger import claim, new

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "node-a:1"


@pytest.fixture(autouse=True)
def _pg_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("claims carry successes on PostgreSQL only (ledger.carries_successes)")


def spec(key: str, **extra: object) -> ledger.NewExecution:
    return ledger.NewExecution(
        idempotency_key=key, task_name="testapp.effect", args=[1], kwargs={}, trigger=Trigger.CELERY,
        celery_task_id=f"t-{key}", publish_count=1, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def running(key: str) -> tuple[Execution, FinishedAttempt]:
    """A running first attempt and its success, not written yet."""
    execution = new(key)
    claim(execution)
    token = execution.pk + 40  # not the id: a statement that swapped the two would not match
    Execution.objects.filter(pk=execution.pk).update(fencing_token=token)
    attempt = FinishedAttempt(execution.pk, token, {"n": 1}, WORKER, {"duration_ms": 1.5}, timezone.now())
    return execution, attempt


def xmin(table: str, where: str, pk: int) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT xmin::text FROM {table} WHERE {where} = %s ORDER BY id DESC LIMIT 1", [pk])
        return str(cursor.fetchone()[0])


def test_a_plain_calls_claim_writes_the_success_it_carries_in_its_own_transaction() -> None:
    done, attempt = running("carried")
    claimed = ledger.create_claimed(
        spec("next"), worker=WORKER, celery_task_id="t-next", lease_seconds=60, started_at=timezone.now(),
        carried=attempt,
    )  # fmt: skip
    assert claimed is not None and attempt.written is True
    row = Execution.objects.get(pk=done.pk)
    assert row.state == State.SUCCEEDED and row.result == {"n": 1} and row.lease_expires_at is None
    assert row.finished_at == attempt.finished_at
    event = ExecutionEvent.objects.filter(execution_id=done.pk).order_by("id").last()
    assert event is not None and event.kind == "succeeded" and event.data == {"duration_ms": 1.5}
    assert event.actor == WORKER and event.fencing_token == attempt.token
    assert Execution.objects.get(pk=claimed.execution.pk).state == State.RUNNING
    # One transaction: the success's row and event, the new row and its claim event.
    execution_table, event_table = Execution._meta.db_table, ExecutionEvent._meta.db_table
    assert xmin(execution_table, "id", done.pk) == xmin(execution_table, "id", claimed.execution.pk)
    assert xmin(event_table, "execution_id", done.pk) == xmin(event_table, "execution_id", claimed.execution.pk)


def test_a_first_attempt_claim_of_a_submitted_execution_writes_the_success_it_carries() -> None:
    done, attempt = running("carried")
    pending = ledger.ensure(spec("submitted"))
    delivery = Delivery(pending.pk, "testapp.effect", [1], {}, WORKER, "t-submitted")
    claimed = ledger.claim_message(
        delivery, default_lease_seconds=60, lease_seconds_for=lambda job: 60, max_attempts_for=lambda job: 3,
        carried=attempt,
    )  # fmt: skip
    assert claimed is not None and claimed.outcome == "claimed" and attempt.written is True
    assert Execution.objects.get(pk=done.pk).state == State.SUCCEEDED
    assert Execution.objects.get(pk=pending.pk).state == State.RUNNING


def test_a_stale_carried_success_is_refused_and_the_claim_is_still_made() -> None:
    """The carried success keeps its fencing: an attempt whose execution was taken over
    meanwhile (a new token) writes nothing, and says so; the claim it rode with stands."""
    done, attempt = running("taken-over")
    Execution.objects.filter(pk=done.pk).update(fencing_token=attempt.token + 1)  # another attempt's now
    claimed = ledger.create_claimed(
        spec("next"), worker=WORKER, celery_task_id="t-next", lease_seconds=60, started_at=timezone.now(),
        carried=attempt,
    )  # fmt: skip
    assert claimed is not None and attempt.written is False
    row = Execution.objects.get(pk=done.pk)
    assert row.state == State.RUNNING and row.result is None
    assert not ExecutionEvent.objects.filter(execution_id=done.pk, kind="succeeded").exists()


def test_a_carried_success_is_written_when_the_claim_finds_its_key_taken() -> None:
    """A redelivery of a plain call whose row exists: the one statement inserts nothing (the
    portable claim decides next) but the success it carried is written."""
    done, attempt = running("carried")
    ledger.ensure(spec("existing"))
    claimed = ledger.create_claimed(
        spec("existing"), worker=WORKER, celery_task_id="t-x", lease_seconds=60, started_at=timezone.now(),
        carried=attempt,
    )  # fmt: skip
    assert claimed is None and attempt.written is True
    assert Execution.objects.get(pk=done.pk).state == State.SUCCEEDED


def test_a_claim_that_fails_takes_the_success_it_carried_down_with_it() -> None:
    """The database refuses the new row (a negative priority): nothing of the statement
    commits, the success included, and ``written`` stays None, so the worker writes it
    itself (``SuccessRecorder.settle``)."""
    done, attempt = running("carried")
    with pytest.raises(IntegrityError):
        ledger.create_claimed(
            spec("refused", priority=-1), worker=WORKER, celery_task_id="t-r", lease_seconds=60,
            started_at=timezone.now(), carried=attempt,
        )  # fmt: skip
    assert attempt.written is None
    assert Execution.objects.get(pk=done.pk).state == State.RUNNING
    assert not Execution.objects.filter(idempotency_key="refused").exists()
    ledger.succeed(ledger.get(done.pk), attempt.token, attempt.result, worker=WORKER, data=attempt.data)
    assert Execution.objects.get(pk=done.pk).state == State.SUCCEEDED


def test_a_claim_does_not_wait_for_another_transactions_lock_on_the_carried_row() -> None:
    """An operator's transaction (or a body's ``select_for_update``) holds the finished
    attempt's row: the claim goes ahead at once without the success (``written`` None, the
    recorder thread writes it, waiting as it may), so the new lease is not spent waiting."""
    from django.db import connections

    done, attempt = running("locked")
    locker = connections.create_connection("default")
    try:
        locker.set_autocommit(False)
        with locker.cursor() as cursor:
            cursor.execute(f"SELECT id FROM {Execution._meta.db_table} WHERE id = %s FOR UPDATE", [done.pk])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '5s'")  # a wait, if there were one, fails the test
        claimed = ledger.create_claimed(
            spec("next"), worker=WORKER, celery_task_id="t-next", lease_seconds=60, started_at=timezone.now(),
            carried=attempt,
        )  # fmt: skip
        assert claimed is not None and attempt.written is None
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = 0")
        locker.rollback()
        locker.close()
    assert Execution.objects.get(pk=done.pk).state == State.RUNNING
    assert Execution.objects.get(pk=claimed.execution.pk).state == State.RUNNING


def test_a_result_postgresql_would_refuse_is_not_stored_so_it_cannot_fail_a_claim() -> None:
    """A NUL character or a lone surrogate in a result: jsonb refuses both, and the statement
    carrying that success would fail the next execution's claim with it. The result is not
    stored (with a note), as an oversized one is not."""
    from taskplatform.core.validation import encode_result

    for poison in ("a\x00b", {"k": [b"\xff".decode("utf-8", "surrogateescape")]}):
        stored, why_not = encode_result(poison, copy=True)
        assert stored is None and why_not and "not stored" in why_not
    assert encode_result("\U0001f600 \\u0000") == ("\U0001f600 \\u0000", None)  # a pair, an escaped backslash
    done, attempt = running("poisoned")
    attempt.result, attempt.data = encode_result("a\x00b")  # type: ignore[assignment]
    attempt.data = {"note": str(attempt.data)}
    claimed = ledger.create_claimed(
        spec("next"), worker=WORKER, celery_task_id="t-next", lease_seconds=60, started_at=timezone.now(),
        carried=attempt,
    )  # fmt: skip
    assert claimed is not None and attempt.written is True
    assert Execution.objects.get(pk=done.pk).state == State.SUCCEEDED


def test_a_claim_whose_carried_success_is_refused_is_made_again_alone_and_the_success_written_apart(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's side of a refused carrying statement (``IdempotentTask._claim``): the
    database refuses what the parked success carries (here a NUL in its event's data), so the
    claim is made again without it, the delivery is not failed, and the success goes to the
    recorder thread, whose own write records it."""
    import logging
    from types import SimpleNamespace

    from taskplatform.worker import recorder as recorder_module
    from taskplatform.worker.recorder import Parked, success_recorder
    from tests.testapp.tasks import effect

    # The claim, not the recorder thread's deadline, must be what takes the parked success.
    monkeypatch.setattr(recorder_module, "RIDE_SECONDS", 60.0)
    done, good = running("refused-carry")
    poisoned = FinishedAttempt(good.execution_id, good.token, good.result, WORKER, {"note": "a\x00b"}, good.finished_at)

    def write() -> None:  # the recorder thread's own write, as the worker's would be
        try:
            ledger.succeed(ledger.get(done.pk), good.token, good.result, worker=WORKER, data=good.data)
        finally:
            connection.close()  # the thread's own connection, so the test database can be dropped

    recorder = success_recorder()
    recorder.park(Parked(poisoned, write, lambda written: None, None))
    try:
        request = SimpleNamespace(headers={}, id="t-alone", delivery_info={}, replaced_task_nesting=0)
        with caplog.at_level(logging.WARNING, logger="taskplatform.tasks"):
            claim = effect._claim(request, WORKER, (1,), {}, timezone.now())
        assert any("claiming alone" in record.getMessage() for record in caplog.records), caplog.text
        assert claim is not None and claim.outcome == "claimed"
        assert Execution.objects.get(pk=claim.execution.pk).state == State.RUNNING
        assert poisoned.written is None  # the carrying statement was rolled back
    finally:
        assert recorder.flush(timeout=10)  # nothing of this test's left for the next one
    row = Execution.objects.get(pk=done.pk)
    assert row.state == State.SUCCEEDED and row.worker == WORKER


def test_a_redelivery_of_the_execution_whose_success_it_carries_finds_it_succeeded() -> None:
    """The next message of a pool process is a second delivery of the execution it just
    finished (a redelivery, a republication): the one statement writes the success and claims
    nothing (the row is not a first attempt's), and the claim that follows, alone, sees the
    row succeeded and absorbs the delivery. No second body runs."""
    done, attempt = running("redelivered")
    token_before = Execution.objects.get(pk=done.pk).fencing_token
    delivery = Delivery(done.pk, "testapp.effect", [1], {}, WORKER, "t-again")
    claimed = ledger.claim_message(
        delivery, default_lease_seconds=60, lease_seconds_for=lambda job: 60, max_attempts_for=lambda job: 3,
        owner_alive=lambda worker: True, carried=attempt,
    )  # fmt: skip
    assert attempt.written is True
    assert claimed is not None and claimed.outcome == "finished"
    row = Execution.objects.get(pk=done.pk)
    assert row.state == State.SUCCEEDED and row.fencing_token == token_before and row.attempts == 1
    assert ExecutionEvent.objects.filter(execution_id=done.pk, kind="already_finished").exists()


def test_a_late_soft_time_limit_during_a_carried_successs_settlement_does_not_fail_the_next_claim(
    monkeypatch,
) -> None:
    """Settling a carried success runs inside the next task's claim, after it committed. A soft
    time limit raised there is the finished task's (its timer raced its end; the next task's
    started a millisecond ago): re-raised, it stranded the claimed execution, RUNNING with no
    owner until its lease ran out (and dead-lettered unrun on a last attempt). The claim returns
    and the body runs; the finished attempt's lease is let go."""
    from celery.exceptions import SoftTimeLimitExceeded

    from taskplatform.core import leases
    from taskplatform.worker.recorder import Parked, success_recorder
    from tests.testapp.tasks import effect

    execution, attempt = running("soft-limit")
    stale = FinishedAttempt(execution.pk, attempt.token + 1, None, WORKER, {"duration_ms": 1.0}, timezone.now())
    watch = leases.lease_keeper().watch(execution.pk, stale.token, 60, WORKER)

    def limit_fires_here(*_args: object, **_kwargs: object) -> bool:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(ledger, "record_stale_write", limit_fires_here)
    finish = effect._carried_success(execution, stale.token, WORKER, watch)
    success_recorder().park(Parked(stale, lambda: None, finish, watch))
    request = type("Request", (), {"headers": {}, "delivery_info": {}, "id": "t-soft-next", "hostname": "node-a"})()
    try:
        claim = effect._claim(request, WORKER, (7,), {}, timezone.now())
    finally:
        success_recorder().flush(timeout=10)
    assert claim is not None and claim.outcome == "claimed"
    assert stale.written is False  # the stale success was refused by the claim's statement
    assert watch not in leases.lease_keeper()._watches
