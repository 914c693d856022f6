"""Fleet-wide limits with real workers: at most N bodies at once, at most N starts a second.

Two ``celery worker`` processes at concurrency 4 share one limit. What ran when is measured
from ``Span`` (the body's own start and end times, no unique constraint), so an overlap of
three bodies, or a key run twice, shows. A worker is SIGKILLed mid-run: its slot must free
within the lease, and the bodies it was running are rescued and run again.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from django.db.models import Count

from taskplatform import submit_many
from taskplatform.models import Execution, ExecutionEvent, Limit
from taskplatform.worker import limits
from tests.testapp.models import Effect, Span

pytestmark = [pytest.mark.worker]

#: The test workers' lease (config/settings/test.py): a dead holder's slot frees by then.
LEASE_SECONDS = 6
#: Workers run the rescuer (the killed worker's attempts come back) every 2 s.
MAINTENANCE = {"TASKPLATFORM_WORKER_MAINTENANCE": "1", "TASKPLATFORM_RESCUE_INTERVAL_SECONDS": "2"}


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at ``t`` comes before a start at ``t``)."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def most_starts_in_a_window(starts: list[float], window: float) -> int:
    starts = sorted(starts)
    best, j = 0, 0
    for i, t in enumerate(starts):
        while starts[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def diagnosis(prefix: str) -> str:
    """Where the executions of a run that did not finish are (for a failure's message)."""
    rows = Execution.objects.filter(idempotency_key__startswith=prefix)
    states = dict(rows.values_list("state").annotate(n=Count("id")))
    kinds = dict(ExecutionEvent.objects.filter(execution__in=rows).values_list("kind").annotate(n=Count("id")))
    return f"states {states}, events {kinds}, spans {Span.objects.count()}"


def submit_limited(task: str, n: int, prefix: str, **kwargs: Any) -> list[Execution]:
    items = [{"kwargs": kwargs, "idempotency_key": f"{prefix}-{i}"} for i in range(n)]
    return list(submit_many(task, items, on_commit=False))


def all_succeeded(prefix: str, n: int) -> bool:
    return Execution.objects.filter(idempotency_key__startswith=prefix, state="SUCCEEDED").count() == n


@pytest.mark.fault
@pytest.mark.parametrize("lock_url", ["db://", "redis://127.0.0.1:6379/11"])
def test_a_concurrency_limit_of_two_holds_across_two_workers_and_a_sigkill(workers, poll, settings, lock_url):
    settings.TASKPLATFORM_LOCK_URL = lock_url
    # The killed worker's prefetched messages stay unacknowledged in Redis (an hour): their
    # rows are published again by the survivor's rescuer after this, not after 300 s.
    settings.TASKPLATFORM_REPUBLISH_AFTER_SECONDS = 5
    Limit.objects.create(task_name="testapp.limited", concurrency=2, note="test")
    env = {**MAINTENANCE, "TASKPLATFORM_LOCK_URL": lock_url, "TASKPLATFORM_REPUBLISH_AFTER_SECONDS": "5"}
    doomed = workers.start(concurrency=4, env=env)
    survivor = workers.start(concurrency=4, env=env)
    n = 200
    submit_limited("testapp.limited", n, "conc", seconds=0.05)

    # Kill the first worker while one of its pool processes runs a body (so holds a slot). A
    # body lasts 50 ms: seen running, it may have ended before a kill sent next. So the worker
    # is frozen first (SIGSTOP), the open body is looked for while it cannot end, and the kill
    # follows; if none was open, the worker is let go on and the next body is waited for.
    def doomed_running() -> bool:
        pids = {c.pid for c in doomed.pool_children()}
        return Span.objects.filter(ended__isnull=True, pid__in=pids).exists() and Span.objects.count() >= 40

    def frozen_mid_body() -> bool:
        poll(doomed_running, timeout=90, what="a body running on the first worker, 40 in")
        os.killpg(doomed.pid, signal.SIGSTOP)
        if doomed_running():
            return True
        os.killpg(doomed.pid, signal.SIGCONT)
        return False

    poll(frozen_mid_body, timeout=120, interval=0.05, what="the first worker frozen while it runs a body")
    from taskplatform.backends import get_lock_backend

    backend = get_lock_backend()
    limit_id = Limit.objects.get(task_name="testapp.limited").pk
    slots = [f"limit:{limit_id}:running:{i}" for i in range(2)]
    doomed_pids = {c.pid for c in doomed.pool_children()}

    def doomed_owners() -> list[str]:
        """The running slots held by the frozen worker's pool processes (an owner names its
        attempt's worker, ``<node>:<pid>:...``)."""
        owners = [info.owner for info in map(backend.inspect, slots) if info is not None and info.owner]
        return [o for o in owners if any(f":{pid}:" in o for pid in doomed_pids)]

    held_by_doomed = doomed_owners()
    os.killpg(doomed.pid, signal.SIGKILL)
    killed_at = time.time()
    # The slot the dead worker held frees within its lease (the lock backend's own expiry).
    assert held_by_doomed, "the frozen worker held a running slot"
    poll(lambda: not doomed_owners(), timeout=LEASE_SECONDS + 4, interval=0.2, what="the dead worker's slots free")
    try:
        poll(lambda: all_succeeded("conc", n), timeout=150, interval=0.5, what="every limited execution succeeded")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {diagnosis('conc')}") from exc

    rows = list(Span.objects.values_list("key", "started", "ended"))
    # A killed body's span ends when its process died (at the latest: the kill).
    spans = [(s, e if e is not None else killed_at) for _, s, e in rows]
    assert max_overlap(spans) == 2, "never more than 2 bodies at once, and the limit was reached"
    killed = [s for _, s, e in rows if e is None]
    assert killed, "the kill interrupted a body"
    assert len({k for k, _, e in rows if e is not None}) == n, "every key ran to the end"
    # Two bodies ran at once again after the kill. Not within a bound: once the dead slot has
    # freed (checked above), a second body starts at the next wake or waiter's backstop, which
    # ``limits._full`` spreads over a window that grows with the backlog.
    after = sorted((s, e) for s, e in spans if s > killed_at)
    assert any(sum(1 for s2, e2 in spans if s2 <= s < e2) >= 2 for s, _ in after), "two at once again"
    assert ExecutionEvent.objects.filter(kind="waiting_for_limit").exists()
    assert ExecutionEvent.objects.filter(kind="woken").exists(), "a freed slot woke a waiter"
    # No attempt was counted for a wait: a row made one attempt per run, plus one for an
    # attempt the kill cut short before its body started (the rescuer says so).
    runs = dict(Span.objects.values_list("key").annotate(n=Count("id")))
    # The kill's cut-short attempt is brought back by the rescuer, or taken over by the next
    # delivery once its owner is known dead: either way one attempt with no body.
    rescued = set(
        ExecutionEvent.objects.filter(kind__in=("rescued", "taken_over")).values_list(
            "execution__idempotency_key", flat=True
        )
    )
    for key, attempts in Execution.objects.filter(idempotency_key__startswith="conc").values_list(
        "idempotency_key", "attempts"
    ):
        assert runs[key] <= attempts <= runs[key] + (key in rescued), (key, attempts, runs[key])
    assert survivor.alive()


def test_a_rate_limit_of_20_a_second_starts_at_most_21_in_any_second(workers, poll):
    Limit.objects.create(task_name="testapp.limited", rate=20, per_seconds=1)
    workers.start(concurrency=4)
    workers.start(concurrency=4)
    n = 200
    submit_limited("testapp.limited", n, "rate")
    poll(lambda: all_succeeded("rate", n), timeout=180, interval=0.5, what="every rate-limited execution succeeded")
    starts = list(Span.objects.values_list("started", flat=True))
    assert len(starts) == n, "each key started once"
    assert most_starts_in_a_window(starts, 1.0) <= 21, "the limit, with a tolerance of 1 at the boundaries"
    duration = max(starts) - min(starts)
    assert duration >= (n / 20) - 1.5, f"200 starts at 20 a second take about 10 s, not {duration:.1f}"


def test_an_atomic_body_under_a_job_limit_commits_once_per_execution(workers, poll):
    """A job's own limit (not its task's), an atomic body: each effect commits exactly once,
    waits included, and the waits show in the history."""
    from taskplatform.jobs import define_job

    job, _ = define_job("limited-atomic", task="testapp.limited_atomic")
    Limit.objects.create(job=job, concurrency=1)
    workers.start(concurrency=4)
    n = 30
    submit_many(
        job, [{"kwargs": {"seconds": 0.05}, "idempotency_key": f"atomic-{i}"} for i in range(n)], on_commit=False
    )
    poll(lambda: all_succeeded("atomic", n), timeout=120, interval=0.5, what="every atomic execution succeeded")
    effects = dict(Effect.objects.values_list("key").annotate(n=Count("id")))
    assert effects == {f"atomic-{i}": 1 for i in range(n)}
    assert ExecutionEvent.objects.filter(kind="waiting_for_limit", execution__job=job).exists()


def test_holders_are_listed_while_bodies_run(workers, poll, admin_client):
    """The locks page shows the limit and who holds its slots now."""
    limit = Limit.objects.create(task_name="testapp.limited", concurrency=2)
    workers.start(concurrency=2)
    submit_limited("testapp.limited", 2, "held", seconds=30)
    poll(lambda: len(limits.holders(limit)) == 2, timeout=60, what="both slots held")
    page = admin_client.get("/admin/taskplatform/locklease/").content.decode()
    assert "task:testapp.limited" in page and page.count("execution:") >= 2


def test_a_body_longer_than_its_lease_keeps_its_slot(workers, poll):
    """The slot is renewed with the attempt's lease: a 2 s lease, 5 s bodies, a limit of one,
    two workers. Without the renewal the second body would start 2 s into the first."""
    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    env = {"TASKPLATFORM_LEASE_SECONDS": "2"}
    workers.start(concurrency=2, env=env)
    workers.start(concurrency=2, env=env)
    submit_limited("testapp.limited", 2, "long", seconds=5)
    poll(lambda: all_succeeded("long", 2), timeout=120, interval=0.5, what="both long bodies succeeded")
    spans = list(Span.objects.values_list("started", "ended"))
    assert len(spans) == 2 and max_overlap(spans) == 1, spans


@pytest.mark.django_db(transaction=True)
def test_a_slot_keeper_whose_database_connection_was_cut_keeps_the_slot(settings):
    """Review of the limits: the slot keeper kept a connection the server had closed, every
    later renewal failed, and the slot ran out under a running body (N+1 ran). The test cuts
    the keeper's connection (every session of the test database but its own), then checks for
    three TTLs that nobody else can take the slot."""
    from django.db import connection

    from taskplatform.backends import get_lock_backend

    settings.TASKPLATFORM_LOCK_URL = "db://"
    backend = get_lock_backend()
    names = ["limit:0:running:0"]
    lease = backend.acquire_any(names, 3, identity="holder")
    assert lease is not None
    rule = limits.Rule(0, "task:x", "x", None, 1, None, 1, "default")
    held = limits.Held([(rule, backend, lease)])
    limits.slot_keeper().hold(held)
    first = backend.inspect(names[0]).renewed_at
    poll_until = time.monotonic() + 10
    while backend.inspect(names[0]).renewed_at == first:  # the keeper has renewed once: it has a connection
        assert time.monotonic() < poll_until, "no renewal within 10 s"
        time.sleep(0.1)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    try:
        deadline = time.monotonic() + 9
        while time.monotonic() < deadline:
            assert backend.acquire_any(names, 3, identity="thief") is None, "the slot ran out under its holder"
            time.sleep(0.2)  # observing for three TTLs, not waiting for an event
    finally:
        limits.release(held, worker="test")


def test_a_waiting_delivery_does_not_run_the_rest_of_its_chain(workers, poll):
    """Review of the limits: a wait ended the delivery as a success, so Celery ran the next
    step of the chain (with None) before the limited body had run. It ends with ``Ignore``."""
    from celery import chain

    from tests.testapp.models import EffectRaw
    from tests.testapp.tasks import effect, limited

    Limit.objects.create(task_name="testapp.limited", concurrency=1)
    workers.start(concurrency=4)
    submit_limited("testapp.limited", 1, "holder", seconds=4)
    poll(lambda: Span.objects.filter(key="holder-0").exists(), timeout=30, what="the holder runs")
    chain(limited.si(seconds=0), effect.si()).apply_async()
    poll(lambda: ExecutionEvent.objects.filter(kind="waiting_for_limit").exists(), timeout=30, what="the head waits")
    poll(lambda: Span.objects.count() == 2, timeout=60, what="the chain's head ran after its wait")
    assert not EffectRaw.objects.exists(), "the chain's next step ran before (or without) the limited body"


@pytest.mark.django_db(transaction=True)
def test_the_wake_lookup_uses_the_waiting_index_on_a_large_ledger():
    """Review of the limits: ``ORDER BY id LIMIT 3`` walked the primary key of the whole ledger
    (400-700 ms at 2 M rows) after every limited body. The partial index serves it: the plan
    of the statement ``ledger.wake_waiter`` runs, as it runs it."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from taskplatform.core import ledger

    now = timezone.now()
    Execution.objects.bulk_create(
        Execution(idempotency_key=f"done-{i}", task_name="testapp.limited", state="SUCCEEDED", finished_at=now)
        for i in range(20_000)
    )
    waits = Execution.objects.create(
        idempotency_key="waits", task_name="testapp.limited", state="WAITING", waiting_on_limit=7
    )
    with CaptureQueriesContext(connection) as queries:
        assert [e.pk for e in ledger._waiters(7, now)] == [waits.pk]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE taskplatform_execution")
        cursor.execute("EXPLAIN " + queries.captured_queries[-1]["sql"])
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "tp_exec_waiting_limit" in plan, plan
