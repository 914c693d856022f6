"""``LockedScheduler``: several ``celery beat`` processes, one leader, no slot twice, none missed.

Set ``CELERY_BEAT_SCHEDULER = "taskplatform.beat.LockedScheduler"`` (the documented alias of
this class) and run as many beats
as you like. django-celery-beat's tables stay the schedule store (its admin and API keep
working); a ``JobDefinition`` attaches to a ``PeriodicTask`` to give it a task, arguments
and policies. Each tick:

1. **Leadership.** Every process tries to hold the lease ``beat_lock_name`` on the lock
   backend. The holder renews it every tick; the others try every tick, so one takes over
   within about ``beat_lease_seconds + beat_tick_seconds`` of the leader's death. A leader
   that cannot renew keeps publishing only while its lease has more than
   ``beat_step_down_seconds`` left, as measured locally from before the grant.
2. **Slots.** Slot times come from the schedule alone (``scheduling.slots``), never from
   the memory of a previous run, so every leader names the same slots.
3. **Publication.** Due slots go to the ledger as executions keyed
   ``"<job>@<slot UTC ISO-8601>"``, in one transaction with the entries' cursors and a
   check of the ``SchedulerFence`` row: the fence names the leader that last took over, so
   a leader paused past its lease that wakes up cannot publish once its successor has
   taken over, and two overlapping leaders still collapse onto one execution per slot
   through the key. Messages go out when the transaction commits; a message lost there is
   re-published by the rescuer (G1).
4. **Misfires.** Slots owed for longer than ``beat_misfire_grace_seconds`` (no leader
   ran) follow the job's policy: ``skip``, ``run_once`` (default) or ``catch_up``.

The leader is also a candidate for the platform's maintenance, in a thread of its own: while
it holds the maintenance lease (which a worker may hold instead), the rescuer every
``rescue_interval_seconds`` and ledger pruning every ``prune_interval_seconds``.
"""

from __future__ import annotations

import gc
import json
import logging
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connection, connections, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone
from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry

from ..backends import get_lock_backend
from ..backends.base import Lease, new_owner
from ..conf import platform_settings
from ..core import ledger
from ..core.publisher import publish_many_on_commit
from ..core.submission import slot_spec
from ..core.types import NewExecution
from ..exceptions import SubmissionError
from ..models import BeatProcess, Execution, JobDefinition, ScheduleCursor, SchedulerFence, Trigger
from ..observability.logs import execution_context
from .clock import DatabaseClock
from .config import configuration_problems
from .leadership import FencedOff, Leadership, check_fence, take_over_fence
from .maintenance import Maintenance
from .slots import plan_due, slot_key
from .table import ScheduleTable, SlotEntry

log = logging.getLogger("taskplatform.beat")


class _WarmUpStopped(Exception):
    """A follower's warm-up was asked to stop (this process takes over, or closes)."""


#: How often a beat process records itself in ``BeatProcess`` (for ``taskplatform status``).
HEARTBEAT_SECONDS = 5.0

#: Cursors written per transaction when the schedule is (re)loaded; the lease is renewed
#: (if due) before each, so a schedule of any size is taken over without losing it.
CURSOR_CHUNK = 1000
#: Cursors of a first load written per tick after its publication (``_write_unwritten``), by
#: database vendor: about 0.25 s of a tick on PostgreSQL at 20,000.
UNWRITTEN_PER_TICK = {"postgresql": 20_000}
UNWRITTEN_PER_TICK_ELSEWHERE = 5_000
#: Entries per statement when django-celery-beat's run columns are written (``_record_runs``).
RUNS_CHUNK = 500

#: The job columns a slot's publication does not read (``_commit_batch`` defers them).
_UNPUBLISHED_JOB_FIELDS = ("description", "retry_on", "fatal_errors", "created_at", "updated_at")

#: ``_write_cursors`` on PostgreSQL (the upsert the ORM's ``bulk_create`` makes elsewhere).
_WRITE_CURSORS_SQL = f"""
    INSERT INTO {ScheduleCursor._meta.db_table} (name, last_slot, fencing_token, updated_at)
    SELECT c.name, c.last_slot, %s, %s FROM unnest(%b::text[], %b::timestamptz[]) AS c(name, last_slot)
    ON CONFLICT (name) DO UPDATE SET last_slot = EXCLUDED.last_slot, fencing_token = EXCLUDED.fencing_token,
        updated_at = EXCLUDED.updated_at
"""

#: ``_record_runs`` on PostgreSQL: never backwards (a former leader's late write must not move
#: ``last_run_at`` back), the count added to.
_RECORD_RUNS_SQL = f"""
    UPDATE {PeriodicTask._meta.db_table} AS p
    SET last_run_at = GREATEST(COALESCE(p.last_run_at, r.last), r.last),
        total_run_count = p.total_run_count + r.count
    FROM jsonb_to_recordset(%s::jsonb) AS r(name text, last timestamptz, count integer)
    WHERE p.name = r.name
"""


