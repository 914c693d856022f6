"""``LockedScheduler``: several ``celery beat`` processes, one leader, no slot twice, none missed.

Set ``CELERY_BEAT_SCHEDULER = "taskplatform.beat.LockedScheduler"`` and run as many beats
as you like. django-celery-beat's tables stay the schedule store (its admin and API keep
working); a ``JobDefinition`` attaches to a ``PeriodicTask`` to give it a task, arguments
and policies. Each tick:

1. **Leadership.** Every process tries to hold the lease ``beat_lock_name`` on the lock
   backend. The holder renews it every tick; the others try every tick, so one takes over
   within about ``beat_lease_seconds + beat_tick_seconds`` of the leader's death. A leader
   that cannot renew keeps publishing only while its lease has more than
   ``beat_step_down_seconds`` left, as measured locally from before the grant.
2. **Slots.** Slot times come from the schedule alone (``taskplatform.slots``), never from
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

The leader also runs the platform's maintenance in a thread of its own: the rescuer every
``rescue_interval_seconds`` and ledger pruning every ``prune_interval_seconds``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connection, connections, transaction
from django.utils import timezone
from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry

from . import ledger
from .backends import get_lock_backend
from .backends.base import Lease, LockBackend, new_owner
from .conf import PlatformSettings, platform_settings
from .exceptions import ConfigurationError, SubmissionError
from .logs import execution_context
from .models import BeatProcess, JobDefinition, ScheduleCursor, SchedulerFence, Trigger
from .slots import PERIOD_SECONDS, Bounded, Clocked, Crontab, Interval, MisfirePolicy, Schedule, plan_due, slot_key

log = logging.getLogger("taskplatform.beat")

#: Executions deleted per pruning transaction.
PRUNE_BATCH = 1000
#: How often a beat process records itself in ``BeatProcess`` (for ``taskplatform status``).
HEARTBEAT_SECONDS = 5.0
#: The task a plain django-celery-beat entry uses to trigger a job by slug.
TRIGGER_TASK = "taskplatform.trigger_job"


def configuration_problems(conf: PlatformSettings) -> list[str]:
    """What is wrong with the beat's timing settings, each message saying what to change."""
    lease, tick, margin, sync = (
        conf.beat_lease_seconds,
        conf.beat_tick_seconds,
        conf.beat_step_down_seconds,
        conf.beat_sync_seconds,
    )
    problems = []
    if tick <= 0 or lease <= 0 or margin <= 0 or sync <= 0:
        return [
            "TASKPLATFORM_BEAT_TICK_SECONDS, _LEASE_SECONDS, _STEP_DOWN_SECONDS and _SYNC_SECONDS "
            f"must be positive (got tick={tick}, lease={lease}, step_down={margin}, sync={sync})"
        ]
    if lease < 3 * tick:
        problems.append(
            f"TASKPLATFORM_BEAT_LEASE_SECONDS={lease:g} is below 3 times TASKPLATFORM_BEAT_TICK_SECONDS={tick:g}: "
            f"the lease must survive two missed renewals. Raise the lease to at least {3 * tick:g} "
            f"or lower the tick to at most {lease / 3:g}."
        )
    if margin + tick >= lease:
        problems.append(
            f"TASKPLATFORM_BEAT_STEP_DOWN_SECONDS={margin:g} plus one tick ({tick:g}) must stay below "
            f"TASKPLATFORM_BEAT_LEASE_SECONDS={lease:g}, or a healthy leader would step down between "
            f"renewals. Lower the step-down margin below {lease - tick:g} or raise the lease."
        )
    if margin < min(tick, 1.0) / 2:
        problems.append(
            f"TASKPLATFORM_BEAT_STEP_DOWN_SECONDS={margin:g} leaves no time to finish a tick's "
            f"publication before the lease may expire; use at least {min(tick, 1.0) / 2:g}."
        )
    if sync < tick:
        problems.append(
            f"TASKPLATFORM_BEAT_SYNC_SECONDS={sync:g} is below TASKPLATFORM_BEAT_TICK_SECONDS={tick:g}; "
            "the schedule cannot be re-read more often than the beat ticks. Raise it to at least the tick."
        )
    if conf.beat_misfire_grace_seconds < lease + tick:
        problems.append(
            f"TASKPLATFORM_BEAT_MISFIRE_GRACE_SECONDS={conf.beat_misfire_grace_seconds:g} is shorter than a "
            f"failover (lease {lease:g} + tick {tick:g}): slots late only because of a failover would count "
            f"as missed. Raise it to at least {lease + tick:g}."
        )
    return problems


