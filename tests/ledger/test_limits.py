"""The ledger's side of fleet-wide limits: waiting, waking, superseded messages, bad limits.

Marked ``portable``: the same on PostgreSQL, SQLite and MariaDB. The real-worker behaviour
(never more than N at once, a crashed holder's slot freed) is in
``tests/integration/test_limits.py``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from taskplatform.core import ledger
from taskplatform.core.rescuer import run_rescuer
from taskplatform.domain.states import Actor, State, find_transition
from taskplatform.jobs import define_job
from taskplatform.models import Execution, ExecutionEvent, Limit
from taskplatform.worker import limits

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]


def new(key: str, task: str = "testapp.limited", job=None) -> Execution:
    execution, _ = ledger.create(
        ledger.NewExecution(idempotency_key=key, task_name=task, args=[], kwargs={}, job=job, celery_task_id="m-0")
    )
    return execution


def claim(execution: Execution, message: str = "m-0") -> ledger.Claim:
    return ledger.claim(execution, worker="node:1", celery_task_id=message, lease_seconds=30, max_attempts=3)


#: The id of the limit the ledger-only tests' rows wait on (a waiting row names its limit; no
#: ``Limit`` row is needed for the ledger's side).
LIMIT_ID = 7


def wait(c: ledger.Claim, delay: float = 5.0, limit_id: int = LIMIT_ID) -> Execution:
    assert ledger.wait_for_limit(
        c.execution,
        c.token,
        delay_seconds=delay,
        worker="node:1",
        reason="full",
        data={"limit": "task:x"},
        limit_id=limit_id,
    )
    return Execution.objects.get(pk=c.execution.pk)


def kinds(execution: Execution) -> list[str]:
    return list(ExecutionEvent.objects.filter(execution=execution).order_by("id").values_list("kind", flat=True))


def test_a_wait_gives_the_claim_back_uncounted_and_publishes_a_countdown_message():
    execution = new("w1")
    c = claim(execution)
    assert c.outcome == "claimed" and c.execution.attempts == 1
    row = wait(c)
    assert row.state == State.WAITING and row.attempts == 0 and row.fencing_token == 1
    assert row.lease_expires_at is None and row.due_at > timezone.now()
    assert row.publish_count == 1 and row.celery_task_id not in ("", "m-0")
    assert kinds(row) == ["claimed", "waiting_for_limit"]
    again = claim(row, row.celery_task_id)
    assert again.outcome == "claimed" and again.execution.attempts == 1 and again.token == 2


def test_a_wait_from_a_stale_attempt_changes_nothing():
    c = claim(new("w2"))
    assert not ledger.wait_for_limit(
        c.execution, c.token - 1, delay_seconds=1, worker="x", reason="", data={}, limit_id=LIMIT_ID
    )
    assert Execution.objects.get(pk=c.execution.pk).state == State.RUNNING


def test_a_long_wait_is_parked_in_the_ledger_and_published_by_the_rescuer_when_due():
    row = wait(claim(new("w3")), delay=3600)
    assert row.publish_count == 0 and row.celery_task_id == ""
    assert run_rescuer().published == 0
    Execution.objects.filter(pk=row.pk).update(due_at=timezone.now() - timedelta(seconds=1))
    assert run_rescuer().published == 1
    row.refresh_from_db()
    assert row.state == State.WAITING and row.celery_task_id != ""
    assert claim(row, row.celery_task_id).outcome == "claimed"


def test_only_the_current_message_claims_a_waiting_row():
    """A wake replaced the row's countdown message: the old one, arriving later, is absorbed,
    so a row that waits many times keeps one message in flight."""
    row = wait(claim(new("w4")))
    old = row.celery_task_id
    assert ledger.wake_waiter(LIMIT_ID, actor="node:2", reason="a slot freed")
    row.refresh_from_db()
    assert row.celery_task_id != old and row.publish_count == 2
    stale = claim(row, old)
    assert stale.outcome == "superseded"
    assert Execution.objects.get(pk=row.pk).state == State.WAITING
    assert claim(row, row.celery_task_id).outcome == "claimed"
    assert kinds(row) == ["claimed", "waiting_for_limit", "woken", "superseded_delivery", "claimed"]


def test_a_wake_takes_the_longest_waiting_row_refused_by_that_limit_only():
    """Rows of one task can wait on the task's limit or on their job's: a freed slot of one
    wakes the oldest waiter of that one, even when an older row waits on the other."""
    job, _ = define_job("limited-job", task="testapp.limited")
    of_job = wait(claim(new("w7", job=job)), limit_id=LIMIT_ID + 1)
    first, second = wait(claim(new("w5"))), wait(claim(new("w6")))
    before = {e.pk: e.publish_count for e in (first, second, of_job)}
    assert ledger.wake_waiter(LIMIT_ID, actor="n", reason="")
    counts = dict(Execution.objects.filter(pk__in=before).values_list("pk", "publish_count"))
    assert counts == {first.pk: before[first.pk] + 1, second.pk: before[second.pk], of_job.pk: before[of_job.pk]}
    assert ledger.wake_waiter(LIMIT_ID + 1, actor="n", reason="")
    assert Execution.objects.get(pk=of_job.pk).publish_count == before[of_job.pk] + 1
    assert not ledger.wake_waiter(LIMIT_ID + 2, actor="n", reason="")


def test_an_operator_can_cancel_a_waiting_execution():
    row = wait(claim(new("w8")))
    assert find_transition(State.WAITING, State.CANCELLED, Actor.OPERATOR).name == "cancel"
    ledger.operator_transition(row.pk, State.CANCELLED, user="ops", reason="downstream retired")
    row.refresh_from_db()
    assert row.state == State.CANCELLED
    assert claim(row, row.celery_task_id).outcome == "finished"


def test_a_waiting_row_counts_as_overdue_once_past_its_due_time():
    row = wait(claim(new("w9")))
    assert not Execution.objects.stuck().filter(pk=row.pk).exists()
    Execution.objects.filter(pk=row.pk).update(due_at=timezone.now() - timedelta(seconds=1))
    assert Execution.objects.stuck().filter(pk=row.pk).exists()


# --- the worker's slots, on the locmem twin ------------------------------------------------------


@pytest.fixture
def locmem(settings):
    settings.TASKPLATFORM_LOCK_BACKENDS = {"default": {"BACKEND": "taskplatform.backends.locmem.LocMemLockBackend"}}
    limits.rules.reset()
    yield
    limits.rules.reset()


def test_slots_run_out_at_the_limit_and_a_release_wakes_a_waiter(locmem):
    Limit.objects.create(task_name="testapp.limited", concurrency=2)
    limits.rules.reset()
    running = [claim(new(f"s{i}")) for i in range(3)]
    rules = limits.rules_for(running[0].execution)
    assert [r.concurrency for r in rules] == [2]
    held = [limits.acquire(rules, c.execution, lease_seconds=30, worker="n") for c in running]
    assert isinstance(held[0], limits.Held) and isinstance(held[1], limits.Held)
    refusal = held[2]
    assert isinstance(refusal, limits.Refusal) and refusal.kind == "concurrency"
    assert 15 <= refusal.delay_seconds <= 22.5, "a backstop of at most 15 s, jittered: a wake may be lost"
    assert limits.wait(running[2].execution, running[2].token, refusal, worker="n")
    limits.release(held[0], worker="n")
    woken = Execution.objects.get(pk=running[2].execution.pk)
    assert woken.publish_count == 2 and "woken" in kinds(woken)
    third = claim(woken, woken.celery_task_id)
    assert isinstance(limits.acquire(rules, third.execution, lease_seconds=30, worker="n"), limits.Held)


def test_a_rate_limit_refuses_the_next_start_in_its_window(locmem):
    Limit.objects.create(task_name="testapp.limited", rate=2, per_seconds=60)
    limits.rules.reset()
    cs = [claim(new(f"r{i}")) for i in range(3)]
    rules = limits.rules_for(cs[0].execution)
    first, second, third = (limits.acquire(rules, c.execution, lease_seconds=30, worker="n") for c in cs)
    assert isinstance(first, limits.Held) and not first.leases, "a start slot is not held: it just runs out"
    assert isinstance(second, limits.Held)
    assert isinstance(third, limits.Refusal) and third.kind == "rate"
    assert 0 < third.delay_seconds <= 60 * 2, "spread over the time the waiting rows take to drain"


def test_a_start_slot_outlives_its_window_by_the_margin(locmem, monkeypatch):
    """A body starts a little after its start slot is granted, not always equally late: the
    slot is held its window plus ``RATE_MARGIN_SECONDS``, so starts a window apart by the
    backend's clock stay a window apart as the bodies see them. A fake clock for the locmem
    twin makes the instants exact."""
    from taskplatform.backends import locmem as locmem_module

    now = [1000.0]
    monkeypatch.setattr(locmem_module.time, "monotonic", lambda: now[0])
    Limit.objects.create(task_name="testapp.limited", rate=1, per_seconds=1)
    limits.rules.reset()
    a, b, c = (claim(new(f"m{i}")) for i in range(3))
    rules = limits.rules_for(a.execution)
    assert isinstance(limits.acquire(rules, a.execution, lease_seconds=30, worker="n"), limits.Held)
    now[0] += 1.0  # exactly one window later: still the margin to go
    assert isinstance(limits.acquire(rules, b.execution, lease_seconds=30, worker="n"), limits.Refusal)
    now[0] += limits.RATE_MARGIN_SECONDS + 0.001
    assert isinstance(limits.acquire(rules, c.execution, lease_seconds=30, worker="n"), limits.Held)


def test_an_unreachable_lock_backend_makes_the_execution_wait(settings):
    """A limit protects a downstream: when its slots cannot be counted, nothing starts."""
    settings.TASKPLATFORM_LOCK_BACKENDS = {
        "default": {"BACKEND": "taskplatform.backends.db.DatabaseLockBackend"},
        "down": {
            "BACKEND": "taskplatform.backends.redis.RedisLockBackend",
            "OPTIONS": {"url": "redis://127.0.0.1:1/0", "socket_timeout": 0.2},
        },
    }
    Limit.objects.create(task_name="testapp.limited", concurrency=5, backend="down")
    limits.rules.reset()
    c = claim(new("u1"))
    refusal = limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=30, worker="n")
    assert isinstance(refusal, limits.Refusal) and refusal.kind == "unavailable"
    limits.rules.reset()


def test_a_refusal_gives_back_the_slots_already_taken(locmem):
    """A task limit with room and a job limit that is full: the task slot is not kept."""
    job, _ = define_job("limited-job-2", task="testapp.limited")
    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    Limit.objects.create(job=job, rate=1, per_seconds=60)
    limits.rules.reset()
    a, b = claim(new("g1", job=job)), claim(new("g2", job=job))
    rules = limits.rules_for(a.execution)
    assert [r.scope for r in rules] == ["task:testapp.limited", f"job:{job.pk}"]
    held = limits.acquire(rules, a.execution, lease_seconds=30, worker="n")
    assert isinstance(held, limits.Held)
    limits.release(held, worker="n")
    refused = limits.acquire(rules, b.execution, lease_seconds=30, worker="n")
    assert isinstance(refused, limits.Refusal) and refused.kind == "rate"
    # The task's one concurrency slot is free again: another execution of the task takes it.
    other = claim(new("g3"))
    assert isinstance(limits.acquire(limits.rules_for(other.execution), other.execution, lease_seconds=30,
                                     worker="n"), limits.Held)  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"concurrency": 2}, "task_name", "either a task name or a job"),
        ({"task_name": "testapp.limited"}, "concurrency", "a concurrency limit, a rate limit, or both"),
        ({"task_name": "testapp.limited", "concurrency": 0}, "concurrency", "between 1 and"),
        ({"task_name": "testapp.limited", "rate": 5000}, "rate", "between 1 and"),
        ({"task_name": "testapp.limited", "rate": 5, "per_seconds": 0}, "per_seconds", "between 1 and 86400"),
        ({"task_name": "testapp.no_such_task", "concurrency": 2}, "task_name", "unknown task"),
        ({"task_name": "testapp.plain", "concurrency": 2}, "task_name", "IdempotentTask"),
        ({"task_name": "testapp.limited", "concurrency": 2, "backend": "nowhere"}, "backend", "no lock backend"),
    ],
)
def test_a_bad_limit_is_refused_with_its_field_named_and_nothing_saved(fields, field, message):
    with pytest.raises(ValidationError) as caught:
        limits.save_limit(Limit(**fields), user="ops")
    assert message in " ".join(caught.value.message_dict[field])
    assert not Limit.objects.exists()


def test_a_limit_on_both_a_task_and_a_job_is_refused():
    job, _ = define_job("limited-job-3", task="testapp.limited")
    with pytest.raises(ValidationError, match="either a task name or a job"):
        limits.save_limit(Limit(task_name="testapp.limited", job=job, concurrency=1), user="ops")


def test_saving_a_limit_is_audited():
    from taskplatform.models import OperatorAction

    limits.save_limit(Limit(task_name="testapp.limited", concurrency=3), user="ops", reason="gateway")
    action = OperatorAction.objects.get()
    assert (action.user, action.action, action.target) == ("ops", "add_limit", "limit:task:testapp.limited")


def test_the_admin_form_names_the_bad_field_and_saves_a_good_limit_audited(admin_client):
    from taskplatform.models import OperatorAction

    url = "/admin/taskplatform/limit/add/"
    base = {"task_name": "testapp.limited", "per_seconds": "1", "backend": "default", "note": ""}
    bad = admin_client.post(url, {**base, "task_name": "testapp.nope", "concurrency": "2"})
    assert bad.status_code == 200 and "unknown task" in bad.content.decode()
    bad = admin_client.post(url, {**base, "backend": "nowhere", "concurrency": "2"})
    assert bad.status_code == 200 and "no lock backend" in bad.content.decode()
    assert not Limit.objects.exists()
    good = admin_client.post(url, {**base, "concurrency": "2", "rate": "10"})
    assert good.status_code == 302, good.content.decode()[:2000]
    limit = Limit.objects.get()
    assert (limit.scope, limit.concurrency, limit.rate) == ("task:testapp.limited", 2, 10)
    assert OperatorAction.objects.filter(action="add_limit", target="limit:task:testapp.limited").exists()
    page = admin_client.get("/admin/taskplatform/limit/").content.decode()
    assert "task:testapp.limited" in page


def test_a_second_limit_for_the_same_task_is_a_form_error_not_a_500(admin_client):
    Limit.objects.create(task_name="testapp.limited", concurrency=2)
    response = admin_client.post(
        "/admin/taskplatform/limit/add/",
        {"task_name": "testapp.limited", "concurrency": "3", "per_seconds": "1", "backend": "default", "note": ""},
    )
    assert response.status_code == 200 and "has a limit already" in response.content.decode()
    assert Limit.objects.count() == 1


def test_the_locks_page_shows_a_limit_on_a_removed_backend_alias_as_unreachable(admin_client):
    Limit.objects.create(task_name="testapp.limited", concurrency=2, backend="removed")
    page = admin_client.get("/admin/taskplatform/locklease/")
    assert page.status_code == 200 and "backend unreachable" in page.content.decode()


def test_a_limit_whose_backend_alias_was_removed_makes_executions_wait_not_fail(locmem):
    """Any error counting the slots fails closed (review of the limits): the alias was
    removed by a later deploy, and the claim left the row running, its attempt spent."""
    Limit.objects.create(task_name="testapp.limited", concurrency=2, backend="removed")
    limits.rules.reset()
    c = claim(new("x1"))
    refusal = limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=30, worker="n")
    assert isinstance(refusal, limits.Refusal) and refusal.kind == "unavailable"
    assert "ConfigurationError" in refusal.reason and 0 < refusal.delay_seconds <= 30


def test_two_slots_freed_together_wake_two_waiters_not_one_twice():
    first, second = wait(claim(new("t1"))), wait(claim(new("t2")))
    assert ledger.wake_waiter(LIMIT_ID, actor="n", reason="")
    assert ledger.wake_waiter(LIMIT_ID, actor="n", reason="")
    counts = dict(Execution.objects.filter(pk__in=[first.pk, second.pk]).values_list("pk", "publish_count"))
    assert counts == {first.pk: 2, second.pk: 2}, "each woken once"
    assert not ledger.wake_waiter(LIMIT_ID, actor="n", reason=""), "both are on their way"
    assert ledger.count_waiting(task_name="testapp.limited") == ledger.count_waiting(limit_id=LIMIT_ID) == 2


def test_a_body_does_not_start_when_its_lease_ran_out_while_the_slots_were_taken(locmem, monkeypatch):
    """Review of issue 15: the slots are taken after the claim and before the lease keeper
    watches the attempt; a lock server slow to answer (Redlock with a stalled node, many slot
    names) outlasted the lease, the rescuer re-queued the row, another attempt claimed it, and
    the first attempt's body still started: two bodies for one execution. The attempt now
    renews its lease once the running slots are taken and starts the body only if that
    succeeds."""
    from taskplatform.backends.locmem import LocMemLockBackend
    from tests.testapp.models import Span
    from tests.testapp.tasks import limited

    Limit.objects.create(task_name="testapp.limited", concurrency=5)
    limits.rules.reset()
    execution = new("slow-slots")
    real_acquire_any = LocMemLockBackend.acquire_any
    taken_over: list[int] = []

    def slow_acquire_any(self, names, ttl, identity=None):
        lease = real_acquire_any(self, names, ttl, identity)
        # Meanwhile the lease ran out, the rescuer re-queued the row and another worker claimed it.
        Execution.objects.filter(pk=execution.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
        row = Execution.objects.get(pk=execution.pk)
        assert ledger.rescue_expired(row, max_attempts=3, now=timezone.now()) == "rescued"
        row = Execution.objects.get(pk=execution.pk)
        taken_over.append(claim(row, row.celery_task_id).token)
        return lease

    monkeypatch.setattr(LocMemLockBackend, "acquire_any", slow_acquire_any)
    limited.apply(task_id="m-0", headers={"tp_execution": execution.pk})
    assert taken_over, "the scenario ran"
    assert Span.objects.filter(key="slow-slots").count() == 0, "the stale attempt's body started"
    row = Execution.objects.get(pk=execution.pk)
    assert row.state == State.RUNNING and row.fencing_token == taken_over[0], "the newer attempt keeps the row"
    assert "stale_write_rejected" in kinds(row)


def test_a_lease_that_ran_out_while_the_slots_were_taken_gives_the_claim_and_the_start_back(locmem, monkeypatch):
    """Review of issue 15 (round 3): when the lease ran out while the slots were taken and
    nobody had acted on the row yet, the body rightly did not start, but the row was left
    RUNNING for the rescuer, which spent the attempt (a dead letter "worker lost" for a body
    that never ran), and the rate limit's start slot was kept. The claim is now given back
    uncounted, the execution published again at once, and the start slot returned. Here the
    start slot itself is slow: it is taken after the lease's renewal, so its time is measured
    against the lease (a fake clock makes the instants exact)."""
    from taskplatform.backends.locmem import LocMemLockBackend
    from tests.testapp.models import Span
    from tests.testapp.tasks import limited

    Limit.objects.create(task_name="testapp.limited", rate=1, per_seconds=60)
    limits.rules.reset()
    execution = new("slow-start")
    real_acquire_any = LocMemLockBackend.acquire_any
    now = [1000.0]

    def slow_acquire_any(self, names, ttl, identity=None):
        lease = real_acquire_any(self, names, ttl, identity)
        now[0] += 30.0  # the lock server answered after the whole lease (the tests' lease is 6 s)
        return lease

    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(LocMemLockBackend, "acquire_any", slow_acquire_any)
    limited.apply(task_id="m-0", headers={"tp_execution": execution.pk})
    assert Span.objects.filter(key="slow-start").count() == 0
    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts) == (State.WAITING, 0), "the attempt was spent on a body that never ran"
    assert row.publish_count == execution.publish_count + 1 and row.celery_task_id != "m-0", "published again"
    monkeypatch.setattr(LocMemLockBackend, "acquire_any", real_acquire_any)
    again = claim(row, row.celery_task_id)
    assert isinstance(
        limits.acquire(limits.rules_for(row), again.execution, lease_seconds=30, worker="n"), limits.Held
    ), "the start slot of the start that did not happen was kept"


def test_the_concurrency_backstop_of_a_long_queue_keeps_the_claims_few(locmem):
    """Review of issue 15: every waiter came back every 15 to 22 s whatever the backlog: with a
    slot held for a minute, 100 waiters made 302 claims and 302 wait events in 50 s. The
    backstops are now spread over a window that grows with the queue, so together they come at
    about the same pace as for one waiter (a wake still comes at once when a slot frees)."""
    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    limits.rules.reset()
    holder = claim(new("holder"))
    rules = limits.rules_for(holder.execution)
    assert isinstance(limits.acquire(rules, holder.execution, lease_seconds=60, worker="n"), limits.Held)
    delays = []
    for i in range(100):
        c = claim(new(f"queued-{i}"))
        refusal = limits.acquire(rules, c.execution, lease_seconds=60, worker="n")
        assert isinstance(refusal, limits.Refusal) and refusal.kind == "concurrency"
        assert limits.wait(c.execution, c.token, refusal, worker="n")
        delays.append(refusal.delay_seconds)
    assert min(delays) >= 15
    # The pace of their backstop claims, once the queue is long: one a waiter per its delay.
    late = delays[50:]
    claims_per_second = sum(1 / d for d in late)
    assert claims_per_second < 0.5, f"{claims_per_second:.2f} backstop claims a second for 50 waiters"


def test_a_limit_its_backend_could_never_grant_is_refused(settings):
    """Review of issue 15: a rate window (or a lease) longer than Redlock's ``max_ttl_seconds``
    was accepted, and then every acquire failed and every execution of the task waited for
    good. Nothing here talks to the nodes: building the backend reads its options only."""
    from taskplatform.backends import get_lock_backend

    urls = [f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)]  # never contacted
    settings.TASKPLATFORM_LOCK_BACKENDS = {
        "default": {"BACKEND": "taskplatform.backends.db.DatabaseLockBackend"},
        "quorum": {"BACKEND": "taskplatform.backends.redlock.RedlockLockBackend",
                   "OPTIONS": {"urls": urls, "max_ttl_seconds": 30}},
    }  # fmt: skip
    get_lock_backend.cache_clear()
    try:
        with pytest.raises(ValidationError) as caught:
            limits.save_limit(Limit(task_name="testapp.limited", rate=100, per_seconds=60, backend="quorum"), user="o")
        assert "max_ttl_seconds=30" in " ".join(caught.value.message_dict["per_seconds"])
        job, _ = define_job("long-lease", task="testapp.limited", lease_seconds=45)  # the tests' lease is 6 s
        with pytest.raises(ValidationError) as caught:
            limits.save_limit(Limit(job=job, concurrency=2, backend="quorum"), user="o")
        assert "lease (45 s)" in " ".join(caught.value.message_dict["concurrency"])
        with pytest.raises(ValidationError) as caught:  # a task's limit bounds its jobs: their leases count
            limits.save_limit(Limit(task_name="testapp.limited", concurrency=2, backend="quorum"), user="o")
        assert "lease (45 s)" in " ".join(caught.value.message_dict["concurrency"])
        limits.save_limit(Limit(task_name="testapp.limited", rate=100, per_seconds=10, backend="quorum"), user="o")
        assert Limit.objects.count() == 1
    finally:
        get_lock_backend.cache_clear()


# --- review 15, round 4 ---------------------------------------------------------------------------


def _free_slot_taken_by_another(execution_key: str = "after") -> bool:
    """Whether another execution of the task can take a slot of its limit now."""
    other = claim(new(execution_key))
    got = limits.acquire(limits.rules_for(other.execution), other.execution, lease_seconds=30, worker="n")
    return isinstance(got, limits.Held)


def test_a_lease_renewal_that_fails_after_the_slots_were_taken_gives_them_back(locmem, monkeypatch):
    """Review 15 (round 4): the renewal of the lease after the slots were taken raised (the
    database went away): the task raised, but its slot stayed with the slot keeper, renewed for
    as long as the worker lived, and a limit of 1 let nothing of the task run again."""
    from django.db import OperationalError

    from tests.testapp.models import Span
    from tests.testapp.tasks import limited

    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    limits.rules.reset()
    execution = new("renewal-fails")

    def database_gone(execution_id, token, lease_seconds, **kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(ledger, "renew_lease", database_gone)
    with pytest.raises(OperationalError):
        limited.apply(task_id="m-0", headers={"tp_execution": execution.pk}, throw=True)
    monkeypatch.undo()
    assert Span.objects.filter(key="renewal-fails").count() == 0, "the body started without its lease renewed"
    assert _free_slot_taken_by_another(), "the slot of an attempt that never started its body was kept"


def test_a_lease_renewal_on_a_stale_connection_is_retried_and_the_body_runs(locmem, monkeypatch):
    """The renewal after the slots is retried once on a fresh connection, like the worker's
    other writes: a connection the server closed while idle does not cost the attempt."""
    from django.db import OperationalError

    from tests.testapp.models import Span
    from tests.testapp.tasks import limited

    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    limits.rules.reset()
    execution = new("renewal-blip")
    real = ledger.renew_lease
    failures = [OperationalError("server closed the connection unexpectedly")]

    def blip_once(execution_id, token, lease_seconds, **kwargs):
        if failures:
            raise failures.pop()
        return real(execution_id, token, lease_seconds, **kwargs)

    monkeypatch.setattr(ledger, "renew_lease", blip_once)
    limited.apply(task_id="m-0", headers={"tp_execution": execution.pk}, throw=True)
    monkeypatch.undo()
    assert Span.objects.filter(key="renewal-blip").count() == 1
    assert Execution.objects.get(pk=execution.pk).state == State.SUCCEEDED
    assert _free_slot_taken_by_another(), "the slot was released with the body"


def test_an_error_between_the_slots_and_the_body_gives_the_slots_back(locmem, monkeypatch):
    """Anything raised after the slots were granted and before the body's own error handling
    (here the lease keeper cannot start its thread) gives the slots back."""
    from taskplatform.core import leases
    from tests.testapp.models import Span
    from tests.testapp.tasks import limited

    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    limits.rules.reset()
    execution = new("watch-fails")

    def no_thread(self, *args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(leases.LeaseKeeper, "watch", no_thread)
    with pytest.raises(RuntimeError):
        limited.apply(task_id="m-0", headers={"tp_execution": execution.pk}, throw=True)
    monkeypatch.undo()
    assert Span.objects.filter(key="watch-fails").count() == 0
    assert _free_slot_taken_by_another()


def test_the_wait_for_an_unreachable_lock_backend_doubles_with_each_wait_in_a_row(settings):
    """Review 15 (round 4): the docs said the backoff doubles with each wait, but every wait
    reset the count it was computed from, so a backlog cycled through claims every 2.5 to 10 s
    for the whole outage. Each wait now counts (``limit_backoffs``): 5 s doubling, up to the
    lease, jittered down to half; a wait for a full limit starts the count again."""
    settings.TASKPLATFORM_LOCK_BACKENDS = {
        "default": {"BACKEND": "taskplatform.backends.db.DatabaseLockBackend"},
        "down": {
            "BACKEND": "taskplatform.backends.redis.RedisLockBackend",
            "OPTIONS": {"url": "redis://127.0.0.1:1/0", "socket_timeout": 0.2},
        },
    }
    Limit.objects.create(task_name="testapp.limited", concurrency=5, backend="down")
    limits.rules.reset()
    row = new("down-long")
    lease = 300
    for n in range(8):
        c = claim(row, row.celery_task_id)
        assert c.outcome == "claimed"
        refusal = limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=lease, worker="n")
        assert isinstance(refusal, limits.Refusal) and refusal.kind == "unavailable"
        ceiling = min(lease, limits.BACKEND_DOWN_WAIT_SECONDS * 2**n)
        assert ceiling / 2 <= refusal.delay_seconds <= ceiling, f"wait {n + 1}: {refusal.delay_seconds:.1f} s"
        assert limits.wait(c.execution, c.token, refusal, worker="n")
        row = Execution.objects.get(pk=row.pk)
        assert row.limit_backoffs == n + 1
    limits.rules.reset()
    # The backend is back and the limit full: the count starts again.
    c = claim(row, row.celery_task_id)
    full = limits.Refusal(limits.rules_for(c.execution)[0], "concurrency", 15.0, "full")
    assert limits.wait(c.execution, c.token, full, worker="n")
    assert Execution.objects.get(pk=row.pk).limit_backoffs == 0
    limits.rules.reset()


def test_a_freed_slot_wakes_a_waiter_of_its_own_limit_not_an_older_one_waiting_on_its_job_limit(locmem):
    """Review 15 (round 4): wakes went to the oldest waiting row of the task, which could be
    waiting on its job's limit: it took the task's slot, was refused by its job's limit again
    and gave the slot back, so every wake of the task's limit was lost and its waiters ran only
    on their backstops. A waiting row now names the limit that refused it."""
    job, _ = define_job("one-at-a-time", task="testapp.limited")
    task_limit = Limit.objects.create(task_name="testapp.limited", concurrency=2)
    job_limit = Limit.objects.create(job=job, concurrency=1)
    limits.rules.reset()

    def acquire(c):
        return limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=30, worker="n")

    assert isinstance(acquire(claim(new("job-holder", job=job))), limits.Held)  # task 1/2, job 1/1
    of_job = claim(new("of-job", job=job))  # the older waiter
    refused = acquire(of_job)
    assert isinstance(refused, limits.Refusal) and refused.rule.id == job_limit.pk
    assert limits.wait(of_job.execution, of_job.token, refused, worker="n")
    plain_holder = acquire(claim(new("plain-holder")))  # task 2/2
    assert isinstance(plain_holder, limits.Held)
    plain = claim(new("plain"))
    refused = acquire(plain)
    assert isinstance(refused, limits.Refusal) and refused.rule.id == task_limit.pk
    assert limits.wait(plain.execution, plain.token, refused, worker="n")

    limits.release(plain_holder, worker="n")  # a task slot frees
    assert "woken" in kinds(plain.execution), "the waiter of the task's limit was not woken"
    assert "woken" not in kinds(of_job.execution), "the wake went to a row its job's limit refuses"
    assert ledger.count_waiting(limit_id=task_limit.pk) == ledger.count_waiting(limit_id=job_limit.pk) == 1


def test_a_slot_given_back_by_a_refused_start_wakes_a_waiter_of_its_limit(locmem):
    """Review 15 (round 4): an execution that took the task's slot and was then refused by its
    job's limit gave the task's slot back without waking anyone: a row refused by the task's
    limit meanwhile (the slot was taken then) waited for its backstop with the slot free."""
    job, _ = define_job("once-a-minute", task="testapp.limited")
    task_limit = Limit.objects.create(task_name="testapp.limited", concurrency=1)
    Limit.objects.create(job=job, rate=1, per_seconds=60)
    limits.rules.reset()

    def acquire(c, **kwargs):
        return limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=30, worker="n", **kwargs)

    first = acquire(claim(new("job-first", job=job)))
    assert isinstance(first, limits.Held)
    limits.release(first, worker="n")  # its body ran: the job's one start this minute is spent
    plain = claim(new("plain-2"))

    def meanwhile() -> bool:
        # Between the job row's task slot and its start slot, a plain row finds the task full.
        refusal = acquire(plain)
        assert isinstance(refusal, limits.Refusal) and refusal.rule.id == task_limit.pk
        return limits.wait(plain.execution, plain.token, refusal, worker="n")

    refused = acquire(claim(new("job-second", job=job)), confirm=meanwhile)
    assert isinstance(refused, limits.Refusal) and refused.kind == "rate"
    assert "waiting_for_limit" in kinds(plain.execution), "the scenario ran"
    assert "woken" in kinds(plain.execution), "the task's slot was given back and its waiter left waiting"


@pytest.mark.parametrize("slow", ["another limit's slot", "the lease renewal"])
def test_a_start_slot_is_taken_last_so_a_slow_step_before_it_does_not_shorten_the_window(locmem, monkeypatch, slow):
    """Review 15 (round 4): the task's start slot was taken before the job's running slot and
    before the lease renewal; when that took 0.4 s (Redlock with a node that does not answer),
    the body started 0.4 s after its start slot was counted, and two bodies started 0.65 s
    apart under a rate of 1 a second. Start slots are now taken last. A fake clock for the
    locmem twin makes the instants exact."""
    from taskplatform.backends import locmem as locmem_module
    from taskplatform.backends.locmem import LocMemLockBackend

    now = [1000.0]
    monkeypatch.setattr(locmem_module.time, "monotonic", lambda: now[0])
    job, _ = define_job("rate-and-slow-slot", task="testapp.limited")
    Limit.objects.create(task_name="testapp.limited", rate=1, per_seconds=1)
    Limit.objects.create(job=job, concurrency=5)
    limits.rules.reset()
    slow_once = [0.4]
    real_acquire_any = LocMemLockBackend.acquire_any

    def slow_running_slot(self, names, ttl, identity=None):
        if slow == "another limit's slot" and ":running:" in names[0] and slow_once:
            now[0] += slow_once.pop()
        return real_acquire_any(self, names, ttl, identity)

    def renewal() -> bool:
        if slow == "the lease renewal" and slow_once:
            now[0] += slow_once.pop()
        return True

    monkeypatch.setattr(LocMemLockBackend, "acquire_any", slow_running_slot)
    starts = []
    for key in ("first", "second"):
        c = claim(new(key, job=job))
        for _attempt in range(1000):  # a try every 10 ms of the fake clock: 10 s at most
            got = limits.acquire(
                limits.rules_for(c.execution), c.execution, lease_seconds=30, worker="n", confirm=renewal
            )
            if isinstance(got, limits.Held):
                break
            now[0] += 0.01
        assert isinstance(got, limits.Held)
        starts.append(now[0])  # the body starts now
        limits.release(got, worker="n")
    assert starts[1] - starts[0] >= 1.0, f"two starts {starts[1] - starts[0]:.2f} s apart under 1 a second"


# -- Review of issue 15, round 5 ---------------------------------------------------------------


def test_a_running_slot_is_first_renewed_a_third_of_its_ttl_after_its_grant_not_after_the_other_slots(
    locmem, monkeypatch
):
    """A task limit of 1 and a job limit whose lock server answers after 45 s of a 60 s TTL:
    the keeper's first renewal of the task slot was counted from ``hold()`` (20 s later), after
    the slot had lapsed, and a second body of a limit of 1 started."""
    from taskplatform.backends import locmem as locmem_module
    from taskplatform.backends.locmem import LocMemLockBackend

    clock = [1000.0]  # the lock backend's and the keeper's monotonic clock, moved by the test
    monkeypatch.setattr(locmem_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(limits.time, "monotonic", lambda: clock[0])
    job, _ = define_job("two-limits", task="testapp.limited")
    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    job_limit = Limit.objects.create(job=job, concurrency=5)
    limits.rules.reset()
    real = LocMemLockBackend.acquire_any

    def slow_job_slot(self, names, ttl, identity=None):
        lease = real(self, names, ttl, identity)
        if names and names[0].startswith(f"limit:{job_limit.pk}:running"):
            clock[0] += 45.0  # the job limit's lock server answered after 45 s
        return lease

    monkeypatch.setattr(LocMemLockBackend, "acquire_any", slow_job_slot)
    first = claim(new("first", job=job))
    held = limits.acquire(limits.rules_for(first.execution), first.execution, lease_seconds=60, worker="n",
                          confirm=lambda: True)  # fmt: skip
    assert isinstance(held, limits.Held)
    try:
        granted = min(lease.granted_at for _r, _b, lease in held.leases)
        due = limits.slot_keeper()._held[held]
        assert due <= granted + 20.0 + 1e-6, f"first renewal {due - granted:.0f} s after the grant of a 60 s slot"
    finally:
        limits.release(held, worker="n")


def test_a_slot_keeper_that_cannot_start_its_thread_gives_the_slots_back(locmem, monkeypatch):
    """``hold()`` ran outside ``acquire``'s give-back: a keeper thread that could not start left
    the slot registered, and the next ``hold()`` in the process renewed it for good (a limit
    of 1 never ran again). Now the error propagates with the slots given back."""
    import threading

    monkeypatch.setattr(limits, "_keeper", None)  # a fresh keeper, no thread yet
    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    limits.rules.reset()
    real_start = threading.Thread.start

    def cannot_start(self):
        if self.name == "taskplatform-limit-slots":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    first = claim(new("cannot-keep"))
    with pytest.raises(RuntimeError):
        limits.acquire(limits.rules_for(first.execution), first.execution, lease_seconds=30, worker="n")
    assert not limits.slot_keeper()._held, "nothing left for the keeper to renew"
    monkeypatch.setattr(threading.Thread, "start", real_start)
    probe = claim(new("probe"))
    got = limits.acquire(limits.rules_for(probe.execution), probe.execution, lease_seconds=30, worker="n")
    assert isinstance(got, limits.Held), "the slot of the attempt that never started is free"
    limits.release(got, worker="n")


def test_the_lease_keeper_counts_a_limited_attempts_lease_from_the_renewal_before_its_start_slots(locmem, monkeypatch):
    """The lease is renewed before the start slots, which may take up to half of it: the watch
    counted from its own creation, so ``lease_lost`` came up to half a lease late."""
    from taskplatform.backends.locmem import LocMemLockBackend
    from taskplatform.core import leases
    from tests.testapp.tasks import limited

    Limit.objects.create(task_name="testapp.limited", rate=100, per_seconds=1)
    limits.rules.reset()
    execution = new("late-watch")
    real_acquire = LocMemLockBackend.acquire_any
    real_renew = ledger.renew_lease
    renewals: list[float] = []

    def slow_start_slot(self, names, ttl, identity=None):
        if names and ":started:" in names[0]:
            time.sleep(1.5)  # the fault: a slow lock server (under half the tests' 6 s lease)
        return real_acquire(self, names, ttl, identity)

    def renew(execution_id, token, lease_seconds, **kwargs):
        renewals.append(time.monotonic())
        return real_renew(execution_id, token, lease_seconds, **kwargs)

    captured: list[leases.Watch] = []
    real_watch = leases.LeaseKeeper.watch

    def capture(self, *args, **kwargs):
        w = real_watch(self, *args, **kwargs)
        captured.append(w)
        return w

    monkeypatch.setattr(LocMemLockBackend, "acquire_any", slow_start_slot)
    monkeypatch.setattr(ledger, "renew_lease", renew)
    monkeypatch.setattr(leases.LeaseKeeper, "watch", capture)
    limited.apply(task_id="m-0", headers={"tp_execution": execution.pk})
    assert renewals and captured
    assert captured[0].renewed_at <= renewals[0], "the watch counts from before the renewal's request"
    assert Execution.objects.get(pk=execution.pk).state == State.SUCCEEDED


def test_the_back_off_count_starts_again_once_a_body_has_started(settings):
    """'Doubling with each such wait in a row': a start ends the row. The count was reset only
    by a wait for a full limit, so a later outage began at the ceiling, not at 5 s."""
    settings.TASKPLATFORM_LOCK_BACKENDS = {
        "default": {"BACKEND": "taskplatform.backends.locmem.LocMemLockBackend"},
        "down": {"BACKEND": "taskplatform.backends.redis.RedisLockBackend",
                 "OPTIONS": {"url": "redis://127.0.0.1:1/0", "socket_timeout": 0.2}},
    }  # fmt: skip
    limit = Limit.objects.create(task_name="testapp.limited", concurrency=5, backend="down")
    limits.rules.reset()
    row = new("backoff-again")
    for _ in range(4):  # an outage: four waits in a row
        c = ledger.claim(row, worker="n", celery_task_id=row.celery_task_id, lease_seconds=300, max_attempts=3)
        refusal = limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=300, worker="n")
        assert isinstance(refusal, limits.Refusal) and limits.wait(c.execution, c.token, refusal, worker="n")
        row = Execution.objects.get(pk=row.pk)
    assert row.limit_backoffs == 4
    Limit.objects.filter(pk=limit.pk).update(backend="default")  # the backend is back: the body starts
    limits.rules.reset()
    from tests.testapp.tasks import limited

    limited.apply(task_id=row.celery_task_id, headers={"tp_execution": row.pk})
    row = Execution.objects.get(pk=row.pk)
    assert row.state == State.SUCCEEDED and row.limit_backoffs == 0


def test_a_clean_failure_is_not_a_lost_lease_when_the_next_attempt_claimed_first():
    """The keeper's renewal, refused because the attempt had just recorded its own retry, was
    noted as a lost lease if the retry's next attempt had claimed the row meanwhile: a clean
    failure then made a flow's step 'in doubt' (compensated though it did nothing)."""
    row = new("clean-failure", task="testapp.effect")
    first = claim(row)
    retried = ledger.schedule_retry(
        first.execution, first.token, delay_seconds=0, error="x", traceback="", worker="node:1"
    )
    assert retried
    row = Execution.objects.get(pk=row.pk)
    second = claim(row, row.celery_task_id)
    assert second.outcome == "claimed"
    ledger.record_lease_lost(row.pk, first.token, "node:1")
    assert "lease_lost" not in kinds(row)
    # The second attempt's renewal refused while it runs: a lease lost, noted.
    ledger.record_lease_lost(row.pk, second.token, "node:1")
    assert kinds(row).count("lease_lost") == 1


