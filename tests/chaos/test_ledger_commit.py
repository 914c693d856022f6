"""Scenarios 13 and 14: the ledger database lost at the moment a worker writes to it.

The worker reaches PostgreSQL through a proxy that reads the wire protocol
(``tests/chaos/pgproxy.py``) and cuts the connection at a chosen statement, so each fault
lands exactly where the scenario puts it rather than where a timer happens to fall:

* scenario 13: the database goes away when the body's success mark is sent, and stays away
  for some seconds (every connection dropped, new ones refused), then comes back on the
  same address;
* scenario 14: an in-doubt commit. The connection drops right after the server received the
  COMMIT of the success mark (it committed; the worker only sees an error), or right before
  it (rolled back); and the same for a claim, whose reply is lost after the server ran it.

The test process keeps its own direct connection: it observes, and runs the rescuer as the
beat leader does, but only while the database is up for the worker (a beat leader would not
reach a database that is down either).

Oracles: ``Effect`` (every committed effect, no unique constraint), body starts (a Redis
list written outside the transaction for ``testapp.atomic_gated``; ``EffectRaw`` rows,
committed at once, for non-atomic bodies) and the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from taskplatform import submit
from taskplatform.core import ledger
from taskplatform.core.publisher import publish
from taskplatform.core.rescuer import run_rescuer
from taskplatform.core.types import Delivery, NewExecution
from taskplatform.models import Execution
from tests.chaos.pgproxy import Cut, PgProxy
from tests.conftest import Worker
from tests.conftest import test_database_url as database_url
from tests.helpers import event_kinds
from tests.testapp.models import Effect, EffectRaw

#: The statements the cuts aim at (as the worker sends them: whole in a simple Query message
#: where Django's cursor binds client-side, in a Parse message where ``core/_pg.py`` lets the
#: server bind the parameters).
SUCCESS_MARK = r"SET state = 'SUCCEEDED'"  # the success compare-and-set (core/_pg.py)
FIRST_CLAIM = r"SET\s+state = 'RUNNING'"  # the one-statement claim of a first attempt (core/_pg.py)
CREATE_CLAIMED = r'INSERT INTO "taskplatform_execution" AS e'  # a plain call's create-and-claim (core/_pg.py)
PORTABLE_CLAIM = r"""SET "state" = 'RUNNING'"""  # the claim of any other attempt (core/ledger.py)
COMMIT = r"^COMMIT$"


@pytest.fixture
def pg_proxy(transactional_db: None) -> Iterator[PgProxy]:
    """A PostgreSQL-aware proxy on 127.0.0.1 in front of the test database; stopped afterwards."""
    url = database_url()
    if not url.startswith("postgres"):
        pytest.skip("the proxy reads PostgreSQL's wire protocol")
    target = urlsplit(url)
    proxy = PgProxy(target.hostname or "127.0.0.1", target.port or 5432).start()
    yield proxy
    proxy.stop()


def through(proxy: PgProxy, **extra: str) -> dict[str, str]:
    """A worker's environment whose database is reached through ``proxy``."""
    parts = urlsplit(database_url())
    auth = parts.netloc.rsplit("@", 1)
    user = f"{auth[0]}@" if len(auth) == 2 else ""
    url = urlunsplit(parts._replace(netloc=f"{user}{proxy.listen_host}:{proxy.port}"))
    return {"DATABASE_URL": url, **extra}


def atomic_starts(key: str) -> list[str]:
    """``testapp.atomic_gated``'s body starts, ``"<token>:<pid>"`` each (outside any transaction)."""
    starts = redis.Redis.from_url(settings.CELERY_BROKER_URL).lrange(f"tp-starts:{key}", 0, -1)
    return [s.decode() for s in starts]


def raw_starts(key: str) -> list[int]:
    """A non-atomic body's starts, by fencing token."""
    return list(
        EffectRaw.objects.filter(key=key, phase="started").order_by("id").values_list("fencing_token", flat=True)
    )


