"""The maintenance duties (the rescuer, pruning) run wherever the platform runs.

Found adopting the app into a fresh project: only ``LockedScheduler``'s leader ran the
rescuer, so with another scheduler (or none) a retry parked in the ledger stayed
``RETRYING`` past its due time, and a message lost on the broker stayed ``PENDING``, until
someone ran ``manage.py taskplatform rescue``. Workers are now candidates for the duties: one
process in the fleet holds the maintenance lease and runs them; another takes over when it
dies. No beat runs in these tests, and nothing here calls the rescuer.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from django.test import override_settings

from taskplatform import submit
from taskplatform.backends import get_lock_backend
from taskplatform.checks import check_maintenance
from taskplatform.models import Execution, ExecutionEvent, JobDefinition
from taskplatform.scheduling.maintenance import MAINTENANCE_LOCK
from tests.helpers import state_of, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

#: The workers take part in the duties and look every second; a delay above 1 s is parked.
DUTY = {
    "TASKPLATFORM_WORKER_MAINTENANCE": "1",
    "TASKPLATFORM_RESCUE_INTERVAL_SECONDS": "1",
    "TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS": "1",
}


def holder() -> str | None:
    info = get_lock_backend().inspect(MAINTENANCE_LOCK)
    return info.owner if info is not None else None


def parked_retry(slug: str) -> Execution:
    """An execution whose first attempt fails and whose retry (3 s) is parked in the ledger."""
    job = JobDefinition.objects.create(
        slug=slug, task="testapp.fails_then_succeeds", backoff_base_seconds=3, backoff_max_seconds=10, jitter=False
    )
    return submit(job, kwargs={"failures": 1})


@pytest.mark.worker
@pytest.mark.timeout(120)
def test_without_a_beat_a_parked_retry_is_published_when_due_by_one_worker(workers: Any) -> None:
    a = workers.start(concurrency=1, env=DUTY)
    b = workers.start(concurrency=1, env=DUTY)
    execution = parked_retry("parked-no-beat")
    wait_for(lambda: state_of(execution.pk) == "RETRYING", timeout=30, what="the first failure")
    row = Execution.objects.get(pk=execution.pk)
    assert row.publish_count == 0, "the retry went to the broker: it must be parked for this test"
    wait_for(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=30, what="the parked retry, published when due")
    assert ExecutionEvent.objects.get(execution=row, kind="republished").reason == "due"

    # One worker holds the duties, not both.
    owner = wait_for(holder, timeout=10, what="a holder of the maintenance lease")
    pids = {str(a.pid), str(b.pid)}
    assert any(f":{pid}#" in owner for pid in pids), owner
    running = [w for w in (a, b) if f":{w.pid}#" in owner]
    lines = [w for w in (a, b) if "runs the maintenance duties" in w.log()]
    assert len(running) == 1 and lines == running, "exactly one worker took the duties"

    # Its death hands them to the other within the lease (6 s) and one look (1 s).
    (dead,) = running
    (other,) = [w for w in (a, b) if w is not dead]
    os.killpg(dead.pid, signal.SIGKILL)
    wait_for(lambda: f":{other.pid}#" in (holder() or ""), timeout=20, what="the other worker taking over")
    second = parked_retry("parked-after-takeover")
    wait_for(lambda: state_of(second.pk) == "SUCCEEDED", timeout=40, what="a parked retry after the takeover")


@override_settings(
    TASKPLATFORM_WORKER_MAINTENANCE=False, CELERY_BEAT_SCHEDULER="django_celery_beat.schedulers:DatabaseScheduler"
)
def test_a_configuration_where_nothing_runs_the_rescuer_is_warned_about() -> None:
    (warning,) = check_maintenance()
    assert warning.id == "taskplatform.W017" and "nothing runs the rescuer" in warning.msg
    with override_settings(CELERY_BEAT_SCHEDULER="taskplatform.beat.LockedScheduler"):
        assert check_maintenance() == []
    with override_settings(TASKPLATFORM_WORKER_MAINTENANCE=True):
        assert check_maintenance() == []


# --- found by the review of issue 14: a rescuer that never comes back -------------------------------


def test_a_candidate_whose_database_connection_was_cut_gets_the_lease_back():
    """The database lock backend uses the maintenance thread's own connection. Once the server
    closed it (a restart, a failover, ``pg_terminate_backend``), every later look failed with
    "the connection is closed" and no process took the duties again."""
    import psycopg
    from django.db import connection

    from taskplatform.conf import platform_settings
    from taskplatform.scheduling.maintenance import MaintenanceLease

    conf = platform_settings()
    holder_lease, candidate = MaintenanceLease(conf, "holder"), MaintenanceLease(conf, "candidate")
    assert holder_lease.holds() and not candidate.holds()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    settings_dict = connection.settings_dict
    params = {"host": settings_dict["HOST"], "port": settings_dict["PORT"] or 5432, "user": settings_dict["USER"]}
    with psycopg.connect(**params, dbname=settings_dict["NAME"], autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    candidate._checked = float("-inf")
    assert not candidate.holds()  # the dead connection fails this look
    holder_lease.lease = None  # the holder is gone; its lease is freed at once here
    get_lock_backend().force_release(MAINTENANCE_LOCK)
    candidate._checked = float("-inf")
    assert candidate.holds(), "the next look must work on a fresh connection"
    candidate.release()


def test_the_maintenance_thread_outlives_an_error_in_its_look():
    """A misnamed lock alias raised in ``holds()``, outside the loop's ``try``: the thread died
    one second after the worker started and the fleet had no rescuer."""
    from taskplatform.conf import platform_settings
    from taskplatform.scheduling.maintenance import Maintenance

    calls: list[int] = []

    def leading() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the first look fails")
        return False

    with override_settings(TASKPLATFORM_RESCUE_INTERVAL_SECONDS=1):
        thread = Maintenance(platform_settings(), is_leading=leading)
        thread.start()
        try:
            wait_for(lambda: len(calls) >= 3, timeout=10, what="three looks")
            assert thread.is_alive()
        finally:
            thread.stop()


def test_two_deployments_on_one_lock_server_each_have_their_own_maintenance_lease():
    from taskplatform.conf import platform_settings
    from taskplatform.scheduling.maintenance import MaintenanceLease, maintenance_lock_name

    first = MaintenanceLease(platform_settings(), "shop")
    assert first.holds() and maintenance_lock_name(platform_settings()) == MAINTENANCE_LOCK
    with override_settings(TASKPLATFORM_BEAT_LOCK_NAME="billing.beat"):
        conf = platform_settings()
        assert maintenance_lock_name(conf) == "billing.beat:maintenance"
        second = MaintenanceLease(conf, "billing")
        assert second.holds(), "another deployment's rescuer runs too"
        second.release()
    first.release()


# --- found by the review of issue 14: a pass longer than the lease ----------------------------


def _expired_rows(n: int) -> list[Execution]:
    """``n`` RUNNING rows on their last attempt whose lease ran out: the rescuer dead-letters
    each (nothing is published)."""
    from datetime import timedelta

    from django.utils import timezone

    from taskplatform.core import ledger

    rows = []
    for i in range(n):
        row, _ = ledger.create(
            ledger.NewExecution(idempotency_key=f"long-pass:{i}", task_name="testapp.effect", args=[], kwargs={})
        )
        claim = ledger.claim(row, worker="gone:1", celery_task_id=f"t-{i}", lease_seconds=30, max_attempts=1)
        assert claim is not None and claim.outcome == "claimed"
        rows.append(row)
    Execution.objects.filter(pk__in=[r.pk for r in rows]).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        max_attempts=1,  # the row's own budget: spent
    )
    return rows


@override_settings(TASKPLATFORM_BEAT_LEASE_SECONDS=3, TASKPLATFORM_RESCUE_INTERVAL_SECONDS=1)
def test_a_rescuer_pass_longer_than_the_lease_keeps_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease (3 s here) was renewed only between passes: a pass of 4.8 s lost it at 3 s and
    another candidate took the duties while the first still ran, two rescuers at once. The pass
    renews it now; every row is handled, and no other candidate gets the lease meanwhile."""
    from taskplatform.conf import platform_settings
    from taskplatform.core import ledger, rescuer
    from taskplatform.scheduling.maintenance import Maintenance

    rows = _expired_rows(8)
    taken_by_other: list[bool] = []
    slow = ledger.rescue_expired

    def slow_rescue(execution: Execution, **kwargs: Any) -> str:
        time.sleep(0.6)  # the work of a large pass, 0.6 s a row (not a synchronisation)
        # Meanwhile a second candidate tries for the lease, as another worker's thread would.
        other = get_lock_backend().acquire(MAINTENANCE_LOCK, 3, identity="other-candidate")
        taken_by_other.append(other is not None)
        return slow(execution, **kwargs)

    monkeypatch.setattr(rescuer.ledger, "rescue_expired", slow_rescue)
    thread = Maintenance(platform_settings(), is_leading=lambda: True)
    thread.start()
    try:
        wait_for(
            lambda: Execution.objects.filter(pk__in=[r.pk for r in rows], state="FAILED").count() == 8,
            timeout=30, what="every expired row dead-lettered",
        )  # fmt: skip
    finally:
        thread.stop()
    assert len(taken_by_other) == 8
    assert not any(taken_by_other), f"another candidate took the lease during the pass: {taken_by_other}"


