"""Beat faults of the catalogue (scenarios 22, 24, 28, 31), with real ``celery beat`` processes.

Every slot is counted where nothing can hide a double: as broker messages per slot key
(``tests/beat/test_ha.py``), and, where a worker runs the slots, as body starts and effects in
tables without a unique constraint. Faults inside a beat are ``os._exit(1)`` at a chosen
call (``tests/testapp/faults.py``, armed by ``TP_FAULT_AT`` in that beat's environment only).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import Counter
from datetime import datetime
from typing import Any

import pytest
import redis
from django.utils import timezone

from taskplatform.models import EventKind, Execution, ExecutionEvent, JobDefinition
from tests.beat.test_ha import (
    SECOND,
    assert_every_slot_once,
    every_second_job,
    leader_pid,
    slots_of,
    wait_until,
)
from tests.conftest import BeatFactory, RedisServer, Worker, WorkerFactory
from tests.helpers import wait_for
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.fault, pytest.mark.django_db(transaction=True)]

#: Fast rescue for the scenarios that need it: a row not claimed 10 s after its publication
#: is published again, and the leader's rescuer looks every second.
FAST_RESCUE = {"TASKPLATFORM_REPUBLISH_AFTER_SECONDS": "10", "TASKPLATFORM_RESCUE_INTERVAL_SECONDS": "1"}


# --- observation --------------------------------------------------------------------------------


class BrokerTap:
    """Every message pushed onto a (private) Redis broker's queues, counted per slot key.

    ``MONITOR`` shows each command the server executes, so a message is counted when it is
    published even if a worker consumes it a millisecond later: with a worker running,
    the queue's length says nothing about how often a slot was published.
    """

    KEY = re.compile(r'"tp_(?:key|slot)": "([^"]+)"')

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.counts: Counter[str] = Counter()
        self._monitor: Any = None
        self._thread = threading.Thread(target=self._run, name="broker-tap", daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> BrokerTap:
        self._thread.start()
        assert self._ready.wait(10), "MONITOR did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self._monitor.connection.disconnect()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with contextlib.suppress(Exception), self.client.monitor() as monitor:
            self._monitor = monitor
            self._ready.set()
            while True:
                command = monitor.next_command()["command"]
                if command[:5].upper() in ("LPUSH", "RPUSH"):
                    self.counts[self._slot(command)] += 1

    def _slot(self, command: str) -> str:
        try:
            headers = json.loads(command.split(" ", 2)[2])["headers"]
            return str(headers.get("tp_key") or headers["tp_slot"])
        except (ValueError, KeyError, IndexError):
            found = self.KEY.search(command)
            return found.group(1) if found else f"unparsed: {command[:80]}"


def fault_key(beat: Worker, beats: BeatFactory) -> str:
    """The key of the slot a ``TP_FAULT_AT`` fault hit, as the dying beat wrote it."""
    found = re.search(r"TP_FAULT fired at \S+ call \d+ key=(\S+)", beats.err(beat))
    assert found, f"the fault did not fire in {beat.name}:\n{beats.err(beat)[-2000:]}"
    return found.group(1)


def first_publication_after(job: JobDefinition, moment: datetime) -> datetime | None:
    return (
        Execution.objects.filter(job=job, created_at__gt=moment)
        .order_by("created_at")
        .values_list("created_at", flat=True)
        .first()
    )


# --- scenario 22: a beat crash between a slot's claim and its publication ---------------------------

CRASH_POINTS = {
    # The slot's execution row is inserted and its cursor moved, in a transaction not committed.
    "before_commit": "taskplatform.scheduling.scheduler:submit:after",
    # The transaction committed (row and cursor), the message is not published yet (the outbox's gap).
    "after_commit_before_publish": "taskplatform.core.publisher:publish:before",
    # The message is on the broker; the process dies before anything else.
    "after_publish": "taskplatform.core.publisher:publish:after",
}


@pytest.mark.scenario(22)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_a_leader_crash_around_a_slots_publication_neither_loses_nor_doubles_it(
    beats: BeatFactory, workers: WorkerFactory, private_redis: RedisServer, figures: Any, point: str
) -> None:
    """The leader dies (``os._exit``) at the 4th slot it handles, at ``point``; a follower
    takes over. The slot is then published exactly once: by the successor from the cursor
    (the transaction rolled back), by the successor's rescuer (the row committed without a
    message: it is ``PENDING`` past its republish time), or not again (it was published).

    The broker is a private Redis watched with ``MONITOR``, so every publication is counted,
    and a worker runs every slot: body starts and effects are counted per slot too.
    """
    job = every_second_job(f"crash-{point.replace('_', '-')}")
    broker = private_redis.url
    env = {**FAST_RESCUE}
    with BrokerTap(broker) as tap:
        workers.start(broker=broker, concurrency=2)
        doomed = beats.start(broker=broker, env={**env, "TP_FAULT_AT": CRASH_POINTS[point], "TP_FAULT_SKIP": "3"})
        wait_for(lambda: leader_pid() == doomed.pid or not doomed.alive(), timeout=60, what="the doomed beat to lead")
        successor = beats.start(broker=broker, env=env)
        wait_for(lambda: not doomed.alive(), timeout=60, what="the fault to fire")
        crashed_at = timezone.now()
        key = fault_key(doomed, beats)
        first = slots_of(job)[0]

        resumed = wait_for(lambda: first_publication_after(job, crashed_at), timeout=60, what="the successor")
        assert leader_pid() == successor.pid
        fault_slot = Execution.objects.filter(idempotency_key=key)
        wait_for(
            lambda: fault_slot.filter(state="SUCCEEDED").exists(),
            timeout=60,
            what=f"the slot the fault hit ({key}) to run",
        )
        recovered = timezone.now()
        wait_until(recovered + 2 * SECOND, "slots after the recovery")
        beats.stop_all()
        executions = Execution.objects.filter(job=job)
        wait_for(lambda: not executions.exclude(state="SUCCEEDED").exists(), timeout=60, what="every slot to run")
        keys = sorted(executions.values_list("idempotency_key", flat=True))
        wait_for(lambda: set(keys) <= set(tap.counts), timeout=10, what="the tap to see every publication")
        messages = {k: tap.counts[k] for k in keys}

    last = max(slots_of(job))
    assert_every_slot_once(slots_of(job), first, last)  # no slot lost, none doubled in the ledger
    starts = Counter(EffectRaw.objects.filter(key__in=keys, phase="started").values_list("key", flat=True))
    effects = Counter(Effect.objects.filter(key__in=keys).values_list("key", flat=True))
    doubled = {k: n for k, n in messages.items() if n != 1}
    republished = ExecutionEvent.objects.filter(execution__idempotency_key=key, kind=EventKind.REPUBLISHED).count()
    figures.record(
        executions=len(keys),
        body_starts=sum(starts.values()),
        effects=sum(effects.values()),
        lost=0,
        duplicates=sum(n - 1 for n in messages.values() if n > 1),
        messages_of_fault_slot=messages[key],
        rescuer_publications_of_fault_slot=republished,
        failover_s=(resumed - crashed_at).total_seconds(),
        recovery_s=(recovered - crashed_at).total_seconds(),
    )
    assert not doubled, f"slot(s) published more than once (or never): {doubled}"
    assert starts == Counter(keys) and effects == Counter(keys), "a slot's body ran twice (or never)"
    # Who published the slot the fault hit.
    if point == "after_commit_before_publish":
        assert republished == 1, "the committed, unpublished slot was not published by the rescuer"
    else:
        assert republished == 0
    if point == "before_commit":
        created = Execution.objects.values_list("created_at", flat=True).get(idempotency_key=key)
        assert created > crashed_at, "the rolled-back slot should have been published by the successor"