@pytest.mark.parametrize("change", ["delete", "raise", "remove concurrency", "move", "queryset delete"])
def test_waiters_of_a_limit_deleted_or_loosened_are_published_once_the_workers_have_read_it(locmem, change):
    """Deleting a limit (or raising it) is how an operator lets a backlog through; its waiters
    waited for their backstops (15 s x waiters / limit: with 200 and a limit of 1, up to 50
    minutes). Now they are due within the workers' refresh of the limits."""
    from taskplatform.conf import platform_settings

    limit = Limit.objects.create(task_name="testapp.limited", concurrency=1, rate=100, per_seconds=1)
    limits.rules.reset()
    holder = claim(new("holder"))
    held = limits.acquire(limits.rules_for(holder.execution), holder.execution, lease_seconds=60, worker="n")
    assert isinstance(held, limits.Held)
    for i in range(50):
        c = claim(new(f"w{i}"))
        refusal = limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=60, worker="n")
        assert isinstance(refusal, limits.Refusal) and limits.wait(c.execution, c.token, refusal, worker="n")
    if change == "delete":
        limits.delete_limit(limit, user="ops", reason="let the backlog through")
    elif change == "queryset delete":  # as a cascade does (a job deleted with its limit)
        Limit.objects.filter(pk=limit.pk).delete()
    elif change == "move":  # to another task: this one is unlimited now
        limit.task_name = "testapp.limited_atomic"
        limits.save_limit(limit, user="ops", reason="the other task needs it")
    else:
        limit.concurrency = 10 if change == "raise" else None
        limits.save_limit(limit, user="ops", reason="let the backlog through")
    latest = max(Execution.objects.filter(state="WAITING").values_list("due_at", flat=True))
    within = platform_settings().limits_refresh_seconds + 1
    assert latest - timezone.now() <= timedelta(seconds=within + 2), f"{latest - timezone.now()} away"
    limits.release(held, worker="n")