def effect_tokens(key: str) -> list[int]:
    return list(Effect.objects.filter(key=key).order_by("id").values_list("fencing_token", flat=True))


def row(pk: int) -> Execution:
    return Execution.objects.get(pk=pk)


def lost(execution: Execution) -> int:
    """1 if the execution did not end SUCCEEDED (every test here expects it to)."""
    return int(execution.state != "SUCCEEDED")


def settle(poll: Callable[..., Any], predicate: Callable[[], Any], *, proxy: PgProxy, worker: Worker, what: str) -> Any:
    """Wait for ``predicate``, running the rescuer meanwhile while the database is up."""

    def check() -> Any:
        if not proxy.is_down:
            run_rescuer()
        return predicate()

    try:
        return poll(check, timeout=90, interval=0.25, what=what)
    except AssertionError as exc:
        seen = "\n".join(f"{s.connection} {s.kind} {s.sql[:120]!r}" for s in proxy.statements[-40:])
        raise AssertionError(f"{exc}\n--- worker log ---\n{worker.log()[-6000:]}\n--- statements ---\n{seen}") from None


def fired(poll: Callable[..., Any], cut: Cut, worker: Worker, proxy: PgProxy) -> None:
    try:
        poll(cut.fired.is_set, timeout=60, interval=0.05, what=f"the cut at {cut.pattern!r}")
    except AssertionError as exc:
        seen = "\n".join(f"{s.connection} {s.kind} {s.sql[:120]!r}" for s in proxy.statements[-40:])
        raise AssertionError(f"{exc}\n--- worker log ---\n{worker.log()[-6000:]}\n--- statements ---\n{seen}") from None


def hold_outage(proxy: PgProxy, cut: Cut, seconds: float) -> float:
    """Keep the database away for ``seconds`` after the cut (the fault's length, not a wait for
    anything), then bring it back on the same address; returns how long it was away."""
    assert cut.fired_at is not None
    time.sleep(max(0.0, seconds - (time.monotonic() - cut.fired_at)))
    proxy.up()
    return time.monotonic() - cut.fired_at


# --- scenario 13: the ledger database unreachable around completion ----------------------------


@pytest.mark.scenario(13)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ledger_down_as_an_atomic_body_finishes_rolls_it_back_and_runs_it_again_once(pg_proxy, workers, poll, figures):
    """The database goes away when the success mark is sent: the attempt's transaction (the
    body's effect and the mark) is lost with its connection. The attempt stays RUNNING, its
    lease runs out, and once the database is back the rescuer re-queues it: attempt 2 runs the
    body again and commits the only effect."""
    cut = pg_proxy.arm(Cut(SUCCESS_MARK, when="outage"))
    worker = workers.start(concurrency=1, env=through(pg_proxy))
    execution = submit("testapp.atomic_gated")
    key = execution.idempotency_key
    fired(poll, cut, worker, pg_proxy)

    outage = hold_outage(pg_proxy, cut, seconds=8)
    back = time.monotonic()
    settle(poll, lambda: row(execution.pk).state == "SUCCEEDED", proxy=pg_proxy, worker=worker, what="success")
    recovery = time.monotonic() - back

    final = row(execution.pk)
    starts = atomic_starts(key)
    tokens = effect_tokens(key)
    figures.record(
        executions=1, body_starts=len(starts), effects=len(tokens), lost=lost(final), duplicates=len(tokens) - 1,
        recovery_s=recovery, outage_s=outage, attempts=final.attempts,
    )  # fmt: skip
    assert "success of a finished body could not be recorded" in worker.log()
    assert (final.state, final.attempts, final.fencing_token) == ("SUCCEEDED", 2, 2)
    assert [s.split(":")[0] for s in starts] == ["1", "2"], "the body ran again in attempt 2"
    assert tokens == [2], "one committed effect: attempt 1's rolled back with its success mark"