# --- leadership --------------------------------------------------------------------------------


class Leadership:
    """The beat lease on a lock backend: held (renewed every tick) or waited for."""

    def __init__(self, backend: LockBackend, name: str, identity: str, conf: PlatformSettings) -> None:
        self.backend = backend
        self.name = name
        self.identity = identity
        self.lease_seconds = conf.beat_lease_seconds
        self.tick_seconds = conf.beat_tick_seconds
        self.step_down_seconds = conf.beat_step_down_seconds
        self.lease: Lease | None = None
        self._last_error_log = 0.0

    @property
    def token(self) -> int:
        return self.lease.token if self.lease else 0

    def may_publish(self) -> bool:
        """True while the lease can be trusted for one more publication."""
        return self.lease is not None and self.lease.remaining() > self.step_down_seconds

    def step(self) -> tuple[bool, bool]:
        """Renew or try to acquire; returns ``(leading, just_acquired)``."""
        if self.lease is None:
            try:
                self.lease = self.backend.acquire(self.name, self.lease_seconds, identity=self.identity)
            except Exception as exc:  # the lock server is unreachable: stay a follower
                self._log_error("could not reach the lock backend to acquire the beat lease: %s", exc)
                return False, False
            if self.lease is not None:
                log.info("beat %s leads (lease %s, fencing token %d)", self.identity, self.name, self.lease.token)
            return self.lease is not None, self.lease is not None
        if not self.renew_if_due():
            return False, False
        if not self.may_publish():
            log.warning(
                "beat %s steps down: its lease has %.1f s left and could not be renewed",
                self.identity,
                self.lease.remaining(),
            )
            self.lease = None
            return False, False
        return True, False

    def renew_if_due(self) -> bool:
        """Renew when at least half a tick passed since the grant; False if the lease was lost.

        An unreachable lock server is not a loss: the lease stays trusted while it has more
        than the step-down margin left (``may_publish``).
        """
        if self.lease is None:
            return False
        if self.lease.remaining() >= self.lease_seconds - self.tick_seconds / 2:
            return True
        try:
            renewed = self.backend.renew(self.lease, self.lease_seconds)
        except Exception as exc:
            self._log_error("could not renew the beat lease: %s", exc)
            return True
        if renewed is None:
            log.warning("beat %s lost the lease %s (expired or taken over)", self.identity, self.name)
            self.lease = None
            return False
        self.lease = renewed
        return True

    def abdicate(self) -> None:
        """Forget the lease without releasing it (it was lost, or a successor fenced us off)."""
        self.lease = None

    def release(self) -> None:
        if self.lease is None:
            return
        try:
            self.backend.release(self.lease)
        except Exception as exc:
            log.warning("could not release the beat lease on shutdown: %s", exc)
        self.lease = None

    def _log_error(self, message: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 10:
            log.error(message, exc)
            self._last_error_log = now


class FencedOff(Exception):
    """A newer leader has taken over the schedule: this process must stop publishing."""


def take_over_fence(name: str, lease: Lease, still_holds: Callable[[], bool]) -> None:
    """Record ``lease`` as the publishing leader of ``name`` (called on acquisition).

    Refused if a higher token already took over (we are a paused, stale leader) unless our
    lease is demonstrably live, which means the lock server's counter was reset (a Redis
    flush): then the fence follows the lock.
    """
    SchedulerFence.objects.get_or_create(name=name)
    with transaction.atomic():
        bound_lock_waits(lease)
        taken = SchedulerFence.objects.filter(name=name, fencing_token__lt=lease.token).update(
            fencing_token=lease.token, leader=lease.owner, updated_at=timezone.now()
        )
    if taken:
        return
    current = SchedulerFence.objects.get(name=name)
    if current.leader == lease.owner and current.fencing_token == lease.token:
        return
    if still_holds():
        log.warning(
            "fence %s holds token %d from %s but the lock granted %d to %s: the lock's counter was reset; "
            "the fence follows the lock",
            name,
            current.fencing_token,
            current.leader,
            lease.token,
            lease.owner,
        )
        SchedulerFence.objects.filter(name=name).update(
            fencing_token=lease.token, leader=lease.owner, updated_at=timezone.now()
        )
        return
    raise FencedOff(f"a newer leader ({current.leader}, token {current.fencing_token}) took over {name}")


def bound_lock_waits(lease: Lease) -> None:
    """In this transaction, on PostgreSQL: wait for the fence row lock at most until the lease
    could be untrusted, and let the server end the transaction if this process stalls inside
    it (a paused leader must not hold the fence row, and so every successor, indefinitely)."""
    if connection.vendor != "postgresql":
        return
    budget_ms = max(100, int(lease.remaining() * 1000) - 500)
    with connection.cursor() as cur:  # one round trip; both settings end with the transaction
        cur.execute(
            "SELECT set_config('lock_timeout', %s, true), set_config('idle_in_transaction_session_timeout', %s, true)",
            [f"{budget_ms}ms", f"{max(budget_ms, 1000)}ms"],
        )


def check_fence(name: str, lease: Lease) -> None:
    """Inside the publication transaction: lock the fence row and confirm we still own it."""
    bound_lock_waits(lease)
    if not SchedulerFence.objects.filter(name=name, leader=lease.owner, fencing_token=lease.token).update(
        updated_at=timezone.now()
    ):
        raise FencedOff(f"{name} was taken over by a newer leader")


# --- schedule entries --------------------------------------------------------------------------


@dataclass
class SlotEntry:
    """One schedule row as the leader publishes it."""

    name: str
    schedule: Schedule | None
    digest: str
    active: bool  # PeriodicTask.enabled and the job not paused
    kind: str  # "job" | "task" (an IdempotentTask) | "plain" (any other task)
    job_id: int | None = None
    job_slug: str = ""
    task: str = ""
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    policy: MisfirePolicy = MisfirePolicy.RUN_ONCE
    catch_up_window_seconds: float = 3600.0
    generation: int = 0

    @property
    def key_prefix(self) -> str:
        return self.job_slug if self.kind == "job" else self.name

    def next_slot(self, after: datetime) -> datetime | None:
        return self.schedule.next_after(after) if self.schedule is not None else None


_ROW_FIELDS = (
    "id", "name", "task", "args", "kwargs", "queue", "exchange", "routing_key", "priority", "headers",
    "expires", "expire_seconds", "start_time", "enabled", "solar_id",
    "interval__every", "interval__period",
    "crontab__minute", "crontab__hour", "crontab__day_of_month", "crontab__month_of_year",
    "crontab__day_of_week", "crontab__timezone",
    "clocked__clocked_time",
    "job__id", "job__slug", "job__enabled", "job__misfire_policy", "job__catch_up_window_seconds",
)  # fmt: skip
_JOB_FIELDS = ("id", "slug", "enabled", "misfire_policy", "catch_up_window_seconds", "periodic_task_id")


def _digest(row: dict[str, Any], job: dict[str, Any] | None) -> str:
    payload = json.dumps([row, job], sort_keys=True, default=str)
    return hashlib.blake2b(payload.encode(), digest_size=12).hexdigest()


def build_schedule(row: dict[str, Any]) -> Schedule:
    """The ``slots.Schedule`` of one ``PeriodicTask`` row (as ``values()`` returns it)."""
    if row["crontab__minute"] is not None:
        return Crontab(
            minute=row["crontab__minute"],
            hour=row["crontab__hour"],
            day_of_month=row["crontab__day_of_month"],
            month_of_year=row["crontab__month_of_year"],
            day_of_week=row["crontab__day_of_week"],
            timezone=str(row["crontab__timezone"]),
        )
    if row["interval__every"] is not None:
        seconds = row["interval__every"] * PERIOD_SECONDS[row["interval__period"]]
        anchor = row["start_time"] or datetime(1970, 1, 1, tzinfo=UTC)
        return Interval(seconds, anchor=anchor)
    if row["clocked__clocked_time"] is not None:
        return Clocked(row["clocked__clocked_time"])
    if row["solar_id"] is not None:
        raise ConfigurationError("solar schedules are not supported by LockedScheduler; use a crontab")
    raise ConfigurationError("the periodic task has no schedule")


def _loads(text: str | None, default: Any) -> Any:
    return json.loads(text) if text else default


def build_entry(row: dict[str, Any], job: dict[str, Any] | None, conf: PlatformSettings, app: Any) -> SlotEntry:
    """A ``SlotEntry`` from a ``PeriodicTask`` row and the job it triggers (if any)."""
    from .tasks import IdempotentTask

    digest = _digest(row, job)
    schedule = build_schedule(row)
    if row["start_time"] is not None or row["expires"] is not None:
        schedule = Bounded(schedule, not_before=row["start_time"], not_after=row["expires"])
    options: dict[str, Any] = {}
    for option in ("queue", "exchange", "routing_key", "priority"):
        if row[option] is not None and row[option] != "":
            options[option] = row[option]
    headers = _loads(row["headers"], {})
    if headers:
        options["headers"] = headers
    if row["expire_seconds"]:
        options["expires"] = row["expire_seconds"]
    entry = SlotEntry(
        name=row["name"],
        schedule=schedule,
        digest=digest,
        active=bool(row["enabled"]),
        kind="plain",
        task=row["task"],
        args=_loads(row["args"], []),
        kwargs=_loads(row["kwargs"], {}),
        options=options,
        catch_up_window_seconds=conf.beat_catch_up_window_seconds,
    )
    if job is not None:
        entry.kind = "job"
        entry.job_id = job["id"]
        entry.job_slug = job["slug"]
        entry.active = entry.active and bool(job["enabled"])
        entry.policy = MisfirePolicy(job["misfire_policy"])
        if job["catch_up_window_seconds"]:
            entry.catch_up_window_seconds = float(job["catch_up_window_seconds"])
    elif isinstance(app.tasks.get(row["task"]), IdempotentTask):
        entry.kind = "task"
    return entry


class ScheduleTable:
    """The leader's view of the schedule: entries, cursors and a heap of next slots."""

    def __init__(self, conf: PlatformSettings, app: Any) -> None:
        self.conf = conf
        self.app = app
        self.entries: dict[str, SlotEntry] = {}
        self.cursors: dict[str, datetime] = {}
        self.heap: list[tuple[datetime, str, int]] = []
        self._generation = 0
        self.broken: dict[str, str] = {}
        #: Wall time of the previous load: an entry that changed since was edited after it.
        self.loaded_at: datetime | None = None

    def _push(self, entry: SlotEntry) -> None:
        cursor = self.cursors.get(entry.name)
        if cursor is None:
            return
        upcoming = entry.next_slot(cursor)
        if upcoming is not None:
            heapq.heappush(self.heap, (upcoming, entry.name, entry.generation))

    def load(self, now: datetime, *, first: bool) -> tuple[list[tuple[str, datetime]], list[str]]:
        """Re-read the schedule tables; returns cursors to (re)set ``(name, slot)`` and to delete.

        ``first``: this process just became leader, so cursors are read from the database
        and nothing is known about earlier digests.

        An entry that is new, edited, re-enabled or repaired since the previous load is owed
        slots from that previous load on (it changed after it): an edit is not a misfire of
        the new schedule, and a slot due between the edit and this load is not lost.
        """
        rows = list(PeriodicTask.objects.values(*_ROW_FIELDS))
        linked = {row["job__slug"] for row in rows if row["job__id"] is not None}
        trigger_slugs = [
            args[0]
            for row in rows
            if row["task"] == TRIGGER_TASK and row["job__id"] is None
            for args in [_loads_safely(row["args"])]
            if args and isinstance(args[0], str) and args[0] not in linked
        ]
        jobs_by_slug = {
            job["slug"]: job for job in JobDefinition.objects.filter(slug__in=trigger_slugs).values(*_JOB_FIELDS)
        }
        if first:
            self.cursors = dict(ScheduleCursor.objects.values_list("name", "last_slot"))
        since = self.loaded_at or now
        self.loaded_at = now
        resets: list[tuple[str, datetime]] = []
        seen: set[str] = set()
        for row in rows:
            name = row["name"]
            seen.add(name)
            shadowed = _shadowed_trigger(row, linked)
            if shadowed:
                if self.broken.get(name) != shadowed:
                    log.error("schedule entry %r ignored: %s", name, shadowed)
                self.broken[name] = shadowed
                self.entries.pop(name, None)
                continue
            job = _job_of(row, jobs_by_slug)
            digest = _digest(row, job)
            known = self.entries.get(name)
            if known is not None and known.digest == digest:
                continue
            try:
                entry = build_entry(row, job, self.conf, self.app)
            except (ConfigurationError, ValueError, KeyError) as exc:
                if self.broken.get(name) != str(exc):
                    log.error("schedule entry %r cannot be scheduled: %s", name, exc)
                self.broken[name] = str(exc)
                self.entries.pop(name, None)
                continue
            repaired = self.broken.pop(name, None) is not None
            self._generation += 1
            entry.generation = self._generation
            self.entries[name] = entry
            if name not in self.cursors or repaired or (known is not None and not first):
                start = max(self.cursors.get(name, since), since) if not first else now
                self.cursors[name] = start
                resets.append((name, start))
            self._push(entry)
        gone = [name for name in self.cursors if name not in seen]
        for name in gone:
            self.entries.pop(name, None)
            self.cursors.pop(name, None)
            self.broken.pop(name, None)
        return resets, gone

    def pop_due(self, now: datetime) -> list[SlotEntry]:
        due: dict[str, SlotEntry] = {}
        while self.heap and self.heap[0][0] <= now:
            _slot, name, generation = heapq.heappop(self.heap)
            entry = self.entries.get(name)
            if entry is not None and entry.generation == generation:
                due[name] = entry
        return list(due.values())

    def reschedule(self, entries: Iterable[SlotEntry]) -> None:
        for entry in entries:
            self._push(entry)

    def next_due(self) -> datetime | None:
        while self.heap:
            slot, name, generation = self.heap[0]
            entry = self.entries.get(name)
            if entry is not None and entry.generation == generation:
                return slot
            heapq.heappop(self.heap)
        return None


def _loads_safely(text: str | None) -> Any:
    try:
        return _loads(text, [])
    except ValueError:
        return []


def _shadowed_trigger(row: dict[str, Any], linked: set[str]) -> str:
    """Why a plain ``trigger_job`` row must not run (its job has a linked schedule), or ""."""
    if row["task"] != TRIGGER_TASK or row["job__id"] is not None:
        return ""
    args = _loads_safely(row["args"])
    if args and isinstance(args[0], str) and args[0] in linked:
        return f"job {args[0]!r} already has its own schedule (job:{args[0]}); running both would run it twice"
    return ""


def _job_of(row: dict[str, Any], jobs_by_slug: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if row["job__id"] is not None:
        return {
            "id": row["job__id"],
            "slug": row["job__slug"],
            "enabled": row["job__enabled"],
            "misfire_policy": row["job__misfire_policy"],
            "catch_up_window_seconds": row["job__catch_up_window_seconds"],
        }
    if row["task"] == TRIGGER_TASK:
        args = _loads_safely(row["args"])
        if args and isinstance(args[0], str):
            return jobs_by_slug.get(args[0])
    return None


# --- the scheduler -----------------------------------------------------------------------------


@dataclass
class TickStats:
    """Counters a beat keeps about itself (logged, reported in ``BeatProcess``, read by bench)."""

    ticks: int = 0
    published: int = 0
    dropped: int = 0
    fenced: int = 0
    lateness: list[float] = field(default_factory=list)


class LockedScheduler(DatabaseScheduler):
    """django-celery-beat's ``DatabaseScheduler`` with a leader lease and slot-keyed publication."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.conf = platform_settings()
        problems = configuration_problems(self.conf)
        if problems:
            raise ImproperlyConfigured("LockedScheduler cannot start:\n  - " + "\n  - ".join(problems))
        self.identity = new_owner()
        self.table: ScheduleTable | None = None
        self.stats = TickStats()
        self._leading = False
        self._last_sync = float("-inf")
        self._last_heartbeat = float("-inf")
        self._reported_leading = False
        self._needs_full_load = False
        self._started_at = timezone.now()
        self._maintenance: Maintenance | None = None
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
        return dict(self.table.entries) if self.table else {}

    def sync(self) -> None:
        """Nothing to write back: cursors are written with each publication."""

    def tick(self, *args: Any, **kwargs: Any) -> float:
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
            return self.conf.beat_tick_seconds
        assert self.table is not None
        try:
            now = timezone.now()
            if self._needs_full_load:
                self._needs_full_load = False
                self._sync_table(now, first=True)
            elif started - self._last_sync >= self.conf.beat_sync_seconds:
                self._sync_table(now, first=False)
            self._publish_due(now)
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
            sleep = min(sleep, max(0.0, (next_due - timezone.now()).total_seconds()))
        return max(sleep, 0.01)

    def close(self) -> None:
        if self._maintenance is not None:
            self._maintenance.stop()
        was_leading = self._leading
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
            self.table = ScheduleTable(self.conf, self.app)
            self._sync_table(timezone.now(), first=True)
        except FencedOff as exc:
            log.error("beat %s cannot lead: %s", self.identity, exc)
            self.leadership.abdicate()
            return False
        except Exception:
            log.exception("beat %s could not take over the schedule; releasing the lease", self.identity)
            self.leadership.release()
            close_old_connections()
            return False
        self._leading = True
        self._maintenance = Maintenance(self.conf, is_leading=self.leadership.may_publish)
        self._maintenance.start()
        return True

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
        self.table = None
        if self._maintenance is not None:
            self._maintenance.stop()
            self._maintenance = None
        log.warning("beat %s is a follower now", self.identity)

    # -- schedule and publication --

    def _sync_table(self, now: datetime, *, first: bool) -> None:
        assert self.table is not None
        resets, gone = self.table.load(now, first=first)
        self._last_sync = time.monotonic()
        if not (resets or gone):
            return
        lease = self.leadership.lease
        assert lease is not None
        try:
            with transaction.atomic():
                check_fence(self.conf.beat_lock_name, lease)
                if resets:
                    self._write_cursors(resets, lease.token)
                if gone:  # a schedule that comes back later starts afresh
                    ScheduleCursor.objects.filter(name__in=gone).delete()
        except Exception:
            # The table already holds the new cursors; the database does not. Start over from
            # the database on the next tick rather than carry on with the two disagreeing.
            self.table = ScheduleTable(self.conf, self.app)
            self._needs_full_load = True
            raise

    def _write_cursors(self, cursors: Iterable[tuple[str, datetime]], token: int) -> None:
        # MySQL/MariaDB upsert on any unique key and refuse a conflict target.
        target = ["name"] if connection.features.supports_update_conflicts_with_target else None
        ScheduleCursor.objects.bulk_create(
            [ScheduleCursor(name=n, last_slot=s, fencing_token=token) for n, s in cursors],
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
        # Renew between batches too: a large backlog must not outlast the lease.
        if not self.leadership.renew_if_due() or not self.leadership.may_publish():
            raise FencedOff("the lease can no longer be trusted")
        lease = self.leadership.lease
        assert lease is not None
        published = 0
        jobs = JobDefinition.objects.in_bulk([e.job_id for e, slots, _c in batch if slots and e.job_id])
        with transaction.atomic():
            check_fence(self.conf.beat_lock_name, lease)
            for entry, slots, _cursor in batch:
                for slot in slots:
                    self._submit(entry, slot, lease, jobs)
                    published += 1
            self._write_cursors(((e.name, c) for e, _s, c in batch), lease.token)
        for entry, slots, cursor in batch:
            self.table.cursors[entry.name] = cursor
            self.table.reschedule([entry])
            for slot in slots:
                self.stats.lateness.append((now - slot).total_seconds())
        del self.stats.lateness[:-10_000]
        self.stats.published += published
        batch.clear()

    def _submit(self, entry: SlotEntry, slot: datetime, lease: Lease, jobs: dict[int, JobDefinition]) -> None:
        from .api import submit

        key = slot_key(entry.key_prefix, slot)
        try:
            if entry.kind == "job":
                job = jobs.get(entry.job_id or 0)
                if job is None:
                    raise JobDefinition.DoesNotExist(f"job {entry.job_slug!r} was deleted")
                submit(job, idempotency_key=key, trigger=Trigger.BEAT, slot=slot)
            elif entry.kind == "task":
                submit(
                    entry.task,
                    entry.args,
                    entry.kwargs,
                    idempotency_key=key,
                    queue=entry.options.get("queue"),
                    priority=entry.options.get("priority"),
                    trigger=Trigger.BEAT,
                    slot=slot,
                )
            else:
                headers = {**entry.options.get("headers", {}), "tp_slot": key, "tp_fencing_token": lease.token}
                options = {**entry.options, "headers": headers}
                transaction.on_commit(
                    lambda: self.app.send_task(entry.task, entry.args, entry.kwargs, **options), robust=True
                )
        except (SubmissionError, JobDefinition.DoesNotExist) as exc:
            # Bad job configuration must not block the other entries: logged, slot dropped.
            log.error("schedule entry %r slot %s not published: %s", entry.name, key, exc)

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


# --- maintenance -------------------------------------------------------------------------------


class Maintenance(threading.Thread):
    """The leader's maintenance duties, off the tick thread: rescuer and ledger pruning."""

    def __init__(self, conf: PlatformSettings, is_leading: Callable[[], bool]) -> None:
        super().__init__(name="taskplatform-maintenance", daemon=True)
        self.conf = conf
        self.is_leading = is_leading
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """Stop after the current pass (joined, so its database connection is closed)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=30)

    def run(self) -> None:
        from .rescuer import run_rescuer

        next_rescue = time.monotonic()
        next_prune = time.monotonic() + min(60.0, self.conf.prune_interval_seconds)
        while not self._stop_event.wait(min(1.0, self.conf.rescue_interval_seconds)):
            if not self.is_leading():
                continue
            now = time.monotonic()
            try:
                if now >= next_rescue:
                    next_rescue = now + self.conf.rescue_interval_seconds
                    run_rescuer()
                if now >= next_prune and self.conf.retention_days > 0:
                    next_prune = now + self.conf.prune_interval_seconds
                    cutoff = timezone.now() - timedelta(days=self.conf.retention_days)
                    # Batch after batch for up to a minute: retention keeps up with the load.
                    budget = time.monotonic() + 60
                    while self.is_leading() and time.monotonic() < budget and ledger.prune(cutoff) == PRUNE_BATCH:
                        pass
            except Exception:
                log.exception("beat maintenance pass failed; retrying next interval")
            finally:
                close_old_connections()
        connections.close_all()  # this thread's connections
