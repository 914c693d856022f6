"""Scenario 27, the mid-run jump: a host's wall clock steps ±10 minutes (an NTP step, a VM
resumed from a snapshot) while the beat leads or while a worker runs a body.

The process runs under libfaketime with a timestamp file (``FAKETIME_TIMESTAMP_FILE``,
re-read on every call with ``FAKETIME_NO_CACHE=1``); the test rewrites the file to jump the
process's wall clock, its monotonic clock left alone (``FAKETIME_DONT_FAKE_MONOTONIC``, as in
``tests/chaos/test_clocks.py``). The database's clock decides (``docs/reliability.md``,
'Which clock decides'): the beat's "now" between two measurements advances by the monotonic
clock, leases and a retry's due time are the database's instants.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import BeatProcess, Execution, ExecutionEvent, JobDefinition
from tests.beat.test_ha import broker_messages, every_second_job, leader_pid
from tests.chaos.test_clocks import skewed
from tests.conftest import broker_url, redis_flushdb
from tests.helpers import event_kinds, state_of, wait_for
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.scenario(27), pytest.mark.fault, pytest.mark.timeout(180)]

JUMP = {"+10min": 600, "-10min": -600}


class JumpableClock:
    """The wall clock of the processes started with ``env``: set it with ``jump(seconds)``."""

    def __init__(self, faketime_lib: Path, path: Path) -> None:
        self.path = path
        self.env = {
            "LD_PRELOAD": str(faketime_lib),
            "FAKETIME_TIMESTAMP_FILE": str(path),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }
        self.jump(0)

    def jump(self, seconds: int) -> None:
        """Offset the wall clock by ``seconds`` from the real one, from the next clock read on."""
        staged = self.path.with_suffix(".new")
        staged.write_text(f"{seconds:+d}s\n")
        staged.replace(self.path)  # atomic: a reader never sees a half-written file


@pytest.fixture
def jumpable_clock(faketime_lib: Path, tmp_path: Path) -> Iterator[JumpableClock]:
    yield JumpableClock(faketime_lib, tmp_path / "faketime")


def db_now() -> datetime:
    with connection.cursor() as cur:
        cur.execute("SELECT STATEMENT_TIMESTAMP()" if connection.vendor == "postgresql" else "SELECT CURRENT_TIMESTAMP")
        value = cur.fetchone()[0]
    return value if timezone.is_aware(value) else timezone.make_aware(value, UTC)


def starts(key: str) -> int:
    return EffectRaw.objects.filter(key=key, phase="started").count()


# --- the beat ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("jump", list(JUMP))
def test_a_beat_whose_clock_jumps_between_syncs_publishes_each_slot_on_time(beats, jumpable_clock, figures, jump):
    """The leader's wall clock jumps ±10 min a few seconds after it measured the database's
    clock, and long before its next measurement (sync every 60 s). Every slot is still
    published at its time by the database's clock: none early, none held back, one message each."""
    seconds = JUMP[jump]
    sync_seconds = 60
    redis_flushdb(broker_url())
    job = every_second_job(f"jumping-beat-{seconds:+d}")
    beat = beats.start(env={**jumpable_clock.env, "TASKPLATFORM_BEAT_SYNC_SECONDS": str(sync_seconds)})
    wait_for(lambda: leader_pid() == beat.pid, timeout=60, what="the beat to lead")
    led = time.monotonic()  # the leader measured the database's clock just before this

    first_seen: dict[str, datetime] = {}  # slot key -> when this (unjumped) process first saw it
    beat_skew: list[float] = []  # the leader's wall clock minus ours, from its heartbeat row

    def observe(for_seconds: float) -> None:
        deadline = time.monotonic() + for_seconds
        while time.monotonic() < deadline:  # observation, not synchronisation: every 50 ms
            now = timezone.now()
            for key in Execution.objects.filter(job=job).values_list("idempotency_key", flat=True):
                first_seen.setdefault(key, now)
            seen = BeatProcess.objects.filter(is_leader=True).values_list("last_seen_at", flat=True).first()
            if seen is not None:
                beat_skew.append((seen - now).total_seconds())
            time.sleep(0.05)

    observe(3)
    before = dict(first_seen)
    jumpable_clock.jump(seconds)
    jumped = timezone.now()
    observe(10)
    while not beat_skew or abs(beat_skew[-1] - seconds) > 30:  # the heartbeat is every 5 s
        assert time.monotonic() - led < 25, f"the beat's clock never showed the jump: {beat_skew[-3:]}"
        observe(1)
    observed_until = timezone.now()
    elapsed = time.monotonic() - led
    assert elapsed < sync_seconds - 10, f"observed {elapsed:.0f} s: a sync may have measured the jump"
    assert "off the database's" not in beat.log(), "a sync measured the jumped clock: the jump was not between syncs"

    rows = dict(
        Execution.objects.filter(idempotency_key__in=first_seen).values_list("idempotency_key", "scheduled_for")
    )
    early = {key: (slot - first_seen[key]).total_seconds() for key, slot in rows.items()}
    early = {key: lead for key, lead in early.items() if lead > 0.5}
    # Slots due after the jump: each one first seen (late), or still missing at the end.
    slots_after = sorted(slot for slot in rows.values() if slot > jumped)
    grid = [jumped.replace(microsecond=0) + timedelta(seconds=k) for k in range(1, 60)]
    grid = [slot for slot in grid if slot <= observed_until - timedelta(seconds=2)]
    by_slot = {slot: first_seen[key] for key, slot in rows.items()}
    lateness = [((by_slot.get(slot) or observed_until) - slot).total_seconds() for slot in grid]
    beats.stop_all()
    messages = broker_messages()
    # The leader's rescuer judges a row's republish time by the database's clock: after a
    # forward jump it must not re-publish the rows created before it (it did, 5 minutes early,
    # while it used its host's clock).
    republished = Counter(
        ExecutionEvent.objects.filter(execution__job=job, kind="republished").values_list(
            "execution__idempotency_key", flat=True
        )
    )
    by_beat = {key: n - republished[key] for key, n in messages.items()}
    figures.record(
        slots=len(rows),
        slots_after_jump=len(slots_after),
        early=len(early),
        late_max_s=max(lateness, default=0.0),
        messages_per_slot=max(by_beat.values(), default=0),
        republished_by_rescuer=sum(republished.values()),
        beat_clock_jump_s=round(beat_skew[-1]),
    )
    assert len(before) >= 2, f"only {len(before)} slot(s) before the jump"
    assert not early, f"{len(early)} slot(s) published early, e.g. {sorted(early.items())[:3]}"
    assert len(grid) >= 5 and max(lateness) < 2.0, f"slots after the jump held back: lateness {lateness}"
    published = set(Execution.objects.filter(job=job).values_list("idempotency_key", flat=True))
    assert set(by_beat) == published and set(by_beat.values()) == {1}, f"not one message per slot: {by_beat}"
    assert not republished, f"the rescuer re-published rows before their time: {republished}"