@pytest.mark.scenario(13)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ledger_down_briefly_as_a_body_finishes_records_its_success_when_it_is_back(pg_proxy, workers, poll, figures):
    """A non-atomic body has committed its effect; the database goes away when its success
    mark is sent and comes back within the attempt's lease. The worker keeps trying to record
    the success while its lease may still be live, so the body is not run a second time."""
    cut = pg_proxy.arm(Cut(SUCCESS_MARK, when="outage"))
    worker = workers.start(concurrency=1, env=through(pg_proxy, TASKPLATFORM_LEASE_SECONDS="20"))
    execution = submit("testapp.effect")
    key = execution.idempotency_key
    fired(poll, cut, worker, pg_proxy)

    outage = hold_outage(pg_proxy, cut, seconds=5)
    back = time.monotonic()
    settle(poll, lambda: row(execution.pk).state == "SUCCEEDED", proxy=pg_proxy, worker=worker, what="success")
    recovery = time.monotonic() - back

    final = row(execution.pk)
    starts, tokens = raw_starts(key), effect_tokens(key)
    figures.record(
        executions=1, body_starts=len(starts), effects=len(tokens), lost=lost(final), duplicates=len(tokens) - 1,
        recovery_s=recovery, outage_s=outage, attempts=final.attempts, lease_s=20,
    )  # fmt: skip
    assert (final.state, final.attempts, final.fencing_token) == ("SUCCEEDED", 1, 1)
    assert starts == [1], "one body start"
    assert tokens == [1], "one committed effect"


@pytest.mark.scenario(13)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ledger_down_longer_than_the_lease_as_a_body_finishes_runs_a_non_atomic_body_twice(
    pg_proxy, workers, poll, figures
):
    """The documented limit: the database stays away longer than the attempt's lease, so the
    worker gives up recording the success and the rescuer re-queues the attempt once the
    database is back. A non-atomic body's effect was committed before; attempt 2 commits it
    again. The ledger records one success."""
    cut = pg_proxy.arm(Cut(SUCCESS_MARK, when="outage"))
    worker = workers.start(concurrency=1, env=through(pg_proxy, TASKPLATFORM_LEASE_SECONDS="4"))
    execution = submit("testapp.effect")
    key = execution.idempotency_key
    fired(poll, cut, worker, pg_proxy)

    outage = hold_outage(pg_proxy, cut, seconds=10)
    back = time.monotonic()
    settle(poll, lambda: row(execution.pk).state == "SUCCEEDED", proxy=pg_proxy, worker=worker, what="success")
    recovery = time.monotonic() - back

    final = row(execution.pk)
    starts, tokens = raw_starts(key), effect_tokens(key)
    figures.record(
        executions=1, body_starts=len(starts), effects=len(tokens), lost=lost(final), duplicates=len(tokens) - 1,
        recovery_s=recovery, outage_s=outage, attempts=final.attempts, lease_s=4,
    )  # fmt: skip
    assert (final.state, final.attempts, final.fencing_token) == ("SUCCEEDED", 2, 2)
    assert starts == [1, 2]
    assert tokens == [1, 2], "attempt 1's non-atomic effect stays committed (the documented limit)"


# --- scenario 14: in-doubt commits -------------------------------------------------------------