@override_settings(TASKPLATFORM_BEAT_LEASE_SECONDS=3, TASKPLATFORM_RESCUE_INTERVAL_SECONDS=1)
def test_a_rescuer_pass_ends_once_its_lease_is_someone_elses(monkeypatch: pytest.MonkeyPatch) -> None:
    from taskplatform.conf import platform_settings
    from taskplatform.core import ledger, rescuer
    from taskplatform.scheduling.maintenance import Maintenance

    rows = _expired_rows(8)
    handled: list[int] = []
    real = ledger.rescue_expired

    def losing_rescue(execution: Execution, **kwargs: Any) -> str:
        time.sleep(0.5)  # the work of a large pass, 0.5 s a row (not a synchronisation)
        handled.append(execution.pk)
        if len(handled) == 2:  # the lease is lost (an operator's release, say) and another takes it
            get_lock_backend().force_release(MAINTENANCE_LOCK)
            assert get_lock_backend().acquire(MAINTENANCE_LOCK, 30, identity="other-candidate") is not None
        return real(execution, **kwargs)

    monkeypatch.setattr(rescuer.ledger, "rescue_expired", losing_rescue)
    thread = Maintenance(platform_settings(), is_leading=lambda: True)
    thread.start()
    try:
        wait_for(lambda: (holder() or "").startswith("other-candidate#"), timeout=20, what="the lease lost")
        # The thread's next renewal (a third of the lease, 1 s) finds the lease gone and ends the pass.
        wait_for(lambda: thread.lease.lease is None, timeout=10, what="the thread seeing the loss")
    finally:
        thread.stop()
    assert len(handled) < 8, "the pass went on after the lease was someone else's"
    left = Execution.objects.filter(pk__in=[r.pk for r in rows], state="RUNNING").count()
    assert left == 8 - len(handled)
    get_lock_backend().force_release(MAINTENANCE_LOCK)