#: The signals on which ``celery beat`` stops by raising an exception wherever its main thread is.
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def shutdown_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT until the block ends, then act on them.

    ``celery beat`` stops on these by raising ``SystemExit`` (``KeyboardInterrupt``) wherever
    its main thread is. Between a batch's commit and its last on-commit send, that would
    leave slots committed without their messages: a plain Celery entry's slot lost (its
    cursor moved; it has no ledger row to rescue) and a job's slot left to a later leader's
    rescuer, ``republish_after_seconds`` late. Every deploy sends that signal, so a batch's
    transaction and its sends go together and the signal is acted on right after them.
    Handlers can only be set in the main thread; elsewhere (a beat run in a thread) the
    block runs unguarded.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in SHUTDOWN_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for signum in held:
            signal.raise_signal(signum)


@dataclass
class TickStats:
    """Counters a beat keeps about itself (logged, reported in ``BeatProcess``, read by bench)."""

    ticks: int = 0
    published: int = 0
    dropped: int = 0
    dead_lettered: int = 0
    fenced: int = 0
    lateness: list[float] = field(default_factory=list)
    #: ``time.monotonic()`` when the first batch of slots was committed (bench: start-up).
    first_published_at: float | None = None


#: The identity shown in ``celery beat``'s banner (its ``lazy`` instance), taken by the
#: scheduler the same process then runs.
_banner_identity: str | None = None


_frozen_lock = threading.Lock()


def freeze_after_load(table: ScheduleTable) -> None:
    """After a full load of the schedule, collect the garbage and freeze what is left
    (``gc.freeze``): the entries live until the next load that changes them, and the collector
    no longer walks them. At 100,000 entries each full collection walked half a million objects
    for 0.3-0.6 s, a pause of the tick thread in the middle of publication (lateness); frozen,
    the collections of the 40 s after a start-up took 0.06 s in all instead of 0.78 s.

    Called after the tick's publication (not before the first one) and at the end of a
    follower's warm-up, once per full load. Frozen objects are still freed by reference
    counting: an entry a later load replaces goes (entries hold no reference cycles); only an
    object in a reference cycle that was alive at a freeze and is dropped later is not
    reclaimed (the collection before each freeze takes what was garbage then)."""
    loaded_at = table.full_load_at
    with _frozen_lock:
        if loaded_at is None or table.frozen_for == loaded_at:
            return
        table.frozen_for = loaded_at
        gc.collect()
        gc.freeze()