@pytest.mark.scenario(14)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("when", "attempts"),
    [pytest.param("after", 1, id="commit-reached-the-server"), pytest.param("before", 2, id="commit-lost-on-the-way")],
)
def test_an_in_doubt_commit_of_an_atomic_success_is_decided_by_the_ledger(
    pg_proxy, workers, poll, figures, when, attempts
):
    """The connection drops around the COMMIT of an atomic body's transaction (its effect and
    its success mark). ``after``: the server committed, the worker sees an error; the ledger
    says SUCCEEDED and nothing runs again. ``before``: the transaction rolled back; the attempt
    stays RUNNING until its lease expires and the rescuer re-queues it. Either way one
    committed effect, and a redelivery of the message afterwards is absorbed."""
    cut = pg_proxy.arm(Cut(COMMIT, when=when, primed_by=SUCCESS_MARK))
    worker = workers.start(concurrency=1, env=through(pg_proxy))
    execution = submit("testapp.atomic_gated")
    key = execution.idempotency_key
    fired(poll, cut, worker, pg_proxy)
    assert cut.kind == "Q", "psycopg sends COMMIT as a simple query"
    if when == "after":
        assert cut.server_reply[:1] == ["C:COMMIT"], f"the server committed: {cut.server_reply}"
    assert cut.fired_at is not None
    settle(poll, lambda: row(execution.pk).state == "SUCCEEDED", proxy=pg_proxy, worker=worker, what="success")
    recovery = time.monotonic() - cut.fired_at
    poll(lambda: "success of a finished body could not be recorded" in worker.log(), timeout=30, what="the error")

    final = row(execution.pk)
    publish(final, task_id=final.celery_task_id)  # the same message once more (a redelivery)
    poll(lambda: "already_finished" in event_kinds(execution.pk), timeout=60, what="the redelivery absorbed")
    assert run_rescuer().rescued == 0

    final = row(execution.pk)
    starts, tokens = atomic_starts(key), effect_tokens(key)
    absorbed = event_kinds(execution.pk).count("already_finished")
    figures.record(
        executions=1, body_starts=len(starts), effects=len(tokens), lost=lost(final), duplicates=len(tokens) - 1,
        recovery_s=recovery, attempts=final.attempts, redeliveries_absorbed=absorbed,
    )  # fmt: skip
    assert (final.state, final.attempts, final.fencing_token) == ("SUCCEEDED", attempts, attempts)
    assert [int(s.split(":")[0]) for s in starts] == list(range(1, attempts + 1))
    assert tokens == [attempts], "exactly one committed effect, the succeeding attempt's"


@pytest.mark.scenario(14)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("task", "kwargs", "attempt", "pattern", "primed_by", "when"),
    [
        pytest.param("testapp.effect", {}, 1, FIRST_CLAIM, "", "after", id="first-attempt"),
        pytest.param(
            "testapp.fails_then_succeeds", {"failures": 1}, 2, COMMIT, PORTABLE_CLAIM, "after", id="retry-attempt"
        ),
        pytest.param("testapp.effect", {}, 1, FIRST_CLAIM, "", "before", id="first-attempt-lost-on-the-way"),
    ],
)
def test_an_in_doubt_claim_is_recognised_as_the_deliverys_own(
    pg_proxy, workers, poll, figures, task, kwargs, attempt, pattern, primed_by, when
):
    """The claim's reply is lost after the server committed it (the first attempt's one-statement
    claim, or a retry's claim transaction). The worker retries the claim on a fresh connection
    and finds the row RUNNING under its own name, its own message and the start time it wrote:
    its own claim. It runs the body at once instead of absorbing itself as a duplicate delivery,
    which left the attempt to expire and counted it as spent: with no attempt left, the
    execution was dead-lettered without its body ever running. (``before``: the claim never
    reached the server; the retry simply claims.)"""
    execution = submit(task, kwargs=kwargs)
    key = execution.idempotency_key
    Execution.objects.filter(pk=execution.pk).update(max_attempts=attempt)  # no attempt to spare
    cut = pg_proxy.arm(Cut(pattern, when=when, primed_by=primed_by))
    worker = workers.start(concurrency=1, env=through(pg_proxy))
    fired(poll, cut, worker, pg_proxy)
    if when == "after":
        assert cut.server_reply[:1] in (["C:SELECT 1"], ["C:COMMIT"]), f"the claim committed: {cut.server_reply}"
    assert cut.fired_at is not None
    settle(
        poll, lambda: row(execution.pk).state in ("SUCCEEDED", "FAILED"), proxy=pg_proxy, worker=worker,
        what="a final state",
    )  # fmt: skip
    recovery = time.monotonic() - cut.fired_at

    final = row(execution.pk)
    starts = raw_starts(key)
    figures.record(
        executions=1, body_starts=len(starts), lost=lost(final), recovery_s=recovery,
        attempts=final.attempts, duplicate_deliveries=event_kinds(execution.pk).count("duplicate_delivery"),
    )  # fmt: skip
    assert (final.state, final.attempts, final.fencing_token) == ("SUCCEEDED", attempt, attempt), final.last_error
    assert starts == list(range(1, attempt + 1)), "the body ran in the attempt whose claim was in doubt"
    assert "duplicate_delivery" not in event_kinds(execution.pk)


