"""G1/G6: work survives killed workers, and poison messages stop.

Every signal goes to a process this test started (a worker from the ``workers`` fixture or
one of its pool children). Side effects are counted in two tables, neither with a unique
constraint: ``Effect`` (committed effects: must be exactly one per execution) and ``EffectRaw``
(every attempt that reached the body).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from taskplatform import submit
from taskplatform.conf import platform_settings
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution
from tests.helpers import event_kinds, state_of, tally
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.chaos, pytest.mark.worker, pytest.mark.fault]


def running_pid(key: str, poll) -> int:
    raw = poll(lambda: EffectRaw.objects.filter(key=key, phase="started").first(), timeout=30, what="body started")
    return int(raw.pid)


@pytest.mark.scenario(1)
def test_pool_child_killed_mid_body_completes_exactly_once(workers, poll, open_gate, figures):
    worker = workers.start(concurrency=2)
    execution = submit("testapp.effect", kwargs={"gate": "kill"})
    pid = running_pid(execution.idempotency_key, poll)
    assert pid in {child.pid for child in worker.pool_children()}, "only our own pool child is signalled"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    open_gate("kill:2")  # let the next attempt through

    # reject_on_worker_lost re-queues the message; the new attempt sees the previous
    # owner (same node) is dead and takes over without waiting for the lease.
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="success after the kill")
    figures.record(**tally([execution]), recovery_s=time.monotonic() - killed)
    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 2 and row.fencing_token == 2
    assert "taken_over" in event_kinds(execution.pk)
    assert EffectRaw.objects.filter(key=execution.idempotency_key, phase="started").count() == 2
    assert Effect.objects.filter(key=execution.idempotency_key).count() == 1
    assert Effect.objects.get(key=execution.idempotency_key).fencing_token == 2


def start_effect(how: str, gate: str, poll) -> Execution:
    """``testapp.effect`` through ``submit()`` (the row first) or a plain ``.delay()`` (the
    worker creates the row already claimed); its execution once it exists."""
    if how == "submit":
        return submit("testapp.effect", kwargs={"gate": gate})
    from tests.testapp.tasks import effect

    message = effect.delay(gate=gate)
    return poll(lambda: Execution.objects.filter(idempotency_key=message.id).first(), timeout=30, what="the row")


@pytest.mark.scenario(2)
@pytest.mark.parametrize("how", ["submit", "delay"])
def test_worker_main_process_killed_is_rescued_after_its_lease_and_completes_once(
    workers, poll, open_gate, figures, how
):
    """The worker's main process is SIGKILLed while a body runs: its pool children die with it,
    the message stays unacknowledged in Redis (an hour), and the rescuer takes the attempt
    back when its lease runs out. Also for a plain ``.delay()``, whose row the worker created
    already claimed: a running row with an expired lease is rescued like any other."""
    worker = workers.start(concurrency=2)
    execution = start_effect(how, "main", poll)
    pid = running_pid(execution.idempotency_key, poll)
    children = worker.pool_children()
    assert pid in {c.pid for c in children}
    os.kill(worker.pid, signal.SIGKILL)
    killed = time.monotonic()
    # Linux pool children die with their parent (PR_SET_PDEATHSIG); wait for it.
    poll(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), timeout=30)
    open_gate("main:2")

    workers.start(concurrency=2)

    # The message sits unacked in Redis until the visibility timeout (an hour); the
    # ledger does not wait for it: the lease (6 s in tests) expires and the rescuer re-queues.
    def rescued_and_done() -> bool:
        run_rescuer()
        return state_of(execution.pk) == "SUCCEEDED"

    poll(rescued_and_done, timeout=60, interval=0.5, what="rescue and success")
    figures.record(
        **tally([execution]), recovery_s=time.monotonic() - killed, lease_s=platform_settings().lease_seconds
    )
    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 2
    assert "rescued" in event_kinds(execution.pk)
    assert EffectRaw.objects.filter(key=execution.idempotency_key, phase="started").count() == 2
    assert Effect.objects.filter(key=execution.idempotency_key).count() == 1


@pytest.mark.scenario(15)
def test_a_poison_message_is_dead_lettered_after_its_attempts(workers, poll, figures):
    workers.start(concurrency=2)
    execution = submit("testapp.poison")  # kills its pool process on every attempt; max_retries=2
    poll(lambda: state_of(execution.pk) == "FAILED", timeout=90, interval=0.2, what="dead letter")
    row = Execution.objects.get(pk=execution.pk)
    figures.record(
        **tally([execution]), attempts=row.attempts, state=row.state, dead_letter_after_s=figures.since_start()
    )
    assert row.attempts == 3
    assert "attempts exhausted: 3 of 3" in row.last_error and "was lost" in row.last_error
    assert EffectRaw.objects.filter(key=execution.idempotency_key, phase="started").count() == 3