def test_lowering_a_limit_leaves_its_waiters_where_they_are(locmem):
    limit = Limit.objects.create(task_name="testapp.limited", concurrency=2)
    limits.rules.reset()
    rows = [claim(new(f"low-{i}")) for i in range(3)]
    helds = [limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=60, worker="n") for c in rows]
    refusal = helds[-1]
    assert isinstance(refusal, limits.Refusal)
    assert limits.wait(rows[-1].execution, rows[-1].token, refusal, worker="n")
    before = Execution.objects.get(pk=rows[-1].execution.pk).due_at
    limit.concurrency = 1
    limits.save_limit(limit, user="ops", reason="the downstream is struggling")
    assert Execution.objects.get(pk=rows[-1].execution.pk).due_at == before
    for held in helds[:2]:
        limits.release(held, worker="n")


def test_a_waiting_row_that_names_no_limit_is_made_due_by_the_rescuer(monkeypatch):
    """Parked by a release before migration 0011 (or by one of its workers during a rolling
    deploy): no freed slot names it, and its backstop may be hours away."""
    from taskplatform.core import rescuer

    monkeypatch.setattr(rescuer, "_next_unnamed_recall", 0.0)  # MariaDB looks every 10 minutes
    c = claim(new("unnamed"))
    row = wait(c, delay=3600)
    Execution.objects.filter(pk=row.pk).update(waiting_on_limit=None)
    named = wait(claim(new("named")), delay=3600)
    run_rescuer()
    assert "republished" in kinds(row), "published by the rescuer's pass"
    assert "republished" not in kinds(named)
    assert Execution.objects.get(pk=named.pk).due_at > timezone.now() + timedelta(minutes=30)
    # Recalled once: the next pass leaves its message alone (review 7: recalled every pass,
    # each new message superseded the one on its way, and the row was never claimed).
    run_rescuer()
    assert kinds(row).count("republished") == 1
    assert Execution.objects.get(pk=row.pk).waiting_on_limit == ledger.RECALLED