@pytest.mark.scenario(14)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.timeout(180)
@pytest.mark.parametrize("when", ["after", "before"])
def test_an_in_doubt_create_and_claim_of_a_plain_call_is_recognised_as_the_deliverys_own(
    pg_proxy, workers, poll, figures, when
):
    """A plain Celery call (``task.delay()``): the worker creates the row already claimed, in one
    statement, and that statement's reply is lost after the server committed it (``after``) or
    before it reached the server (``before``). The retry on a fresh connection finds the key
    taken under its own name, message and start mark, adopts the claim and runs the body in the
    first attempt; it does not absorb itself as a duplicate and leave the attempt to expire."""
    from tests.testapp.tasks import effect

    cut = pg_proxy.arm(Cut(CREATE_CLAIMED, when=when))
    worker = workers.start(concurrency=1, env=through(pg_proxy))
    message = effect.delay()
    fired(poll, cut, worker, pg_proxy)
    if when == "after":
        assert cut.server_reply == ["C:SELECT 1", "Z:I"], f"the create-and-claim committed: {cut.server_reply}"
    execution = settle(
        poll, lambda: Execution.objects.filter(idempotency_key=message.id, state="SUCCEEDED").first(),
        proxy=pg_proxy, worker=worker, what="the plain call's success",
    )  # fmt: skip
    recovery = time.monotonic() - (cut.fired_at or 0.0)
    starts = raw_starts(execution.idempotency_key)
    figures.record(
        executions=1, body_starts=len(starts), lost=lost(execution), recovery_s=recovery,
        attempts=execution.attempts, duplicate_deliveries=event_kinds(execution.pk).count("duplicate_delivery"),
    )  # fmt: skip
    assert (execution.attempts, execution.fencing_token) == (1, 1)
    assert starts == [1], "the body ran once, in the attempt whose claim was in doubt"
    assert "duplicate_delivery" not in event_kinds(execution.pk)


@pytest.mark.scenario(14)
@pytest.mark.worker
@pytest.mark.fault
@pytest.mark.timeout(180)
def test_an_in_doubt_success_of_a_non_atomic_body_is_final(pg_proxy, workers, poll, figures):
    """A non-atomic body's success mark is one autocommit statement; the connection drops after
    the server ran it. The worker retries the write on a fresh connection, which finds the row
    SUCCEEDED already and changes nothing: the body is not run again, and a redelivery is
    absorbed."""
    cut = pg_proxy.arm(Cut(SUCCESS_MARK, when="after"))
    worker = workers.start(concurrency=1, env=through(pg_proxy))
    execution = submit("testapp.effect")
    key = execution.idempotency_key
    fired(poll, cut, worker, pg_proxy)
    assert cut.server_reply[:1] == ["C:SELECT 1"], f"the success was recorded: {cut.server_reply}"
    assert cut.fired_at is not None
    settle(poll, lambda: row(execution.pk).state == "SUCCEEDED", proxy=pg_proxy, worker=worker, what="success")
    recovery = time.monotonic() - cut.fired_at
    poll(lambda: f"{execution.celery_task_id}] succeeded" in worker.log(), timeout=30, what="the task returned")

    final = row(execution.pk)
    publish(final, task_id=final.celery_task_id)  # a redelivery
    poll(lambda: "already_finished" in event_kinds(execution.pk), timeout=60, what="the redelivery absorbed")
    assert run_rescuer().rescued == 0

    final = row(execution.pk)
    starts, tokens = raw_starts(key), effect_tokens(key)
    kinds = event_kinds(execution.pk)
    figures.record(
        executions=1, body_starts=len(starts), effects=len(tokens), lost=lost(final), duplicates=len(tokens) - 1,
        recovery_s=recovery, attempts=final.attempts, redeliveries_absorbed=kinds.count("already_finished"),
        own_success_refused_as_stale=kinds.count("stale_write_rejected"),
    )  # fmt: skip
    assert (final.state, final.attempts, final.fencing_token) == ("SUCCEEDED", 1, 1)
    assert starts == [1]
    assert tokens == [1]
    assert kinds.count("succeeded") == 1
    assert kinds.count("stale_write_rejected") == 0, "its own success was audited as a stale write"