# --- the worker ----------------------------------------------------------------------------------


def worker_clock_skew(execution_id: int) -> float:
    """The worker's wall clock minus the database's, read from the row it last wrote (each
    lease renewal stamps ``updated_at`` with the worker's clock)."""
    updated_at = Execution.objects.values_list("updated_at", flat=True).get(pk=execution_id)
    return (updated_at - db_now()).total_seconds()


@pytest.mark.slow
@pytest.mark.parametrize("jump", list(JUMP))
def test_a_worker_whose_clock_jumps_mid_body_keeps_its_lease_and_runs_once(
    workers, poll, jumpable_clock, figures, jump
):
    """A body three times its lease long; the worker's wall clock jumps ±10 min a second into
    it. The lease is the database's instant, renewed by the monotonic clock: never rescued,
    one body start, one effect."""
    seconds = JUMP[jump]
    workers.start(concurrency=1, env=jumpable_clock.env)
    job = JobDefinition.objects.create(slug=f"jumping-worker-{seconds:+d}", task="testapp.effect", lease_seconds=3)
    execution = submit(job, kwargs={"seconds": 9})
    poll(lambda: starts(execution.idempotency_key) == 1, timeout=60, what="body started")
    jumpable_clock.jump(seconds)
    rescued = 0

    def skew_shows_the_jump() -> bool:
        nonlocal rescued
        rescued += run_rescuer().rescued
        return abs(worker_clock_skew(execution.pk) - seconds) < 30

    poll(skew_shows_the_jump, timeout=30, interval=0.25, what="a lease renewal stamped with the jumped clock")
    skew = worker_clock_skew(execution.pk)
    assert state_of(execution.pk) == "RUNNING", "the jump did not land mid-body"

    def finished() -> bool:
        nonlocal rescued
        rescued += run_rescuer().rescued
        return state_of(execution.pk) == "SUCCEEDED"

    poll(finished, timeout=90, interval=0.25, what="success")
    body_starts = starts(execution.idempotency_key)
    effects = Effect.objects.filter(key=execution.idempotency_key).count()
    figures.record(executions=1, body_starts=body_starts, effects=effects, rescued=rescued, worker_clock_jump_s=skew)
    assert rescued == 0, "a live attempt on a worker whose clock jumped was rescued"
    assert event_kinds(execution.pk) == ["claimed", "succeeded"]
    assert (body_starts, effects) == (1, 1)


@pytest.mark.parametrize("offset", ["+600s", "-600s"])
def test_a_retry_scheduled_by_a_worker_whose_clock_is_off_is_due_by_the_databases_clock(
    workers, poll, faketime_lib, figures, offset
):
    """The worker's clock is 10 min ahead (or behind) when the first attempt fails with a
    3-second backoff. The retry is due 3 s later by the database's clock: not 10 min late
    (the claim would turn it away as early until then), not 10 min overdue (any worker could
    run it at once, the backoff ignored)."""
    backoff = 3
    worker = workers.start(concurrency=1, env=skewed(faketime_lib, offset))
    job = JobDefinition.objects.create(
        slug=f"retry-skewed-{offset}",
        task="testapp.fails_then_succeeds",
        backoff_base_seconds=backoff,
        backoff_max_seconds=backoff,
        jitter=False,
    )
    execution = submit(job, kwargs={"failures": 1})
    key = execution.idempotency_key
    row = poll(
        lambda: Execution.objects.filter(pk=execution.pk, state="RETRYING").first(),
        timeout=60,
        interval=0.02,
        what="the retry scheduled",
    )
    observed = time.monotonic()
    assert row.scheduled_for is not None
    due_in = (row.scheduled_for - db_now()).total_seconds()
    retry_late_s: float | None = None
    try:
        assert -1 < due_in <= backoff + 0.5, f"the retry is due in {due_in:.0f} s by the database's clock"

        def second_start() -> bool:
            run_rescuer()
            return starts(key) == 2

        poll(second_start, timeout=60, interval=0.05, what="the retry's body start")
        retry_late_s = time.monotonic() - observed - due_in
        poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="success on attempt 2")
    finally:
        figures.record(
            executions=1,
            body_starts=starts(key),
            retry_due_in_s=due_in,
            retry_late_s=retry_late_s,
            early_deliveries=event_kinds(execution.pk).count("early_delivery"),
        )
    assert worker.alive()
    assert event_kinds(execution.pk) == ["claimed", "retry_scheduled", "claimed", "succeeded"]
    assert retry_late_s < 3, f"the retry ran {retry_late_s:.1f} s after its due time"
