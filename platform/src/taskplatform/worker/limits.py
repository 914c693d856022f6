"""Fleet-wide limits: at most N bodies at once, at most N starts per window, across workers.

A ``Limit`` (one per task or per job, edited in the admin) is a set of slots on a lock
backend, each slot an ordinary lease (``LockBackend.acquire_any``):

* **concurrency** — ``concurrency`` slots named ``limit:<id>:running:<i>``. A worker takes
  one after its claim and before the body, renews it with the attempt's lease and releases it
  when the attempt's outcome is recorded; a holder that dies frees it when the lease runs
  out. Releasing wakes the longest-waiting execution of the limit (``ledger.wake_waiter``).
* **rate** — ``rate`` slots named ``limit:<id>:started:<i>``, each taken at a start with a
  TTL of ``per_seconds`` and never released: a slot taken at ``t`` is busy until
  ``t + per_seconds`` by the backend's clock (plus ``RATE_MARGIN_SECONDS``), so no window of
  ``per_seconds`` holds more than ``rate`` starts.

An attempt that finds a slot missing gives its claim back (``ledger.wait_for_limit``: the row
waits as ``WAITING``, its attempt uncounted) with a due time: for concurrency a backstop of
about the lease (a dead holder's slot frees by then; a live one wakes a waiter at once), for
a rate limit a random instant within the time the waiting rows take to drain at the rate, so
retries spread out instead of polling together. A lock backend that cannot be reached counts
as full: a limit protects a downstream, so it fails closed.

Rules are read from the database at most every ``TASKPLATFORM_LIMITS_REFRESH_SECONDS`` per
process; a task with no limit pays one dictionary lookup.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..backends import get_lock_backend
from ..backends.base import Lease, LockBackend
from ..conf import platform_settings
from ..core import ledger
from ..exceptions import LockError
from ..models import Execution, Limit

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

log = logging.getLogger("taskplatform.limits")

#: A start slot is held this much longer than the rate's window: the body starts a few
#: milliseconds after its slot is granted, and not always equally late, so two starts a
#: window apart by the backend's clock can be a little less apart as the bodies see them.
RATE_MARGIN_SECONDS = 0.05

#: Longest backstop of a concurrency wait, in seconds: a wake can be lost (its holder died
#: between the body and the release, or the slot freed just before the wait was written).
CONCURRENCY_BACKSTOP_SECONDS = 15.0

#: Delay before a wait is tried again when the lock backend could not be reached, in seconds.
BACKEND_DOWN_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class Rule:
    """One ``Limit`` row as the worker applies it."""

    id: int
    scope: str
    task_name: str
    job_id: int | None
    concurrency: int | None
    rate: int | None
    per_seconds: int
    backend: str

    def running_slots(self) -> list[str]:
        return slot_names(self.id, "running", self.concurrency or 0)

    def started_slots(self) -> list[str]:
        return slot_names(self.id, "started", self.rate or 0)


def slot_names(limit_id: int, kind: str, count: int) -> list[str]:
    """The lock names of a limit's slots, in a random order (contenders spread over them)."""
    names = [f"limit:{limit_id}:{kind}:{i}" for i in range(count)]
    random.shuffle(names)
    return names


@dataclass
class Refusal:
    """Why an attempt may not start now, and how long it should wait."""

    rule: Rule
    kind: str  # "concurrency" or "rate"; "unavailable" when the backend could not be asked; "lease"
    delay_seconds: float
    reason: str


@dataclass(eq=False)
class Held:
    """The running slots one attempt holds (released when its outcome is recorded)."""

    leases: list[tuple[Rule, LockBackend, Lease]] = field(default_factory=list)
    #: The start slots of its rate limits: never released once the body started (``give_back``
    #: returns them when it does not start after all).
    starts: list[tuple[LockBackend, Lease]] = field(default_factory=list)
    released: bool = False