def test_more_unnamed_waiters_than_a_batch_are_all_recalled_pass_after_pass(monkeypatch, settings):
    """Review 7: on MariaDB the look waited 10 minutes after every pass, a full batch included
    (30,000 rows parked by the previous release took 10 hours)."""
    from taskplatform.core import rescuer

    monkeypatch.setattr(rescuer, "_next_unnamed_recall", 0.0)
    settings.TASKPLATFORM_RESCUE_BATCH_SIZE = 5
    rows = [wait(claim(new(f"unnamed-{i}")), delay=3600) for i in range(7)]
    Execution.objects.filter(pk__in=[r.pk for r in rows]).update(waiting_on_limit=None)
    run_rescuer()
    run_rescuer()
    assert not Execution.objects.filter(pk__in=[r.pk for r in rows], waiting_on_limit__isnull=True).exists()


def test_the_waiters_of_a_jobs_limit_are_recalled_when_the_job_is_deleted(locmem):
    """Deleting a job deletes its limit by cascade, past ``delete_limit``: its waiters named a
    limit no slot of which would ever free again."""
    from taskplatform.jobs import delete_job

    job, _ = define_job("going", task="testapp.limited")
    Limit.objects.create(job=job, concurrency=1)
    limits.rules.reset()
    holder = claim(new("going-holder", job=job))
    held = limits.acquire(limits.rules_for(holder.execution), holder.execution, lease_seconds=60, worker="n")
    assert isinstance(held, limits.Held)
    c = claim(new("going-waiter", job=job))
    refusal = limits.acquire(limits.rules_for(c.execution), c.execution, lease_seconds=60, worker="n")
    assert isinstance(refusal, limits.Refusal)
    assert ledger.wait_for_limit(
        c.execution, c.token, delay_seconds=3600, worker="n", reason="full", data={}, limit_id=refusal.rule.id
    )
    delete_job(job, user="ops")
    due = Execution.objects.get(pk=c.execution.pk).due_at
    assert due - timezone.now() <= timedelta(seconds=10), f"{due - timezone.now()} away"
    limits.release(held, worker="n")