class LockedScheduler(DatabaseScheduler):
    """django-celery-beat's ``DatabaseScheduler`` with a leader lease and slot-keyed publication."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._closing = False
        self.conf = platform_settings()
        problems = configuration_problems(self.conf)
        if problems:
            raise ImproperlyConfigured("LockedScheduler cannot start:\n  - " + "\n  - ".join(problems))
        # ``celery beat`` builds a throwaway instance (``lazy=True``) for its start-up banner,
        # then the one that runs: the banner's identity is the one that will lead or follow.
        global _banner_identity
        if kwargs.get("lazy"):
            self.identity = _banner_identity = new_owner()
        else:
            self.identity, _banner_identity = _banner_identity or new_owner(), None
        self.table: ScheduleTable | None = None
        self.stats = TickStats()
        self._leading = False
        # Not ``_last_sync``: celery.beat.Scheduler uses that name for its own ``sync_every``.
        self._table_synced_at = float("-inf")
        self._last_heartbeat = float("-inf")
        self._reported_leading = False
        self._needs_full_load = False
        #: The entries of this term's first load whose cursors are still to be written (after
        #: its first publication: ``_write_unwritten``), and whether the fence says so.
        self._unwritten: list[tuple[str, datetime]] = []
        self._owed_marked = False
        self._started_at = timezone.now()
        #: The database's clock: slots are due by it, not by this host's (``scheduling.clock``).
        self.clock = DatabaseClock()
        self._maintenance: Maintenance | None = None
        #: Slots published since django-celery-beat's run columns were last written, per entry:
        #: (the latest slot, how many). Written every sync, not per slot (``_record_runs``).
        self._runs: dict[str, tuple[datetime, int]] = {}
        #: A follower's view of the schedule (``schedule``), re-read at most every sync.
        self._view: dict[str, SlotEntry] = {}
        self._view_at = float("-inf")
        #: A follower's schedule table, built and kept current in a thread of its own
        #: (``_warm_up``), so that a takeover does not start cold; the leader's at takeover.
        self._warm: ScheduleTable | None = None
        self._warm_lock = threading.Lock()
        self._warmer: threading.Thread | None = None
        self._warm_stop = threading.Event()
        self._warmed_at = float("-inf")
        backend = get_lock_backend(self.conf.beat_lock_alias)
        self.leadership = Leadership(backend, self.conf.beat_lock_name, self.identity, self.conf)
        super().__init__(*args, **kwargs)
        self.max_interval = self.conf.beat_tick_seconds

    # -- celery.beat.Scheduler interface --

    def setup_schedule(self) -> None:
        """Write ``CELERY_BEAT_SCHEDULE`` entries to the schedule tables (every beat may; races are benign)."""
        for name, fields in (self.app.conf.beat_schedule or {}).items():
            for _attempt in range(2):  # two beats starting at once race on update_or_create
                try:
                    ModelEntry.from_entry(name, app=self.app, **fields)
                    break
                except Exception as exc:  # the retry is the point
                    last = exc
            else:
                log.error("could not install beat_schedule entry %r: %s", name, last)

    @property
    def schedule(self) -> dict[str, Any]:
        """The entries, by name: the leader's table, or on a follower the schedule tables as the
        leader reads them (re-read at most every ``beat_sync_seconds``), for introspection."""
        if self.table is not None:
            return dict(self.table.entries)
        with self._warm_lock:
            warm = self._warm
        if warm is not None and warm.loaded_at is not None:
            return dict(warm.entries)
        if time.monotonic() - self._view_at >= self.conf.beat_sync_seconds:
            try:
                view = ScheduleTable(self.conf, self.app)
                view.load(timezone.now(), first=True)  # nothing is written: a follower only reads
                self._view, self._view_at = dict(view.entries), time.monotonic()
            except Exception as exc:  # introspection must not take the beat down
                log.warning("could not read the schedule: %s", exc)
        return dict(self._view)

    def sync(self) -> None:
        """Nothing to write back: cursors are written with each publication."""

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass of ``celery beat``'s loop; after ``close()``, ``SystemExit`` (the loop ends).

        ``celery beat`` stops by raising ``SystemExit`` from its signal handler wherever the main
        thread is. Inside a database call, Django's clean-up can replace it: a commit interrupted
        there has psycopg close the connection, and ``Atomic.__exit__`` then raises
        ``OperationalError`` from its ``finally``, which the tick handles as an outage. The beat
        ran on, closed, took the lease again and never exited (1 run in 10 of a SIGINT and a
        SIGTERM 20 ms apart, on a loaded host). A closed scheduler's next tick ends the loop."""
        if self._closing:
            raise SystemExit(f"beat {self.identity} was closed")
        with execution_context(fencing_token=self.leadership.token or None):
            return self._tick()

    def _tick(self) -> float:
        started = time.monotonic()
        self.stats.ticks += 1
        close_old_connections()  # drop a connection a database outage broke; reconnects lazily
        leading, acquired = self.leadership.step()
        if leading and acquired:
            leading = self._become_leader()
        elif not leading and self._leading:
            self._step_down()
        self._heartbeat(started)
        if not leading:
            self._warm_up()
            return self.conf.beat_tick_seconds
        assert self.table is not None
        try:
            if self._needs_full_load or started - self._table_synced_at >= self.conf.beat_sync_seconds:
                self.clock.measure(self.conf.beat_lock_name)  # once per sync: no round trip per tick
            now = self.clock.now()
            if self._needs_full_load:
                # Until one succeeds: a first load retried as an ordinary sync would not read
                # the cursors, nor queue the entries it had already built.
                self._sync_table(now, first=True)
                self._needs_full_load = False
            elif started - self._table_synced_at >= self.conf.beat_sync_seconds:
                self._sync_table(now, first=False)
            self._publish_due(now)
            self._write_unwritten()
            freeze_after_load(self.table)
        except FencedOff as exc:
            log.error("beat %s stops publishing: %s", self.identity, exc)
            self.stats.fenced += 1
            self.leadership.abdicate()
            self._step_down()
            return self.conf.beat_tick_seconds
        except Exception:
            # A database outage: keep the lease for as long as it can be trusted and retry.
            log.exception("beat tick failed; retrying next tick")
            close_old_connections()
            return min(self.conf.beat_tick_seconds, 0.5)
        next_due = self.table.next_due()
        sleep = self.conf.beat_tick_seconds
        if next_due is not None:
            sleep = min(sleep, max(0.0, (next_due - self.clock.now()).total_seconds()))
        return max(sleep, 0.01)

    def close(self) -> None:
        """Stop the maintenance duties, write the run columns, release the lease, once.

        ``celery beat`` calls this from its handler of each SIGINT and SIGTERM, and Ctrl-C under
        ``make run`` sends both, milliseconds apart. A signal handler runs wherever the main
        thread is, often inside a database call of the tick: ``close()``'s own statements on
        that same connection then waited for the interrupted one, and the beat hung (the review
        of issue 14 measured 1 hang in 6; a test here, 1 run in 3). So it runs once, with both
        signals held, and its database work runs on a thread of its own, on a connection of its
        own, which the main thread waits for."""
        if self._closing:
            return
        self._closing = True

        def close_on_own_connection() -> None:
            try:
                self._close()
            except Exception:
                log.exception("beat %s: closing failed (its lease expires by itself)", self.identity)
            finally:
                connections.close_all()  # this thread's connections

        with shutdown_held():
            closer = threading.Thread(target=close_on_own_connection, name="taskplatform-beat-close")
            closer.start()
            closer.join(timeout=60)

    def _close(self) -> None:
        self._stop_warm_up()
        if self._maintenance is not None:
            self._maintenance.stop()
        self._record_runs()
        # Held the lease, whether or not it had finished becoming the leader (a signal during
        # the first load): the lease is released either way, and the line says so.
        was_leading = self._leading or self.leadership.lease is not None
        self.leadership.release()
        self._leading = False
        try:
            BeatProcess.objects.filter(identity=self.identity).update(
                is_leader=False, stopped_at=timezone.now(), last_seen_at=timezone.now()
            )
        except Exception as exc:  # shutting down; the row just goes stale
            log.debug("could not record the beat's shutdown: %s", exc)
        if was_leading:
            log.info("beat %s released the lease", self.identity)
        super().close()

    @property
    def info(self) -> str:
        c = self.conf
        return (
            f"    . lock -> {c.beat_lock_name} on {type(self.leadership.backend).__name__} "
            f"(lease {c.beat_lease_seconds:g}s, tick {c.beat_tick_seconds:g}s)\n"
            f"    . identity -> {self.identity}"
        )

    # -- leadership transitions --

    def _become_leader(self) -> bool:
        lease = self.leadership.lease
        assert lease is not None
        try:
            take_over_fence(self.conf.beat_lock_name, lease, self._still_holds)
            self._needs_full_load = False  # a former term's: this takeover loads in full below
            self.table = self._stop_warm_up(renewing=True) or ScheduleTable(self.conf, self.app)
            self.clock.measure(self.conf.beat_lock_name)
            self._sync_table(self.clock.now(), first=True)
        except FencedOff as exc:
            log.error("beat %s cannot lead: %s", self.identity, exc)
            self.leadership.abdicate()
            self._keep_warm()
            return False
        except Exception:
            log.exception("beat %s could not take over the schedule; releasing the lease", self.identity)
            self.leadership.release()
            close_old_connections()
            self._keep_warm()
            return False
        self._leading = True
        self._maintenance = Maintenance(self.conf, is_leading=self.leadership.may_publish)
        self._maintenance.start()
        return True

    def _keep_warm(self) -> None:
        """After a takeover that did not happen: the table it had built (or was handed), if it
        holds entries, is the follower's warm table again; a follower has no ``table``."""
        with self._warm_lock:
            if self.table is not None and self.table.entries:
                self._warm = self.table
            self.table = None

    def _warm_up(self) -> None:
        """On a follower, every ``beat_sync_seconds``: bring the warm table up to date in a
        thread of its own (a first load of 100,000 entries takes seconds, and the tick must
        keep trying for the lease meanwhile). Nothing is written; an error is logged and the
        next look tries again. Each thread has its own stop flag: a thread a takeover gave up
        waiting for stays stopped, whatever later threads do."""
        if self._closing or (self._warmer is not None and self._warmer.is_alive()):
            return
        if time.monotonic() - self._warmed_at < self.conf.beat_sync_seconds:
            return
        self._warmed_at = time.monotonic()
        with self._warm_lock:
            table = self._warm or ScheduleTable(self.conf, self.app)
        self._warm_stop = stop = threading.Event()
        self._warmer = threading.Thread(
            target=self._warm_run, args=(table, stop), name="taskplatform-beat-warm-up", daemon=True
        )
        self._warmer.start()

    def _warm_run(self, table: ScheduleTable, stop: threading.Event) -> None:
        def keep_going() -> None:
            if stop.is_set():
                raise _WarmUpStopped

        try:
            started = time.monotonic()
            cold = table.loaded_at is None
            # By the database's clock, as the leader's loads: the change check compares stamps.
            self.clock.measure(self.conf.beat_lock_name)
            table.load(self.clock.now(), first=False, keep_alive=keep_going, entries_only=True)
            freeze_after_load(table)
            with self._warm_lock:
                if not stop.is_set():  # not after a takeover gave up waiting for it
                    self._warm = table
            if cold:
                log.info(
                    "beat %s (a follower) has the schedule table built: %d entries in %.1f s",
                    self.identity,
                    len(table.entries),
                    time.monotonic() - started,
                )
        except _WarmUpStopped:
            pass  # a load cut short leaves no baseline (``unchanged`` is False): a takeover reads the rows
        except Exception as exc:
            log.warning("beat %s could not warm up its schedule table (tried again): %s", self.identity, exc)
        finally:
            connections.close_all()  # this thread's connections

    def _stop_warm_up(self, *, renewing: bool = False) -> ScheduleTable | None:
        """Stop the warm-up and hand over its table. A load stops within a few hundred rows,
        but not inside its first query: it is waited for a third of the lease at most, the
        lease renewed meanwhile at a takeover (``renewing``), and past that a takeover starts
        cold, never with a table another thread is still writing. However this ends (a lease
        that can no longer be trusted raises ``FencedOff``), the table is no longer the warm
        one: a later warm-up starts on a table of its own."""
        self._warm_stop.set()
        warmer, self._warmer = self._warmer, None
        try:
            if warmer is not None:
                deadline = time.monotonic() + self.conf.beat_lease_seconds / 3
                while warmer.is_alive() and time.monotonic() < deadline:
                    warmer.join(timeout=0.1)
                    if renewing:
                        self._keep_alive()  # a takeover's lease is renewed while it waits
        finally:
            with self._warm_lock:
                table, self._warm = self._warm, None
            self._warmed_at = float("-inf")
        if warmer is not None and warmer.is_alive():
            log.warning("beat %s takes over cold: its warm-up did not stop in time", self.identity)
            return None
        return table

    def _still_holds(self) -> bool:
        lease = self.leadership.lease
        if lease is None:
            return False
        try:
            renewed = self.leadership.backend.renew(lease, self.conf.beat_lease_seconds)
        except Exception:
            return False
        if renewed is not None:
            self.leadership.lease = renewed
        return renewed is not None

    def _step_down(self) -> None:
        self._leading = False
        self._unwritten, self._owed_marked = [], False  # still owed from the fence's moment: the successor's
        with self._warm_lock:  # its entries are current: a follower's warm table (the rest is reset at takeover)
            self._warm, self.table = self.table, None
        self._record_runs()
        if self._maintenance is not None:
            self._maintenance.stop()
            self._maintenance = None
        log.warning("beat %s is a follower now", self.identity)

    # -- schedule and publication --

    def _keep_alive(self) -> None:
        """Renew the lease if due, in the middle of long work; ``FencedOff`` if it cannot be trusted.

        Called between chunks of a schedule load, of the cursor writes and of a backlog's
        publication: work longer than the lease (a first load of 100,000 entries takes
        seconds) must not outlast it, or every new leader loses the lease before it
        publishes anything, and so does each successor.
        """
        if not self.leadership.renew_if_due() or not self.leadership.may_publish():
            raise FencedOff("the lease can no longer be trusted")

    def _record_runs(self) -> None:
        """Write django-celery-beat's ``last_run_at`` (the latest slot published) and
        ``total_run_count`` of the entries published since the last call, which its own admin
        pages show. Every sync, in one ``bulk_update`` per 500 entries, not per slot: off the
        publication path, and no signal (so no schedule change is announced). Informational:
        a failure is logged and the counts wait for the next call."""
        if not self._runs:
            return
        runs, self._runs = self._runs, {}
        names = list(runs)
        try:
            if connection.vendor == "postgresql":
                # One statement per chunk, the values as one JSON parameter: bulk_update's
                # CASE over 800 names took 0.6 s every sync at 10,000 jobs, on the tick thread,
                # and was the whole of the publication lateness tail.
                for start in range(0, len(names), RUNS_CHUNK * 10):
                    chunk = names[start : start + RUNS_CHUNK * 10]
                    rows = [{"name": n, "last": runs[n][0].isoformat(), "count": runs[n][1]} for n in chunk]
                    with connection.cursor() as cursor:
                        cursor.execute(_RECORD_RUNS_SQL, [json.dumps(rows)])
                    for name in chunk:
                        runs.pop(name, None)
                return
            for start in range(0, len(names), RUNS_CHUNK):
                chunk = names[start : start + RUNS_CHUNK]
                tasks = list(PeriodicTask.objects.filter(name__in=chunk).only("id", "name"))
                for task in tasks:
                    last, count = runs[task.name]
                    # Never backwards: a former leader's late write must not move it back (an
                    # entry without a cursor starts from it).
                    task.last_run_at = Greatest(Coalesce(F("last_run_at"), Value(last)), Value(last))
                    task.total_run_count = F("total_run_count") + count
                PeriodicTask.objects.bulk_update(tasks, ["last_run_at", "total_run_count"])
                for name in chunk:  # written (or their entry is gone): not to be written again
                    runs.pop(name, None)
        except Exception as exc:
            log.warning("could not record the schedule's last runs (retried at the next sync): %s", exc)
            for name, (last, count) in runs.items():  # what was not written yet
                self._count_runs(name, last, count)

    def _count_runs(self, name: str, last: datetime, count: int) -> None:
        known = self._runs.get(name)
        self._runs[name] = (max(last, known[0]), count + known[1]) if known else (last, count)

    def _sync_table(self, now: datetime, *, first: bool) -> None:
        """Re-read the schedule and write the cursors it sets or drops before any publication
        from it; except a first load's (a takeover's), written after its first publication.

        A first start on 100,000 entries sets 100,000 cursors, about 1.3 s of writes. Before
        publishing, a first load writes one moment instead: where it starts the entries that
        have no cursor, with the highest row id it read (``SchedulerFence.cursors_owed_from``
        and ``cursors_owed_up_to_id``, kept whole if a predecessor left them). A successor that
        finds them starts those entries there too (``ScheduleTable._unseen_since``), so a
        leader killed right after its first publication loses no slot of theirs: deferring the
        writes without it lost 1,056 slots of the 100,000-job failover benchmark, whose kill
        follows the first publication. Only the cursors the moment covers wait
        (``ScheduleTable.split_owed``); any other start (a ``last_run_at``, a change time, a
        row created after the moment's load) is written before publishing, as before.
        ``_write_unwritten`` writes the rest after it, then clears the moment.
        """
        assert self.table is not None
        self._record_runs()
        resets, gone = self.table.load(now, first=first, keep_alive=self._keep_alive)
        self._table_synced_at = time.monotonic()
        try:
            if first:
                self._unwritten, resets = self.table.split_owed(resets, now)
                self._owed_marked = bool(self._unwritten) or self.table.owed_from is not None
                if self._unwritten:
                    self._mark_owed_from(now)
            # In chunks, each in a transaction of its own behind a fresh renewal and the fence:
            # a cursor written alone is as valid as one written with all the others.
            size = CURSOR_CHUNK * (10 if connection.vendor == "postgresql" else 1)
            for start in range(0, len(resets), size):
                chunk = resets[start : start + size]
                self._keep_alive()
                lease = self.leadership.lease
                assert lease is not None
                with transaction.atomic():
                    check_fence(self.conf.beat_lock_name, lease)
                    self._write_cursors(chunk, lease.token)
            for start in range(0, len(gone), CURSOR_CHUNK):  # a schedule that comes back later starts afresh
                self._keep_alive()
                lease = self.leadership.lease
                assert lease is not None
                with transaction.atomic():
                    check_fence(self.conf.beat_lock_name, lease)
                    ScheduleCursor.objects.filter(name__in=gone[start : start + CURSOR_CHUNK]).delete()
        except FencedOff:
            raise  # the leader steps down and keeps its table warm, built as it is
        except Exception:
            # The table already holds the new cursors; the database may not. Start over from
            # the database on the next tick rather than carry on with the two disagreeing.
            self.table = ScheduleTable(self.conf, self.app)
            self._needs_full_load = True
            self._unwritten, self._owed_marked = [], False
            raise

    def _mark_owed_from(self, now: datetime) -> None:
        """Before a first load's first publication: its entries without a cursor, those up to
        the highest row id it read, are owed from ``now`` (or from where a predecessor that
        left this unfinished started them)."""
        self._keep_alive()
        lease = self.leadership.lease
        assert lease is not None
        assert self.table is not None
        with transaction.atomic():
            check_fence(self.conf.beat_lock_name, lease)
            # A predecessor's pair is kept whole (its load's entries are owed from its moment).
            SchedulerFence.objects.filter(name=self.conf.beat_lock_name, cursors_owed_from__isnull=True).update(
                cursors_owed_from=now, cursors_owed_up_to_id=self.table.max_row_id
            )

    def _write_unwritten(self) -> None:
        """After a tick's publication: write up to ``UNWRITTEN_PER_TICK`` of the first load's
        cursors, then, once all are, clear the fence's ``cursors_owed_from``. Each cursor as it
        is now, not as the load set it: one whose entry has published since has moved on (its
        batch wrote it), and writing the load's value would move it back, so that a successor
        published those slots again (a plain Celery entry's twice: it has no ledger key)."""
        if not self._owed_marked:
            return
        assert self.table is not None
        budget = UNWRITTEN_PER_TICK.get(connection.vendor, UNWRITTEN_PER_TICK_ELSEWHERE)
        size = CURSOR_CHUNK * (10 if connection.vendor == "postgresql" else 1)
        while self._unwritten and budget > 0:
            names = self._unwritten[: min(size, budget)]
            cursors = [(name, self.table.cursors[name]) for name, _start in names if name in self.table.cursors]
            self._keep_alive()
            lease = self.leadership.lease
            assert lease is not None
            with transaction.atomic():
                check_fence(self.conf.beat_lock_name, lease)
                if cursors:
                    self._write_cursors(cursors, lease.token)
            del self._unwritten[: len(names)]
            budget -= len(names)
        if self._unwritten:
            return
        self._keep_alive()
        lease = self.leadership.lease
        assert lease is not None
        with transaction.atomic():
            check_fence(self.conf.beat_lock_name, lease)
            SchedulerFence.objects.filter(name=self.conf.beat_lock_name).update(
                cursors_owed_from=None, cursors_owed_up_to_id=None
            )
        self._owed_marked = False

    def _write_cursors(self, cursors: list[tuple[str, datetime]], token: int) -> None:
        """Upsert ``(name, last slot)`` cursors under ``token``."""
        if connection.vendor == "postgresql":
            # One statement, the values as two array parameters: the ORM's upsert of 1,000
            # rows (placeholders for each) made writing 100,000 first cursors take about 4 s,
            # and building the model instances alone 1.5 s. On psycopg's own cursor where it
            # may be used, so that the arrays go in binary (Django's binds on the client, as
            # text: 0.9 s of CPU per 100,000 against 0.15 s), with Django's checks first (a
            # transaction marked for rollback must refuse the write) and Django's errors.
            params: list[Any] = [token, timezone.now(), [name for name, _s in cursors], [slot for _n, slot in cursors]]
            if ledger.server_binding_allowed():
                from psycopg import Cursor  # psycopg 3: checked above

                connection.validate_no_broken_transaction()
                with connection.wrap_database_errors, Cursor(connection.connection) as db:
                    db.execute(_WRITE_CURSORS_SQL, params)
            else:
                with connection.cursor() as db:
                    db.execute(_WRITE_CURSORS_SQL.replace("%b", "%s"), params)
            return
        rows = [ScheduleCursor(name=name, last_slot=slot, fencing_token=token) for name, slot in cursors]
        # MySQL/MariaDB upsert on any unique key and refuse a conflict target.
        target = ["name"] if connection.features.supports_update_conflicts_with_target else None
        ScheduleCursor.objects.bulk_create(
            rows,
            update_conflicts=True,
            unique_fields=target,
            update_fields=["last_slot", "fencing_token", "updated_at"],
        )

    def _publish_due(self, now: datetime) -> None:
        assert self.table is not None
        due = self.table.pop_due(now)
        batch: list[tuple[SlotEntry, tuple[datetime, ...], datetime]] = []
        slots_in_batch = 0
        try:
            while due:
                entry = due.pop()
                plan = plan_due(
                    entry.schedule,  # type: ignore[arg-type]
                    cursor=self.table.cursors[entry.name],
                    now=now,
                    policy=entry.policy,
                    grace_seconds=self.conf.beat_misfire_grace_seconds,
                    catch_up_window_seconds=entry.catch_up_window_seconds,
                    limit=self.conf.beat_batch_size,
                )
                publish = plan.publish if entry.active else ()
                dropped = plan.dropped + (len(plan.publish) - len(publish))
                if dropped and entry.active:
                    log.warning(
                        "schedule entry %r: %d missed slot(s) dropped by misfire policy %s",
                        entry.name,
                        dropped,
                        entry.policy.value,
                    )
                self.stats.dropped += dropped
                batch.append((entry, publish, plan.cursor))
                slots_in_batch += len(publish)
                if slots_in_batch >= self.conf.beat_batch_size:
                    self._commit_batch(batch, now)
                    batch, slots_in_batch = [], 0
            if batch:
                self._commit_batch(batch, now)
                batch = []
        finally:
            # Whatever was not committed goes back on the heap (its cursor did not move).
            self.table.reschedule(e for e, _p, _c in batch)
            self.table.reschedule(due)

    def _commit_batch(self, batch: list[tuple[SlotEntry, tuple[datetime, ...], datetime]], now: datetime) -> None:
        assert self.table is not None
        self._keep_alive()  # between batches too: a large backlog must not outlast the lease
        lease = self.leadership.lease
        assert lease is not None
        published = 0
        # Without the columns publication never reads (JSON and time stamps cost a fifth of a
        # burst's publication through Django's loaders; a deferred column is read if used).
        jobs = JobDefinition.objects.defer(*_UNPUBLISHED_JOB_FIELDS).in_bulk(
            [e.job_id for e, slots, _c in batch if slots and e.job_id]
        )
        cursors = [(e.name, c) for e, _s, c in batch]
        # The messages go out when the transaction commits: a shutdown signal waits for them.
        with shutdown_held(), transaction.atomic():
            check_fence(self.conf.beat_lock_name, lease)
            published = self._submit_batch(batch, lease, jobs)
            self._write_cursors(cursors, lease.token)
        for entry, slots, cursor in batch:
            self.table.cursors[entry.name] = cursor
            self.table.reschedule([entry])
            for slot in slots:
                self.stats.lateness.append((now - slot).total_seconds())
            if slots:
                self._count_runs(entry.name, max(slots), len(slots))
        del self.stats.lateness[:-10_000]
        self.stats.published += published
        if published and self.stats.first_published_at is None:
            self.stats.first_published_at = time.monotonic()
        batch.clear()

    def _submit_batch(
        self,
        batch: list[tuple[SlotEntry, tuple[datetime, ...], datetime]],
        lease: Lease,
        jobs: dict[int, JobDefinition],
    ) -> int:
        """Record the batch's slots in the publication transaction and publish them once it
        commits; the number published. The ledger rows go in one ``create_many`` (one
        statement per thousand on PostgreSQL) and their messages in one pipeline
        (``publish_many_on_commit``): one ``submit()`` per slot held the beat to about 170
        slots a second. Each slot keeps ``submit()``'s semantics: a slot whose key has its
        execution already is not published again, and one that cannot be submitted (an
        unknown task, bad arguments) becomes a dead letter without stopping the others."""
        specs: list[NewExecution] = []
        origin: list[tuple[SlotEntry, datetime]] = []
        seen: dict[str, int] = {}
        published = 0
        for entry, slots in ((e, s) for e, s, _c in batch):
            for slot in slots:
                key = slot_key(entry.key_prefix, slot)
                if entry.kind == "plain":
                    self._send_plain(entry, key, lease)
                    published += 1
                    continue
                try:
                    if entry.kind == "job":
                        job = jobs.get(entry.job_id or 0)
                        if job is None:
                            # The job was deleted since the load: its schedule goes too, nothing is owed.
                            log.warning("schedule entry %r slot %s not published: job %r was deleted",
                                        entry.name, key, entry.job_slug)  # fmt: skip
                            continue
                        spec = slot_spec(job, idempotency_key=key, slot=slot)
                    else:
                        spec = slot_spec(
                            entry.task, entry.args, entry.kwargs, idempotency_key=key, slot=slot,
                            queue=entry.options.get("queue"), priority=entry.options.get("priority"),
                        )  # fmt: skip
                except SubmissionError as exc:
                    # Bad configuration (an unknown task during a rolling deploy, bad arguments)
                    # must not block the other entries, nor lose the slot: it becomes a dead
                    # letter the operator can retry once the cause is fixed.
                    self._dead_letter_slot(entry, slot, key, jobs.get(entry.job_id or 0), exc)
                    continue
                if key in seen:  # two entries with one key prefix (a job's slug, a task entry's name)
                    first = specs[seen[key]]
                    if (first.task_name, first.args, first.kwargs) != (spec.task_name, spec.args, spec.kwargs):
                        log.warning("schedule entry %r slot %s: another entry has the key, with other arguments",
                                    entry.name, key)  # fmt: skip
                    continue
                seen[key] = len(specs)
                specs.append(spec)
                origin.append((entry, slot))
        if not specs:
            return published
        fresh: list[tuple[Execution, str, float | None]] = []
        for (execution, created), spec, (entry, _slot) in zip(ledger.create_many(specs), specs, origin, strict=True):
            if created:
                fresh.append((execution, spec.celery_task_id, None))
            elif (execution.task_name, execution.args, execution.kwargs) != (spec.task_name, spec.args, spec.kwargs):
                # The slot has its execution already (an earlier leader published it with the
                # job's arguments of then): nothing is lost.
                log.warning(
                    "schedule entry %r slot %s already has execution %d, with other arguments",
                    entry.name, spec.idempotency_key, execution.pk,
                )  # fmt: skip
        publish_many_on_commit(fresh)
        return published + len(fresh)

    def _send_plain(self, entry: SlotEntry, key: str, lease: Lease) -> None:
        """A plain Celery entry (no ledger row): its message, stamped with the slot and the
        leader's fencing token, is sent when the transaction commits."""
        headers = {**entry.options.get("headers", {}), "tp_slot": key, "tp_fencing_token": lease.token}
        options = {**entry.options, "headers": headers}
        transaction.on_commit(lambda: self.app.send_task(entry.task, entry.args, entry.kwargs, **options), robust=True)

    def _dead_letter_slot(
        self, entry: SlotEntry, slot: datetime, key: str, job: JobDefinition | None, exc: SubmissionError
    ) -> None:
        """Record a slot that could not be submitted as a ``FAILED`` execution keyed by its slot.

        The cursor moves past the slot with the rest of the batch, so the row is the slot's
        only trace: it shows among the console's dead letters with the error, and an
        operator's "retry now" publishes it. In a savepoint: a slot that cannot even be
        recorded is logged and does not undo the batch's other publications.
        """
        error = f"{type(exc).__name__}: {exc}"
        spec = NewExecution(
            idempotency_key=key,
            task_name=job.task if job is not None else entry.task,
            args=list(job.args) if job is not None else list(entry.args),
            kwargs=dict(job.kwargs) if job is not None else dict(entry.kwargs),
            trigger=Trigger.BEAT,
            job=job,
            queue=(job.queue if job is not None else entry.options.get("queue")) or "",
            priority=job.priority if job is not None else entry.options.get("priority"),
            scheduled_for=slot,
        )
        try:
            with transaction.atomic():
                execution, created = ledger.create(spec)
                if created:
                    ledger.dead_letter(
                        execution,
                        execution.fencing_token,
                        error=f"slot not submitted: {error}",
                        traceback=traceback.format_exc(),
                        worker=f"beat {self.identity}",
                    )
        except Exception:
            log.exception(
                "schedule entry %r slot %s not published (%s) and could not be recorded", entry.name, key, error
            )
            self.stats.dropped += 1
            return
        if created:
            self.stats.dead_lettered += 1
            log.error(
                "schedule entry %r slot %s not published (%s): recorded as dead letter %d",
                entry.name,
                key,
                error,
                execution.pk,
            )

    def _heartbeat(self, now_monotonic: float) -> None:
        if now_monotonic - self._last_heartbeat < HEARTBEAT_SECONDS and self._reported_leading == self._leading:
            return
        self._last_heartbeat = now_monotonic
        self._reported_leading = self._leading
        lease = self.leadership.lease if self._leading else None
        wall = timezone.now()
        try:
            BeatProcess.objects.update_or_create(
                identity=self.identity,
                defaults={
                    "lock_name": self.conf.beat_lock_name,
                    "is_leader": self._leading,
                    "fencing_token": lease.token if lease else 0,
                    "lease_expires_at": wall + timedelta(seconds=lease.remaining()) if lease else None,
                    "last_seen_at": wall,
                    "entries": len(self.table.entries) if self.table else 0,
                    "published": self.stats.published,
                    "stopped_at": None,
                },
                create_defaults={
                    "lock_name": self.conf.beat_lock_name,
                    "is_leader": self._leading,
                    "started_at": self._started_at,
                    "last_seen_at": wall,
                },
            )
        except Exception as exc:
            log.debug("beat heartbeat not recorded: %s", exc)
            close_old_connections()