class _Rules:
    """The limits table, re-read at most every ``limits_refresh_seconds`` in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_load = 0.0
        self._by_task: dict[str, Rule] = {}
        self._by_job: dict[int, Rule] = {}

    def for_execution(self, execution: Execution) -> list[Rule]:
        if time.monotonic() >= self._next_load:
            self._load()
        rules = []
        if (rule := self._by_task.get(execution.task_name)) is not None:
            rules.append(rule)
        if execution.job_id is not None and (rule := self._by_job.get(execution.job_id)) is not None:
            rules.append(rule)
        return rules

    def _load(self) -> None:
        with self._lock:
            if time.monotonic() < self._next_load:
                return
            try:
                rows = list(
                    Limit.objects.values_list(
                        "id", "scope", "task_name", "job_id", "concurrency", "rate", "per_seconds", "backend"
                    )
                )
            except Exception:
                # The rules in hand stay in force; the claim that brought us here will
                # report the database error itself if it is down.
                log.warning("the fleet-wide limits could not be read; keeping the last ones", exc_info=True)
                self._next_load = time.monotonic() + 1.0
                return
            rules = [Rule(*row) for row in rows]
            self._by_task = {r.task_name: r for r in rules if r.task_name}
            self._by_job = {r.job_id: r for r in rules if r.job_id is not None}
            self._next_load = time.monotonic() + platform_settings().limits_refresh_seconds

    def reset(self) -> None:
        """Forget the rules read (tests; a ``Limit`` saved in this process)."""
        self._next_load = 0.0


rules = _Rules()


def rules_for(execution: Execution) -> list[Rule]:
    """The limits that bound ``execution``: its task's, then its job's."""
    return rules.for_execution(execution)


def acquire(
    applicable: Sequence[Rule],
    execution: Execution,
    *,
    lease_seconds: int,
    worker: str,
    confirm: Callable[[], bool] | None = None,
) -> Held | Refusal:
    """Take a slot of every limit in ``applicable`` for the attempt now claimed on
    ``execution``: the running slots it keeps (``Held``), or the first refusal, having given
    back whatever it had taken.

    In this order: every running slot, then ``confirm()`` (the worker's lease renewal: False
    when the lease ran out meanwhile), then every start slot, last. A start slot counts from
    its grant, so nothing slow (another limit's round trip, the renewal) may sit between it
    and the body's start: the rate's margin covers only a few milliseconds. Anything raised
    (``confirm``'s database error, a soft time limit) propagates after everything taken was
    given back: a running slot kept by the slot keeper would be renewed for as long as the
    process lives, and its limit would be one short for good.
    """
    held = Held()
    try:
        refusal = _take(applicable, execution, held, lease_seconds, f"execution:{execution.pk}@{worker}", confirm)
        if refusal is None and held.leases:
            slot_keeper().hold(held)  # inside: a keeper thread that cannot start gives the slots back
    except BaseException:
        _give_back_taken(held, None, worker=worker)
        raise
    if refusal is None:
        return held
    # Nothing starts: what was taken goes back (a start slot too, for no start happened).
    _give_back_taken(held, None if refusal.kind == "lease" else refusal.rule, worker=worker)
    return refusal


def _take(
    applicable: Sequence[Rule],
    execution: Execution,
    held: Held,
    lease_seconds: int,
    identity: str,
    confirm: Callable[[], bool] | None,
) -> Refusal | None:
    """``acquire``'s steps, recording in ``held`` what was taken; the first refusal, or None."""
    for rule in applicable:
        if rule.concurrency:
            try:
                backend = get_lock_backend(rule.backend)
                lease = backend.acquire_any(rule.running_slots(), lease_seconds, identity)
            except Exception as exc:
                return _unavailable(rule, exc, execution, lease_seconds)
            if lease is None:
                return _full(rule, "concurrency", execution, lease_seconds)
            held.leases.append((rule, backend, lease))
    renewed_at = time.monotonic()
    if confirm is not None and not confirm():
        return _late(applicable[0], execution, lease_seconds)
    for rule in applicable:
        if rule.rate:
            try:
                backend = get_lock_backend(rule.backend)
                lease = backend.acquire_any(rule.started_slots(), rule.per_seconds + RATE_MARGIN_SECONDS, identity)
            except Exception as exc:
                return _unavailable(rule, exc, execution, lease_seconds)
            if lease is None:
                return _full(rule, "rate", execution, lease_seconds)
            held.starts.append((backend, lease))
    if confirm is not None and time.monotonic() - renewed_at > lease_seconds / 2:
        # The start slots took longer than half the lease renewed before them (no second round
        # trip here, which would sit between the start slots and the body): the lease may run
        # out before the lease keeper's first renewal, so the body does not start.
        return _late(applicable[0], execution, lease_seconds)
    return None


def _late(rule: Rule, execution: Execution, lease_seconds: int) -> Refusal:
    """The lease ran out (or nearly) while the slots were taken. If nobody has acted on the row
    yet, the claim is given back uncounted and the execution published again: at once the
    first time, then backing off (a lock server always slower than the lease would otherwise
    cycle the row through claims for good)."""
    delay = _backoff(execution.limit_backoffs, lease_seconds) if execution.limit_backoffs else 0.0
    return Refusal(rule, "lease", delay, "the lease ran out while the slots were taken")


def _give_back_taken(held: Held, refused_by: Rule | None, *, worker: str) -> None:
    """Release what ``acquire`` took for a start that does not happen. Each running slot
    given back wakes a waiter of its limit, as a body's end does (a refusal that gave its slot
    back silently left the waiters of that limit to their backstops), except the refusing
    limit's own: its waiters would meet the same refusal and wake one another in a loop."""
    for backend, lease in held.starts:
        _release_quietly(backend, lease)
    held.starts = []
    held.released = True
    slot_keeper().drop(held)
    for rule, backend, lease in held.leases:
        _release_quietly(backend, lease)
        if refused_by is None or rule.id != refused_by.id:
            _wake(rule, worker=worker, reason=f"a slot of {rule.scope} was given back")


def _backoff(waits: int, lease_seconds: int) -> float:
    """The wait, jittered, after ``waits`` consecutive waits whose slots could not be counted:
    ``BACKEND_DOWN_WAIT_SECONDS`` doubling with each, up to the lease.

    >>> 2.5 <= _backoff(0, 60) <= 5.0 and 20.0 <= _backoff(3, 60) <= 40.0 and _backoff(9, 60) <= 60.0
    True
    """
    return min(float(lease_seconds), BACKEND_DOWN_WAIT_SECONDS * 2 ** min(waits, 10)) * random.uniform(0.5, 1.0)


def _unavailable(rule: Rule, exc: Exception, execution: Execution, lease_seconds: int) -> Refusal:
    """Fails closed: an unreachable backend, a removed alias, a refused TTL."""
    log.error(
        "the slots of a fleet-wide limit could not be counted; the execution waits",
        exc_info=exc,
        extra={"execution_id": execution.pk, "limit": rule.scope},
    )
    # Backs off with the execution's consecutive waits of this kind (``limit_backoffs``, kept by
    # ``ledger.wait_for_limit``): a backlog must not cycle through claims every few seconds
    # for as long as the backend is down.
    why = "lock backend unreachable" if isinstance(exc, LockError) else f"{type(exc).__name__}: {exc}"
    delay = _backoff(execution.limit_backoffs, lease_seconds)
    return Refusal(rule, "unavailable", delay, f"limit {rule.scope}: {why}")


def _full(rule: Rule, kind: str, execution: Execution, lease_seconds: int) -> Refusal:
    if kind == "concurrency":
        # Woken by the next holder to finish; the delay only covers holders that die (their
        # slot frees when their lease runs out) and wakes that were lost. Spread over a window
        # that grows with the backlog: the waiters' backstop claims then come at about the
        # same pace however many wait (a fixed 15-22 s made 100 waiters cost 6 claims a second
        # with the slot held throughout). A lost wake costs more with a long queue: the first
        # backstop comes after about twice the base delay instead of within 1.5 times it.
        base = min(float(lease_seconds), CONCURRENCY_BACKSTOP_SECONDS)
        spread = max(0.5, waiting_count(rule) / max(1, rule.concurrency or 1))
        delay = base * (1.0 + random.uniform(0.0, spread))
        return Refusal(rule, kind, delay, f"concurrency limit of {rule.scope} reached: {rule.concurrency} running")
    waiting = waiting_count(rule)
    drain = rule.per_seconds * max(1.0, (waiting + 1) / max(1, rule.rate or 1))
    delay = random.uniform(0.05, 1.0) * drain
    return Refusal(
        rule, kind, delay, f"rate limit of {rule.scope} reached: {rule.rate} starts per {rule.per_seconds} s"
    )


def waiting_count(rule: Rule) -> int:
    """How many executions wait on ``rule`` now, refused by it (for spreading the waits); the
    rows of its scope that wait on another limit do not count."""
    return ledger.count_waiting(limit_id=rule.id)


def wait(execution: Execution, token: int, refusal: Refusal, *, worker: str) -> bool:
    """Record the refusal in the ledger: the execution waits (``ledger.wait_for_limit``)."""
    return ledger.wait_for_limit(
        execution,
        token,
        delay_seconds=refusal.delay_seconds,
        worker=worker,
        reason=refusal.reason,
        data={"limit": refusal.rule.scope, "limit_id": refusal.rule.id, "kind": refusal.kind},
        limit_id=refusal.rule.id,
        backing_off=refusal.kind in ("unavailable", "lease"),
    )


def release(held: Held | None, *, worker: str) -> None:
    """Free the running slots of a finished attempt and wake one waiter per limit freed.
    Never raises: the attempt's outcome is recorded already, and a slot not released here
    frees when its lease runs out."""
    if held is None or held.released or not held.leases:
        return
    held.released = True
    slot_keeper().drop(held)
    for rule, backend, lease in held.leases:
        _release_quietly(backend, lease)
        _wake(rule, worker=worker, reason=f"a slot of {rule.scope} freed")


def _wake(rule: Rule, *, worker: str, reason: str) -> None:
    """Publish the longest waiter refused by ``rule`` (``ledger.wake_waiter``). Never raises:
    a wake not sent here is covered by the waiter's due time."""
    try:
        ledger.wake_waiter(rule.id, actor=worker, reason=reason)
    except Exception:
        log.warning(
            "could not wake a waiting execution; it is published at its due time",
            exc_info=True,
            extra={"limit": rule.scope},
        )


def give_back(held: Held, *, worker: str) -> None:
    """Everything ``acquire`` granted, for an attempt whose body will not start after all: its
    running slots (waking a waiter, as ``release`` does) and its start slots (no start
    happened, so none is counted)."""
    for backend, lease in held.starts:
        _release_quietly(backend, lease)
    held.starts = []
    release(held, worker=worker)


def _release_quietly(backend: LockBackend, lease: Lease) -> None:
    try:
        backend.release(lease)
    except Exception:
        log.warning("could not release a limit's slot; it frees when its lease runs out", exc_info=True)


class SlotKeeper:
    """Renews the running slots held in this process, each every third of its TTL, on one
    daemon thread (like the executions' lease keeper, whose leases have the same length)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[Held, float] = {}  # next renewal, monotonic
        self._thread: threading.Thread | None = None

    def hold(self, held: Held) -> None:
        """Keep ``held``'s running slots. The first renewal is due a third of the TTL after the
        earliest grant, not after this call: taking the other slots (a slow lock server) may
        have used most of the first one's TTL, and it would lapse under its body. If the
        keeper's thread cannot start, nothing stays registered (the caller gives the slots
        back) and the error propagates."""
        ttl = min(lease.ttl_seconds for _r, _b, lease in held.leases)
        granted = min(lease.granted_at for _r, _b, lease in held.leases)
        with self._cond:
            self._held[held] = granted + max(0.5, ttl / 3)
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="taskplatform-limit-slots", daemon=True)
                try:
                    thread.start()
                except BaseException:
                    self._held.pop(held, None)
                    raise
                self._thread = thread
            self._cond.notify()

    def drop(self, held: Held) -> None:
        with self._cond:
            self._held.pop(held, None)

    def _run(self) -> None:
        """The renewal loop, restarted after anything it lets through: if this thread died, the
        slots of running bodies would run out under them and others would take them."""
        while True:
            try:
                self._loop()
            except BaseException:
                try:
                    log.exception("the slot keeper failed; restarting it")
                    _close_connection()
                except BaseException:
                    pass
                time.sleep(RETRY_SECONDS)  # back off, not synchronisation

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [h for h, at in self._held.items() if at <= now]
                if not due:
                    wake = min(self._held.values(), default=now + 60)
                    self._cond.wait(timeout=max(0.05, wake - now))
                    continue
            for held in due:
                self._renew(held)

    def _renew(self, held: Held) -> None:
        renewed: list[tuple[Rule, LockBackend, Lease]] = []
        failed = False
        for rule, backend, lease in held.leases:
            try:
                new = backend.renew(lease)
            except Exception:
                # Retried in a second on a fresh connection (the database backend uses this
                # thread's: one the server closed would fail every later renewal), as long as
                # the slot may still be ours.
                log.warning("renewing a limit's slot failed; retrying", exc_info=True, extra={"limit": rule.scope})
                _close_connection()
                failed = True
                new = lease if lease.remaining() > 0 else None
            if new is None:
                if held.released:
                    return
                log.warning(
                    "a limit's slot was lost (its lease ran out): the limit may be exceeded until this body ends",
                    extra={"limit": rule.scope, "slot": lease.name},
                )
                continue
            renewed.append((rule, backend, new))
        with self._cond:
            if held not in self._held or held.released:
                return
            held.leases = renewed
            if renewed:
                ttl = min(lease.ttl_seconds for _r, _b, lease in renewed)
                period = max(0.5, ttl / 3)
                self._held[held] = time.monotonic() + (min(RETRY_SECONDS, period) if failed else period)
            else:
                self._held.pop(held, None)


#: Delay before a failed slot renewal is tried again, in seconds (capped by a third of the TTL).
RETRY_SECONDS = 1.0


def _close_connection() -> None:
    from django.db import connection

    try:
        connection.close()
    except Exception:
        log.debug("closing the slot keeper's connection failed", exc_info=True)


_keeper: SlotKeeper | None = None
_keeper_pid = 0


def slot_keeper() -> SlotKeeper:
    """The process's slot keeper (a forked pool child starts its own)."""
    import os

    global _keeper, _keeper_pid
    if _keeper is None or _keeper_pid != os.getpid():
        _keeper, _keeper_pid = SlotKeeper(), os.getpid()
    return _keeper


def holders(limit: Limit, infos: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """Who holds the slots of ``limit`` now (the locks page): one row per held slot.
    ``infos``: the backend's ``locks()`` if the caller has read them already."""
    if infos is None:
        infos = get_lock_backend(limit.backend).locks()
    prefix = f"limit:{limit.pk}:"
    return [
        {"slot": info.name, "kind": info.name.split(":")[2], "owner": info.owner, "expires_at": info.expires_at,
         "ttl_remaining_seconds": info.ttl_remaining_seconds}
        for info in sorted(infos, key=lambda i: i.name)
        if info.name.startswith(prefix) and info.owner
    ]  # fmt: skip


# --- editing (the console) -----------------------------------------------------------------------


def limit_errors(limit: Limit) -> dict[str, str]:
    """What is wrong with ``limit`` beyond the model's own checks: an unknown or non-idempotent
    task, a job's task, an unconfigured lock backend alias."""
    from ..backends import backend_config
    from ..core.validation import resolve_task
    from ..exceptions import ConfigurationError, TaskPlatformError

    errors: dict[str, str] = {}
    if limit.task_name:
        try:
            resolve_task(limit.task_name)
        except TaskPlatformError as exc:
            errors["task_name"] = str(exc)
    try:
        backend_config(limit.backend)
    except ConfigurationError as exc:
        errors["backend"] = str(exc)
        return errors
    errors.update(_ttl_errors(limit))
    return errors


def _ttl_errors(limit: Limit) -> dict[str, str]:
    """A slot longer than its backend grants (Redlock's ``max_ttl_seconds``): such a limit was
    accepted and then never granted, and every execution it bounds waited for good."""
    from ..backends import get_lock_backend
    from ..conf import platform_settings
    from ..core.validation import registered_task

    try:
        most = getattr(get_lock_backend(limit.backend), "max_ttl_seconds", None)
    except Exception:  # a backend that cannot be built: reported by the system checks (E020/E021)
        return {}
    if not most:
        return {}
    errors: dict[str, str] = {}
    if limit.rate and limit.per_seconds and limit.per_seconds + RATE_MARGIN_SECONDS > most:
        errors["per_seconds"] = (
            f"a start slot is held for the window ({limit.per_seconds:g} s) plus {RATE_MARGIN_SECONDS:g} s, longer "
            f"than backend {limit.backend!r} grants (max_ttl_seconds={most:g}): shorten the window or raise it"
        )
    if limit.concurrency:
        from ..models import JobDefinition

        job = limit.job if limit.job_id else None
        lease_for = getattr(registered_task(job.task if job is not None else limit.task_name), "lease_for", None)

        def lease_of(j: JobDefinition | None) -> int:
            if lease_for is not None:
                return int(lease_for(j))
            return (j.lease_seconds if j is not None else None) or platform_settings().lease_seconds

        # A job's limit bounds the job; a task's bounds plain calls of the task and all its jobs.
        scope = [job] if job is not None else [None, *JobDefinition.objects.filter(task=limit.task_name)]
        lease = max(lease_of(j) for j in scope)
        if lease > most:
            errors["concurrency"] = (
                f"a running slot lives as long as the attempt's lease ({lease} s), longer than backend "
                f"{limit.backend!r} grants (max_ttl_seconds={most:g}): shorten the lease or raise it"
            )
    return errors


def validate(limit: Limit) -> None:
    """Raise ``ValidationError`` naming every bad field of ``limit``."""
    from django.core.exceptions import ValidationError

    errors: dict[str, Any] = {}
    try:
        limit.full_clean(validate_unique=False)
    except ValidationError as exc:
        errors.update(exc.message_dict)
    for name, message in limit_errors(limit).items():
        errors.setdefault(name, [message])
    if errors:
        raise ValidationError(errors)


def save_limit(limit: Limit, *, user: str, reason: str = "") -> None:
    """Save ``limit`` (validated) and audit it; workers apply it within
    ``limits_refresh_seconds``."""
    from django.db import transaction

    from ..core.audit import audit

    validate(limit)
    created = limit.pk is None
    before = None if created else Limit.objects.filter(pk=limit.pk).first()
    with transaction.atomic():
        limit.save()
        audit(user, "add_limit" if created else "change_limit", f"limit:{limit.scope}", reason, limit=str(limit))
        if before is not None and _loosened(before, limit):
            _recall_waiters(limit.pk)
    rules.reset()


def _loosened(before: Limit, after: Limit) -> bool:
    """Whether ``after`` lets more through than ``before``: more running at once, or more
    starts in its window (a limit removed lets through everything); or it moved (another task
    or job, another lock backend: its old scope is unlimited now, and its slots count afresh)."""
    if (before.task_name, before.job_id, before.backend) != (after.task_name, after.job_id, after.backend):
        return True

    def more(old: int | None, new: int | None) -> bool:
        return bool(old) and (not new or new > old)  # type: ignore[operator]

    old_rate = before.rate / before.per_seconds if before.rate else None
    new_rate = after.rate / after.per_seconds if after.rate else None
    return more(before.concurrency, after.concurrency) or (
        old_rate is not None and (new_rate is None or new_rate > old_rate)
    )


def _recall_waiters(limit_id: int) -> None:
    """The executions refused by limit ``limit_id`` are due again once the workers have read
    the change (``limits_refresh_seconds``), not at their backstops (minutes to hours for a
    long queue): the rescuer publishes them, and those the limit still refuses wait again.
    Raising or removing a limit is how an operator lets a backlog through."""
    ledger.recall_waiters(limit_id, within_seconds=platform_settings().limits_refresh_seconds + 1)


def delete_limit(limit: Limit, *, user: str, reason: str = "") -> None:
    """Delete ``limit`` and audit it; its slots are left to expire (a running body keeps its own),
    and the executions it refused are published again once the workers have read the change."""
    from django.db import transaction

    from ..core.audit import audit

    with transaction.atomic():
        audit(user, "delete_limit", f"limit:{limit.scope}", reason, limit=str(limit))
        limit.delete()  # its waiters are recalled (``recall_waiters_of_deleted``)
    rules.reset()


def recall_waiters_of_deleted(sender: object, instance: Limit, **kwargs: object) -> None:
    """``post_delete`` of a ``Limit``, however it goes: through ``delete_limit``, with its job
    (a cascade), or a queryset's delete. Its waiters would otherwise wait for their backstops,
    for no slot of a deleted limit ever frees."""
    _recall_waiters(instance.pk)