def test_a_pass_stopped_by_a_lost_lease_takes_no_snapshot_and_stop_ends_a_long_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review of issue 14: a pass that ended because the lease was another's went on to take
    the counts snapshot (two processes' snapshots at once), and ``stop()`` did not end a long
    pass (its 30 s join ran out and the lease was not released)."""
    from taskplatform.conf import platform_settings
    from taskplatform.core import ledger, rescuer
    from taskplatform.models import CountsSnapshot
    from taskplatform.scheduling import maintenance
    from taskplatform.scheduling.maintenance import Maintenance

    rows = _expired_rows(6)
    handled: list[int] = []
    real = ledger.rescue_expired
    snapshots: list[int] = []
    monkeypatch.setattr(maintenance.CountsSnapshot, "take", classmethod(lambda cls: snapshots.append(1)))

    def slow_rescue(execution: Execution, **kwargs: Any) -> str:
        time.sleep(0.5)  # the work of a large pass (not a synchronisation)
        handled.append(execution.pk)
        return real(execution, **kwargs)

    monkeypatch.setattr(rescuer.ledger, "rescue_expired", slow_rescue)
    with override_settings(TASKPLATFORM_RESCUE_INTERVAL_SECONDS=1):
        thread = Maintenance(platform_settings(), is_leading=lambda: True)
        thread.start()
        wait_for(lambda: len(handled) >= 1, timeout=20, what="the pass under way")
        started = time.monotonic()
        thread.stop()
        stopped_in = time.monotonic() - started
    assert not thread.is_alive() and stopped_in < 5, f"stop() waited {stopped_in:.1f} s for the pass"
    assert len(handled) < len(rows), "the pass went on after stop()"
    assert snapshots == [], "a pass that stopped early went on to the snapshot"
    assert holder() is None, "the stopped thread released the lease"
    assert CountsSnapshot.objects.count() == 0


@override_settings(TASKPLATFORM_RESCUE_INTERVAL_SECONDS=1, TASKPLATFORM_PRUNE_INTERVAL_SECONDS=3600)
def test_a_pruning_backlog_is_worked_off_in_passes_one_after_another_not_one_an_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a million executions, one pass of a minute an hour pruned about 250,000 rows an
    hour, far behind a sustained load. A pass that leaves a backlog is followed by another at
    the thread's next look. Here a pass prunes one batch of 10, the interval is an hour, and
    35 expired rows all go (with their events) in a few seconds; the rescuer runs between
    the passes."""
    from datetime import timedelta

    from django.utils import timezone

    from taskplatform.conf import platform_settings
    from taskplatform.scheduling import maintenance
    from taskplatform.scheduling.maintenance import Maintenance

    monkeypatch.setattr(maintenance, "PRUNE_BATCH", 10)
    monkeypatch.setattr(maintenance, "PRUNE_PASS_SECONDS", 0.0)  # one batch a pass
    monkeypatch.setattr(maintenance, "FIRST_PRUNE_SECONDS", 0.0)
    finished = timezone.now() - timedelta(days=40)
    old = [
        Execution.objects.create(idempotency_key=f"old:{i}", task_name="testapp.effect", state="SUCCEEDED",
                                 finished_at=finished)
        for i in range(35)
    ]  # fmt: skip
    ExecutionEvent.objects.bulk_create(ExecutionEvent(execution=e, kind="succeeded", at=finished) for e in old)
    expired = _expired_rows(1)[0]
    thread = Maintenance(platform_settings(), is_leading=lambda: True)
    thread.start()
    try:
        wait_for(
            lambda: not Execution.objects.filter(idempotency_key__startswith="old:").exists(),
            timeout=20, what="the whole backlog pruned, an interval of an hour notwithstanding",
        )  # fmt: skip
        wait_for(lambda: state_of(expired.pk) == "FAILED", timeout=10, what="the rescuer's pass between the prunes")
    finally:
        thread.stop()
    assert not ExecutionEvent.objects.filter(execution_id__in=[e.pk for e in old]).exists()
    get_lock_backend().force_release(MAINTENANCE_LOCK)