def test_a_claim_is_the_deliverys_own_only_with_the_start_mark_it_wrote(db):
    """The recognition of an in-doubt claim must not let another delivery of the same message
    in the same process (a thread pool, a visibility-timeout redelivery) run beside the live
    attempt: only the start mark the claim wrote makes the running attempt this delivery's own."""
    execution, _ = ledger.create(
        NewExecution(idempotency_key="in-doubt", task_name="testapp.effect", args=[], kwargs={})
    )
    delivery = Delivery(execution.pk, "testapp.effect", [], {}, "w1@host:4242:x.1:17", "task-1")

    def claim(mark):
        return ledger.claim_message(
            delivery, default_lease_seconds=60, lease_seconds_for=lambda job: 60,
            max_attempts_for=lambda job: 3, started_at=mark,
        )  # fmt: skip

    mark = timezone.now()
    assert claim(mark).outcome == "claimed"
    assert claim(timezone.now()).outcome == "duplicate", "another delivery of the same message"
    again = claim(mark)  # the same delivery, retrying after its reply was lost
    assert (again.outcome, again.execution.fencing_token, again.lease_seconds) == ("claimed", 1, 60)
    final = Execution.objects.get(pk=execution.pk)
    assert (final.state, final.attempts, final.fencing_token) == ("RUNNING", 1, 1)


@pytest.mark.scenario(13)
def test_a_message_that_arrives_while_the_worker_cannot_reach_the_ledger_runs_once_it_can(
    pg_proxy, workers, poll, figures
):
    """The worker alone has lost the database (a partition; the rest of the system, the
    rescuer's host included, still reaches it). A submitted execution's message arrives and
    its claim fails: the message goes back to the queue (before: Celery acknowledged it and the
    row waited for the rescuer's next look, 5 minutes by default). No rescuer runs here."""
    worker = workers.start(concurrency=1, env=through(pg_proxy))
    warm = submit("testapp.effect")
    poll(lambda: row(warm.pk).state == "SUCCEEDED", timeout=60, what="the worker's first execution")
    pg_proxy.down()
    execution = submit("testapp.effect")  # the test process reaches the database directly
    poll(lambda: "goes back to the queue" in worker.log(), timeout=60, what="the worker to give the message back")
    pg_proxy.up()
    back = time.monotonic()
    poll(lambda: row(execution.pk).state == "SUCCEEDED", timeout=60, what="the execution once the ledger is back")
    final = row(execution.pk)
    figures.record(
        executions=1,
        body_starts=len(raw_starts(execution.idempotency_key)),
        effects=len(effect_tokens(execution.idempotency_key)),
        lost=lost(final),
        duplicates=max(0, len(effect_tokens(execution.idempotency_key)) - 1),
        recovery_s=time.monotonic() - back,
        rescuer_runs=0,
    )
    assert (final.attempts, final.publish_count) == (1, 1)
    assert raw_starts(execution.idempotency_key) == [1] and effect_tokens(execution.idempotency_key) == [1]