def test_no_statement_runs_between_a_start_slot_and_the_body(locmem):
    """A start slot counts from its grant and the rate's margin is 50 ms: a write between it
    and the body (the reset of a row's back-offs sat there) let two starts of a rate of one a
    second come 0.6 s apart when the database was slow. Here the row had backed off, so the
    reset happens, and the first statement after the slot's grant is the body's own."""
    from django.db import connection

    from taskplatform.backends.locmem import LocMemLockBackend
    from tests.testapp.tasks import limited

    Limit.objects.create(task_name="testapp.limited", rate=100, per_seconds=1)
    limits.rules.reset()
    execution = new("nothing-between")
    Execution.objects.filter(pk=execution.pk).update(limit_backoffs=3)
    events: list[tuple[str, str]] = []
    real_acquire = LocMemLockBackend.acquire_any

    def granted(self, names, ttl, identity=None):
        lease = real_acquire(self, names, ttl, identity)
        if names and ":started:" in names[0]:
            events.append(("start slot", ""))
        return lease

    def statements(execute, sql, params, many, context):
        events.append(("sql", sql))
        return execute(sql, params, many, context)

    LocMemLockBackend.acquire_any = granted  # type: ignore[method-assign]
    try:
        with connection.execute_wrapper(statements):
            limited.apply(task_id="m-0", headers={"tp_execution": execution.pk}, throw=True)
    finally:
        LocMemLockBackend.acquire_any = real_acquire  # type: ignore[method-assign]
    after = [sql for kind, sql in events[[kind for kind, _ in events].index("start slot") + 1 :] if kind == "sql"]
    assert after and "testapp_span" in after[0], f"first statement after the start slot: {after[:1]}"
    row = Execution.objects.get(pk=execution.pk)
    assert row.state == State.SUCCEEDED and row.limit_backoffs == 0
