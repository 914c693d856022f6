"""Hostile review (review/h) of the changes since 5453a2c: ledger-level repros.

Each test states the guarantee it defends and fails on the code as reviewed.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from taskplatform.core import ledger
from taskplatform.core.rescuer import run_rescuer
from taskplatform.core.types import Delivery
from taskplatform.exceptions import StaleExecutionError
from taskplatform.models import EventKind, Execution, UtcNow
from tests.helpers import wait_for
from tests.ledger.test_ledger import claim, expire_lease, kinds, new

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]

OWNER = "w1@host:4242:x.1:17"


def deliver(execution: Execution, mark, *, worker: str = OWNER, task_id: str = "task-1", lease: int = 60):
    """One delivery of a message for ``execution`` claiming with start mark ``mark``."""
    return ledger.claim_message(
        Delivery(execution.pk, "testapp.effect", [], {}, worker, task_id),
        default_lease_seconds=lease,
        lease_seconds_for=lambda job: lease,
        max_attempts_for=lambda job: 3,
        started_at=mark,
    )


def live_by_db_clock(execution: Execution, token: int, at_least: timedelta = timedelta(0)) -> bool:
    from django.db.models import DateTimeField, DurationField, ExpressionWrapper, Value

    bound = ExpressionWrapper(UtcNow() + Value(at_least, output_field=DurationField()), output_field=DateTimeField())
    return Execution.objects.filter(
        pk=execution.pk, state="RUNNING", fencing_token=token, lease_expires_at__gt=bound
    ).exists()


def test_an_in_doubt_claim_is_not_adopted_on_a_lease_the_database_says_has_expired(monkeypatch):
    """G2 (and "ownership is decided by one clock"). ``_own_claim`` adopts the committed claim
    after comparing its lease with the *worker's* clock, and writes nothing. A worker whose
    clock runs 90 s behind retries its in-doubt claim after the lease ran out by the database's
    clock: it is told "claimed" and runs the body; the rescuer (database clock) re-queues the
    same attempt and another worker claims it: two bodies at once for one execution."""
    execution = new("own-claim-expired")
    mark = timezone.now()
    assert deliver(execution, mark).outcome == "claimed"  # committed; its reply was lost
    expire_lease(execution)  # the retry comes after the lease ran out (database clock)

    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(seconds=90))
    again = deliver(execution, mark)  # the same delivery, retrying on a fresh connection
    monkeypatch.setattr(timezone, "now", real_now)

    rescued = run_rescuer().rescued
    other = deliver(execution, timezone.now(), worker="w2@other:7:y.2:5", task_id="task-2")
    running = [c.token for c in (again, other) if c.outcome == "claimed"]
    assert len(running) <= 1, (
        f"two attempts told to run their body at once (tokens {running}); rescued={rescued}; "
        "the in-doubt claim was adopted on a lease already expired by the database's clock"
    )


def test_an_in_doubt_claim_adopted_late_holds_the_lease_its_worker_will_renew_from():
    """G2. The adopted claim reports ``lease_seconds`` (60) and the lease keeper starts its
    watch now, first renewal after a third of that (20 s). But the row's lease was set when the
    claim committed: if the reply was detected lost late (keepalives: ~11 s; a short job lease),
    the row's lease may end in a second. Until the first renewal nothing extends it, the
    rescuer re-queues the attempt while its body runs, and another worker runs it too."""
    execution = new("own-claim-late")
    mark = timezone.now()
    first = deliver(execution, mark, lease=60)
    assert first.outcome == "claimed"
    # 59 of the lease's 60 s went by before the retry re-read the row.
    Execution.objects.filter(pk=execution.pk).update(lease_expires_at=timezone.now() + timedelta(seconds=1))

    again = deliver(execution, mark, lease=60)
    assert again.outcome == "claimed"
    first_renewal = timedelta(seconds=again.lease_seconds / 3)
    assert live_by_db_clock(execution, again.token, at_least=first_renewal), (
        "the adopted attempt's lease ends before its lease keeper's first renewal: the rescuer may "
        "re-queue it while its body runs"
    )


def test_a_rescuer_whose_clock_runs_behind_rescues_an_expired_lease_on_time(monkeypatch):
    """G6 and ``run_rescuer``'s own promise ("a rescuer host whose clock is off neither acts
    early nor late"; ``now`` "only stamps the events"). The selection uses the database's clock,
    but ``rescue_expired`` then skips every row whose lease is later than the *host's* ``now``:
    a beat leader 10 minutes behind rescues crashed work 10 minutes late."""
    execution = new("late-rescue")
    claim(execution, lease=30)
    expire_lease(execution)  # the worker died; its lease ran out a second ago (database clock)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(minutes=10))
    report = run_rescuer()
    monkeypatch.setattr(timezone, "now", real_now)
    assert report.rescued == 1, "the expired attempt was not rescued: the host's clock decided"


def test_a_stopped_attempts_refused_success_is_audited_even_when_an_operator_marked_it_done():
    """G7. ``record_stale_write`` now skips the audit when the row is SUCCEEDED under the
    attempt's token, taking that for the attempt's own in-doubt success. An operator's
    "mark failed" then "mark done" leaves exactly that (operator transitions keep the token):
    the stopped attempt's late success is refused but not audited, and the worker logs that its
    own success "was recorded already" and returns the result as a success."""
    execution = new("operator-done")
    attempt = claim(execution, lease=30)
    ledger.operator_transition(execution.pk, "FAILED", user="op", reason="stuck", expected_state="RUNNING")
    ledger.operator_transition(execution.pk, "SUCCEEDED", user="op", reason="done by hand", expected_state="FAILED")
    with pytest.raises(StaleExecutionError):
        ledger.succeed(execution, attempt.token, {"late": True}, worker="node-a:1", data={})
    audited = ledger.record_stale_write(execution.pk, attempt.token, worker="node-a:1", what="succeed")
    assert audited, "a refused write-back of a stopped attempt was taken for its own in-doubt success"
    assert EventKind.STALE_WRITE_REJECTED in kinds(execution)


def test_the_late_adoption_really_lets_a_second_body_start():
    """The consequence of the test above, end to end at the ledger: the row's lease ends a
    second after the adoption, the rescuer re-queues it and another delivery claims it while
    the adopting delivery still believes it has 60 s."""
    execution = new("own-claim-late-double")
    mark = timezone.now()
    assert deliver(execution, mark, lease=60).outcome == "claimed"
    Execution.objects.filter(pk=execution.pk).update(lease_expires_at=timezone.now() + timedelta(seconds=1))
    again = deliver(execution, mark, lease=60)
    if again.outcome == "claimed" and not live_by_db_clock(execution, again.token, timedelta(seconds=5)):
        wait_for(lambda: not live_by_db_clock(execution, again.token), timeout=10, interval=0.1, what="lease end")
    rescued = run_rescuer().rescued
    other = deliver(execution, timezone.now(), worker="w2@other:7:y.2:5", task_id="task-2")
    running = [c.token for c in (again, other) if c.outcome == "claimed"]
    assert len(running) <= 1, f"two attempts running at once (tokens {running}, rescued={rescued})"
