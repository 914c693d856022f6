"""The ledger service: the only code that writes executions and their events.

Every state change is a compare-and-set ``UPDATE … WHERE pk = … AND state = … AND
fencing_token = …`` whose row count is checked, so the protocol needs nothing beyond what
PostgreSQL, MariaDB and SQLite all provide (no ``SELECT … FOR UPDATE``, no ``RETURNING``).
Each change and its ``ExecutionEvent`` commit in one transaction. Every claim increments
the fencing token and every write-back checks it, so a worker that lost its lease can
never overwrite a newer attempt.

Publishing is never done inside a transaction: functions that make a row publishable
register the publication with ``transaction.on_commit`` (see ``publisher``).

Ownership is decided by one clock, the database's (``UtcNow()`` inside the statement): a
lease is written, renewed, judged expired for a takeover or a rescue, and a fence or a
retry's due time is compared, in the same ``UPDATE`` that acts on it. A worker or beat
whose clock drifts can therefore neither keep a lease that has run out nor take one that
has not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, OperationalError, connection, connections, transaction
from django.db.models import DateTimeField, DurationField, ExpressionWrapper, Q, Value
from django.utils import timezone

from ..conf import platform_settings
from ..domain.states import CLAIMABLE_STATES, TERMINAL_STATES, Actor, State, find_transition
from ..exceptions import ExecutionNotFound, IllegalTransitionError, LedgerError, StaleExecutionError
from ..models import EventKind, Execution, ExecutionEvent, FlowRun, FlowState, JobDefinition, UtcNow
from . import _pg as fastpath
from .publisher import new_task_id, publish_on_commit
from .types import Claim, ClaimOutcome, Delivery, FinishedAttempt, NewExecution

__all__ = ["Claim", "Delivery", "NewExecution"]

log = logging.getLogger("taskplatform.ledger")

#: How much before its ``scheduled_for`` a ``RETRYING`` row may already be claimed. The due
#: time is the database's (``schedule_retry``), but the broker's countdown runs on the
#: publishing and consuming hosts' clocks: one second absorbs ordinary skew between them,
#: so a punctual message is not turned away. A fence (see ``operator_transition``) gets no
#: tolerance: it protects G2.
EARLY_TOLERANCE = timedelta(seconds=1)


def server_binding_allowed() -> bool:
    """Whether a statement may run on psycopg's own cursor (parameters bound by the server,
    arrays in binary) on this thread's connection: psycopg 3, Django's own backend, no query
    log nor execute wrapper watching (``_pg._raw_cursor_allowed``)."""
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    return db.vendor == "postgresql" and fastpath._raw_cursor_allowed(db)


def _db_now(plus: timedelta | None = None) -> Any:
    """The database server's clock (plus ``plus``), evaluated by the statement that uses it."""
    if not plus:
        return UtcNow()
    return ExpressionWrapper(UtcNow() + Value(plus, output_field=DurationField()), output_field=DateTimeField())


def _lease_over() -> Q:
    """The row holds no live lease or fence by the database's clock.

    For a ``RUNNING`` row: its lease expired (a takeover or rescue may act). For a
    ``PENDING``/``RETRYING`` row: the fence left by an operator's stop of a running attempt
    has passed (a new attempt may start).
    """
    return Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=UtcNow())


def _retry_due() -> Q:
    """A ``RETRYING`` row's next attempt is due by the database's clock (``EARLY_TOLERANCE``)."""
    return Q(scheduled_for__isnull=True) | Q(scheduled_for__lte=_db_now(EARLY_TOLERANCE))


def _event(
    execution: Execution,
    kind: str,
    *,
    from_state: str = "",
    to_state: str = "",
    actor: str = "",
    reason: str = "",
    data: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> ExecutionEvent:
    return ExecutionEvent.objects.create(
        execution_id=execution.pk,
        at=at or timezone.now(),
        kind=kind,
        from_state=from_state,
        to_state=to_state,
        attempt=execution.attempts,
        fencing_token=execution.fencing_token,
        actor=actor[:255],
        reason=reason,
        data=data or {},
    )


def _cas(execution: Execution, expect_state: str, expect_token: int, *only_if: Q, **changes: Any) -> bool:
    """Apply ``changes`` if the row still has the expected state and token (and matches
    ``only_if``, checked in the same statement); report success."""
    changes.setdefault("updated_at", timezone.now())
    matching = Execution.objects.filter(*only_if, pk=execution.pk, state=expect_state, fencing_token=expect_token)
    return matching.update(**changes) == 1


def republish_interval(publish_count: int) -> timedelta:
    """How long after its ``publish_count``-th publication an unclaimed row is published again."""
    conf = platform_settings()
    seconds = conf.republish_after_seconds * (2 ** max(0, publish_count - 1))
    return timedelta(seconds=min(seconds, conf.republish_max_seconds))


# --- loading and creating ----------------------------------------------------------------


def get(execution_id: int) -> Execution:
    """The execution with its job definition, or ``ExecutionNotFound``."""
    try:
        return Execution.objects.select_related("job").get(pk=execution_id)
    except Execution.DoesNotExist:
        raise ExecutionNotFound(f"no execution with id {execution_id}", execution_id=execution_id) from None


def create(spec: NewExecution) -> tuple[Execution, bool]:
    """Insert the execution, or return the one that already holds the key.

    Runs in the caller's transaction, so a view's own writes and the ledger row commit
    together. On PostgreSQL one ``INSERT … ON CONFLICT DO NOTHING``; elsewhere the
    unique-key conflict is caught (inside a savepoint when in a transaction).
    """
    execution = spec.build()
    if fastpath.enabled():
        if fastpath.insert(execution, timezone.now()):
            return execution, True
    else:
        try:
            if connection.in_atomic_block:
                with transaction.atomic():
                    execution.save(force_insert=True)
            else:
                execution.save(force_insert=True)
            return execution, True
        except IntegrityError:
            pass
    existing = Execution.objects.select_related("job").filter(idempotency_key=spec.idempotency_key).first()
    if existing is None:
        raise LedgerError(f"execution with key {spec.idempotency_key!r} could not be inserted nor found")
    return existing, False


#: Keys per ``IN (…)`` list when ``create_many`` looks rows up (SQLite allows 32,766
#: parameters a statement, PostgreSQL and MariaDB more).
_KEYS_PER_SELECT = 1000


def _existing(keys: Sequence[str]) -> dict[str, Execution]:
    """The executions holding ``keys``, with their job definitions, by key."""
    found: dict[str, Execution] = {}
    for start in range(0, len(keys), _KEYS_PER_SELECT):
        chunk = keys[start : start + _KEYS_PER_SELECT]
        found.update(
            (e.idempotency_key, e) for e in Execution.objects.select_related("job").filter(idempotency_key__in=chunk)
        )
    return found


class _Builder:
    """Model instances for rows ``insert_many`` inserted, as ``NewExecution.build`` makes them,
    then saved: with their id, due time and timestamps, and the job cached.

    Built the way Django builds the rows it loads (``Model.from_db``, positional): a third
    of the cost of keyword arguments, measured, which counts at ten thousand rows a call.
    """

    def __init__(self, template: NewExecution, now: datetime) -> None:
        built = template.build()
        built.created_at = built.updated_at = now
        fields = Execution._meta.concrete_fields
        self.attnames = [f.attname for f in fields]
        self.values = [getattr(built, name) for name in self.attnames]
        self.from_spec = [
            (i, f.name) for i, f in enumerate(fields) if f.name in NewExecution.__dataclass_fields__ and f.name != "job"
        ]
        self.id, self.due_at, self.job_id = (self.attnames.index(name) for name in ("id", "due_at", "job_id"))
        self.job = Execution._meta.get_field("job")

    def __call__(self, spec: NewExecution, pk: int, due_at: datetime) -> Execution:
        row = list(self.values)
        for i, name in self.from_spec:
            row[i] = getattr(spec, name)
        row[self.id], row[self.due_at] = pk, due_at
        row[self.job_id] = spec.job.pk if spec.job is not None else None
        execution = Execution.from_db(connection.alias, self.attnames, row)
        self.job.set_cached_value(execution, spec.job)
        return execution


def create_many(specs: Sequence[NewExecution]) -> list[tuple[Execution, bool]]:
    """``create`` for many executions: for each spec, in order, its execution and whether
    this call inserted it (False: the key existed).

    The keys must be distinct (``submit_many`` collapses repeats first). Runs in the
    caller's transaction; ``submit_many`` wraps it in its own atomic block so that a batch it
    refuses afterwards (a key reused with other arguments) leaves no row behind.

    PostgreSQL: multi-row ``INSERT … ON CONFLICT DO NOTHING RETURNING`` statements
    (``_pg.insert_many``), then one ``SELECT`` for the keys that already existed. Elsewhere:
    one ``SELECT`` for existing keys, then ``bulk_create`` of the rest inside a savepoint; if a
    concurrent submitter inserted one of those keys in between (a unique-key error), the
    savepoint is rolled back and the rows are created one by one through ``create``, which
    resolves each conflict.
    """
    if fastpath.enabled():
        now = timezone.now()
        inserted = fastpath.insert_many(specs, now)
        existing = _existing([spec.idempotency_key for spec in specs if spec.idempotency_key not in inserted])
        build = _Builder(specs[0], now) if inserted else None
        pairs: list[tuple[Execution, bool]] = []
        for spec in specs:
            row = inserted.get(spec.idempotency_key)
            if row is not None:
                assert build is not None
                pairs.append((build(spec, *row), True))
                continue
            found = existing.get(spec.idempotency_key)
            if found is None:
                raise LedgerError(f"execution with key {spec.idempotency_key!r} could not be inserted nor found")
            pairs.append((found, False))
        return pairs

    existing = _existing([spec.idempotency_key for spec in specs])
    new_specs = [spec for spec in specs if spec.idempotency_key not in existing]
    created: dict[str, tuple[Execution, bool]] = {}
    if new_specs:
        executions = [spec.build() for spec in new_specs]
        try:
            with transaction.atomic():
                Execution.objects.bulk_create(executions, batch_size=_KEYS_PER_SELECT)
        except IntegrityError:
            created = {spec.idempotency_key: create(spec) for spec in new_specs}
        else:
            missing = [e for e in executions if e.pk is None]  # a backend that returns no ids from a bulk insert
            if missing:
                ids = _existing([e.idempotency_key for e in missing])
                for execution in missing:
                    execution.pk = ids[execution.idempotency_key].pk
            created = {e.idempotency_key: (e, True) for e in executions}
    return [
        (existing[spec.idempotency_key], False) if spec.idempotency_key in existing else created[spec.idempotency_key]
        for spec in specs
    ]


def ensure(spec: NewExecution) -> Execution:
    """The execution for ``spec.idempotency_key``, inserted first if missing.

    Used for tasks called the plain Celery way, whose row is created by the worker that
    receives the message. ``INSERT … ON CONFLICT DO NOTHING`` makes concurrent deliveries
    converge on one row without an error path.

    The row gets a due time like ``submit()``'s first republish check: if the claim that
    follows fails (database errors twice), the message is gone but the rescuer publishes
    the row again, and the console's stuck filter shows it meanwhile.
    """
    found = Execution.objects.select_related("job").filter(idempotency_key=spec.idempotency_key).first()
    if found is not None:
        return found
    if spec.due_at is None:
        spec = replace(spec, due_at=timezone.now() + republish_interval(max(1, spec.publish_count)))
    Execution.objects.bulk_create([spec.build()], ignore_conflicts=True)
    return Execution.objects.select_related("job").get(idempotency_key=spec.idempotency_key)


def create_claimed(
    spec: NewExecution,
    *,
    worker: str,
    celery_task_id: str,
    lease_seconds: int,
    started_at: datetime,
    carried: FinishedAttempt | None = None,
) -> Claim | None:
    """Record a new execution already claimed by its first attempt, in one statement.

    The worker's path for a plain Celery call (``task.delay()``), whose row does not exist
    before its message: the insert and the claim commit together, so the row never sits
    unclaimed. None when the key exists already (another delivery of the same call, a key
    derived from the arguments, a claim of this delivery whose reply was lost) and on
    databases without ``INSERT … RETURNING`` in a data-modifying statement: then ``ensure``
    and ``claim`` decide, and a lost reply is recognised by ``started_at``.

    ``carried``: the success of this pool process's previous attempt, written by the same
    statement where it can be (``carries_successes``); its ``written`` says how it went.
    """
    if not fastpath.enabled():
        return None
    now = timezone.now()
    values = spec.columns()
    values.update(
        state=State.RUNNING,
        attempts=1,
        fencing_token=1,
        worker=worker[:255],
        celery_task_id=celery_task_id[:255],
        started_at=started_at,
        created_at=now,
        updated_at=now,
        due_at=None,
    )
    stored = fastpath.create_claimed(values, lease_seconds=lease_seconds, carried=carried)
    if stored is None:
        return None
    return Claim("claimed", stored, lease_seconds=lease_seconds)


# --- the worker's side: claim, heartbeat, outcome ---------------------------------------------


def carries_successes() -> bool:
    """Whether a claim can carry the previous attempt's success in its own statement
    (``create_claimed``, ``claim_message``): on PostgreSQL."""
    return fastpath.enabled()


def claim_message(
    delivery: Delivery,
    *,
    default_lease_seconds: int,
    lease_seconds_for: Callable[[JobDefinition | None], int],
    max_attempts_for: Callable[[JobDefinition | None], int],
    owner_alive: Callable[[str], bool | None] = lambda worker: None,
    started_at: datetime | None = None,
    carried: FinishedAttempt | None = None,
) -> Claim | None:
    """Claim the execution a message points at; None if the row does not exist, ``foreign``
    if it is an execution of another task than the message's.

    The common case, a first attempt of a ``PENDING`` row, is one statement on PostgreSQL;
    every other case takes the portable ``claim``. ``started_at``: see ``claim``.
    ``carried``: as in ``create_claimed``.
    """
    now = started_at or timezone.now()
    if fastpath.enabled():
        claimed = fastpath.claim_first_attempt(
            delivery, default_lease_seconds=default_lease_seconds, now=now, carried=carried
        )
        if claimed is not None:
            return Claim("claimed", claimed[0], lease_seconds=claimed[1])
    execution = Execution.objects.select_related("job").filter(pk=delivery.execution_id).first()
    if execution is None:
        return None
    if execution.task_name != delivery.task_name:
        # The message names an execution of another task: not its own row (code that
        # forwarded a parent task's headers to a child copies the ledger's). Absorbed as a
        # duplicate, the child would silently never run: the caller runs it as a plain call.
        return Claim("foreign", execution)
    return claim(
        execution,
        worker=delivery.worker,
        celery_task_id=delivery.celery_task_id,
        lease_seconds=lease_seconds_for(execution.job),
        max_attempts=max_attempts_for(execution.job),
        owner_alive=owner_alive,
        started_at=now,
    )


def claim(
    execution: Execution,
    *,
    worker: str,
    celery_task_id: str,
    lease_seconds: int,
    max_attempts: int,
    owner_alive: Callable[[str], bool | None] = lambda worker: None,
    started_at: datetime | None = None,
) -> Claim:
    """Try to become the one running attempt of ``execution``.

    Outcomes: ``claimed`` (run the body), ``duplicate`` (another live attempt owns it),
    ``early`` (a ``RETRYING`` row before its due time, or a row whose stopped attempt may
    still run until its fence: not yet), ``finished`` (terminal already: do not run),
    ``exhausted`` (no attempts left: the execution was dead-lettered now). ``owner_alive(worker)``
    may say that the current owner is known dead (``False``) so its attempt can be taken
    over before its lease runs out, e.g. a pool child killed on this very node.

    Whether a lease is live, a fence has passed or a retry is due is decided by the
    database's clock inside the compare-and-set; the worker's clock only picks which
    statement to try. ``max_attempts`` (the retry policy's) yields to a budget stored on the
    row by an explicit ``retry(max_retries=...)``.

    ``started_at`` is this delivery's own mark, written on the row by its claim: a delivery
    retrying a claim whose reply was lost (the connection dropped after the server committed
    it) passes the same instant again, and finds its own claim rather than a live attempt to
    absorb itself into (which would leave the attempt to expire unrun, counted as spent).
    """
    stamp = started_at or timezone.now()
    for _ in range(5):
        now = timezone.now()
        state = execution.state
        if state in TERMINAL_STATES:
            _event(
                execution,
                EventKind.ALREADY_FINISHED,
                from_state=state,
                to_state=state,
                actor=worker,
                data={"celery_task_id": celery_task_id},
            )
            return Claim("finished", execution)
        takeover = False
        owner_dead = False
        if state == State.RUNNING:
            if started_at is not None and _own_claim(execution, worker, celery_task_id, started_at):
                # This delivery's own claim, committed although its reply was lost. Adopt it only
                # through a renewal: the database's clock says whether its lease is still live,
                # and the lease keeper then renews from a full lease, not from the old commit's.
                if renew_lease(execution.pk, execution.fencing_token, lease_seconds):
                    log.warning(
                        "the claim's reply was lost but the claim committed: it is this delivery's own",
                        extra={"execution_id": execution.pk, "fencing_token": execution.fencing_token},
                    )
                    return Claim("claimed", get(execution.pk), lease_seconds=lease_seconds)
                # Its lease ran out (the rescuer may act on it): take it over like any expired one.
            else:
                lease_live = execution.lease_expires_at is not None and execution.lease_expires_at > now
                if lease_live:
                    owner_dead = owner_alive(execution.worker) is False
                    if not owner_dead:
                        return _absorb_duplicate(execution, worker=worker, celery_task_id=celery_task_id)
            takeover = True
        elif state not in CLAIMABLE_STATES:  # pragma: no cover - the table has no other states
            raise LedgerError(f"execution {execution.pk} is in unknown state {state!r}")

        # A takeover needs the lease expired (unless its owner is known dead); a new attempt
        # needs the fence passed and, for a retry, its due time reached.
        only_if: list[Q] = [] if owner_dead else [_lease_over()]
        previous_owner = execution.worker
        token = execution.fencing_token
        limit = execution.max_attempts or max_attempts
        if execution.attempts >= limit:
            reason = f"attempts exhausted: {execution.attempts} of {limit} made"
            if takeover:
                reason += f"; the last attempt's worker {previous_owner} was lost"
            if _dead_letter(
                execution, actor=worker, actor_kind=Actor.WORKER, error=reason, traceback="", only_if=only_if,
                attempt_lost=takeover,
            ):  # fmt: skip
                return Claim("exhausted", execution)
        else:
            if state == State.RETRYING:
                only_if.append(_retry_due())
            elif state == State.WAITING:
                # Only the row's current message may claim a waiting row: a wake or a
                # republication replaced the earlier one, which is absorbed when it arrives, so
                # a row that waits several times keeps one message in flight, not one per wait.
                only_if.append(Q(celery_task_id=celery_task_id[:255]))
            find_transition(state, State.RUNNING, Actor.WORKER)
            with transaction.atomic():
                ok = _cas(
                    execution,
                    state,
                    token,
                    *only_if,
                    state=State.RUNNING,
                    attempts=execution.attempts + 1,
                    fencing_token=token + 1,
                    lease_expires_at=_db_now(timedelta(seconds=lease_seconds)),
                    worker=worker[:255],
                    celery_task_id=celery_task_id[:255],
                    started_at=stamp,
                    due_at=None,
                    updated_at=now,
                )
                if ok:
                    execution.state = State.RUNNING
                    execution.attempts += 1
                    execution.fencing_token = token + 1
                    # The row holds the database's instant; this copy is the worker's estimate.
                    execution.lease_expires_at = now + timedelta(seconds=lease_seconds)
                    execution.worker = worker
                    execution.celery_task_id = celery_task_id
                    execution.started_at = stamp
                    execution.due_at = None
                    data: dict[str, Any] = {"celery_task_id": celery_task_id, "lease_seconds": lease_seconds}
                    if takeover:
                        data["previous_owner"] = previous_owner
                    _event(
                        execution,
                        EventKind.TAKEN_OVER if takeover else EventKind.CLAIMED,
                        from_state=state,
                        to_state=State.RUNNING,
                        actor=worker,
                        data=data,
                        at=now,
                    )
            if ok:
                return Claim("claimed", execution, lease_seconds=lease_seconds)
        fresh = get(execution.pk)
        if fresh.state == state and fresh.fencing_token == token:
            # Nobody moved the row: the database's clock refused the compare-and-set.
            if takeover:
                return _absorb_duplicate(fresh, worker=worker, celery_task_id=celery_task_id)
            if state == State.WAITING:
                return _absorb_superseded(fresh, worker=worker, celery_task_id=celery_task_id)
            return _absorb_early(fresh, worker=worker, celery_task_id=celery_task_id)
        execution = fresh  # somebody else moved it: decide again on fresh data
    raise LedgerError(f"execution {execution.pk}: claim did not settle after 5 tries")


def _own_claim(execution: Execution, worker: str, celery_task_id: str, started_at: datetime) -> bool:
    """The running attempt on ``execution`` was claimed by this very delivery: same owner, same
    message, same start mark (another delivery of the same message in this process, on a
    thread pool, has another mark)."""
    return (
        execution.worker == worker[:255]
        and execution.celery_task_id == celery_task_id[:255]
        and execution.started_at == started_at
    )


def _absorb(execution: Execution, outcome: ClaimOutcome, kind: str, *, worker: str, data: dict[str, Any]) -> Claim:
    """Turn a delivery away without changing the row: the event says why."""
    _event(execution, kind, from_state=execution.state, to_state=execution.state, actor=worker, data=data)
    return Claim(outcome, execution)


def _absorb_duplicate(execution: Execution, *, worker: str, celery_task_id: str) -> Claim:
    data = {"celery_task_id": celery_task_id, "owner": execution.worker}
    return _absorb(execution, "duplicate", EventKind.DUPLICATE_DELIVERY, worker=worker, data=data)


def _absorb_superseded(execution: Execution, *, worker: str, celery_task_id: str) -> Claim:
    """Turn away a delivery for a ``WAITING`` row that is not the row's current message (a
    wake or a republication published a newer one). Nothing is lost: the current message, or
    the rescuer at ``due_at``, brings the row back."""
    data = {"celery_task_id": celery_task_id, "current": execution.celery_task_id}
    return _absorb(execution, "superseded", EventKind.SUPERSEDED_DELIVERY, worker=worker, data=data)


def _absorb_early(execution: Execution, *, worker: str, celery_task_id: str) -> Claim:
    """Turn away a delivery that came before the row may run, without losing the execution.

    The message is dropped (acknowledged), so a stray copy cannot linger into a later
    attempt. The row's ``due_at`` is pulled in to the instant it becomes claimable: if the
    message turned away was the legitimate one (its host's clock ran ahead), the rescuer
    publishes the row then; if it was a stray, the legitimate message normally claims
    first and clears ``due_at``, and any extra copy is absorbed as usual.
    """
    candidates = [execution.lease_expires_at]
    if execution.state == State.RETRYING:
        candidates.append(execution.scheduled_for)
    not_before = max((c for c in candidates if c is not None), default=timezone.now())
    with transaction.atomic():
        if execution.due_at is None or execution.due_at > not_before:
            pulled = _cas(
                execution,
                execution.state,
                execution.fencing_token,
                Q(due_at__isnull=True) | Q(due_at__gt=not_before),
                due_at=not_before,
            )
            if pulled:
                execution.due_at = not_before
        _event(
            execution,
            EventKind.EARLY_DELIVERY,
            from_state=execution.state,
            to_state=execution.state,
            actor=worker,
            data={"celery_task_id": celery_task_id, "not_before": not_before.isoformat()},
        )
    return Claim("early", execution)


def renew_lease(execution_id: int, token: int, lease_seconds: int, *, starting: bool = False) -> bool:
    """Extend the lease of the attempt holding ``token``; False if that attempt lost it.

    Only a live lease is extended (by the database's clock): once it has expired, the
    rescuer or a takeover may already be acting on it, so a late renewal must not revive it.
    ``starting``: the renewal right before a limited body's start slots; it also ends the
    row's run of back-offs (``limit_backoffs``) in the same statement, for nothing slow may
    sit between a start slot and the body. A wait after it still counts from the value the
    worker read with its claim.
    """
    changes: dict[str, Any] = {"lease_expires_at": _db_now(timedelta(seconds=lease_seconds))}
    if starting:
        changes["limit_backoffs"] = 0
    rows = Execution.objects.filter(
        pk=execution_id, state=State.RUNNING, fencing_token=token, lease_expires_at__gt=UtcNow()
    ).update(**changes, updated_at=timezone.now())
    return rows == 1


#: The states of a row whose running attempt an operator stopped (``operator_transition``):
#: cancelled, marked failed, or retried since and parked until the stopped attempt's fence.
_STOPPED = (State.CANCELLED, State.FAILED, State.PENDING)


def extend_fence(execution_id: int, token: int, lease_seconds: int) -> bool:
    """Keep the fence of an attempt an operator stopped while its body still runs; False once
    there is none to keep.

    A stop leaves the attempt's last lease on the row as a fence: no new attempt starts, and
    a flow does not compensate the step, before it passes (``operator_transition``). The stop
    cannot stop the body (a revoke is best effort), so the attempt's lease keeper extends the
    fence while the body runs, by the database's clock, as it renewed the lease: the fence
    then ends within one lease of the body's end, or of its worker's death. Only a live fence
    of the same attempt (its token) on a stopped row is extended.
    """
    rows = Execution.objects.filter(
        pk=execution_id, state__in=_STOPPED, fencing_token=token, lease_expires_at__gt=UtcNow()
    ).update(lease_expires_at=_db_now(timedelta(seconds=lease_seconds)), updated_at=timezone.now())
    return rows == 1


def _note(execution_id: int, kind: str, *, worker: str, data: dict[str, Any]) -> None:
    """Append an event that records something without changing the execution's state."""
    execution = Execution.objects.filter(pk=execution_id).first()
    if execution is not None:
        _event(execution, kind, from_state=execution.state, to_state=execution.state, actor=worker, data=data)


#: The events an attempt writes of its own outcome (``record_lease_lost``).
_OWN_OUTCOMES = (
    EventKind.SUCCEEDED,
    EventKind.RETRY_SCHEDULED,
    EventKind.DEAD_LETTERED,
    EventKind.WAITING_FOR_LIMIT,
)


def record_lease_lost(execution_id: int, token: int, worker: str) -> None:
    """Note in the history that an attempt's lease renewal was refused.

    Not when the attempt had recorded its own outcome (the row is past ``RUNNING`` under its
    token, with its lease cleared): a renewal racing the attempt's own success, retry or dead
    letter is refused for that reason, and a lost lease in a flow step's history makes the
    step "in doubt" (``core/flows.py``), which its own clean failure is not.
    """
    ended_by_itself = (
        Execution.objects.filter(pk=execution_id, fencing_token=token, lease_expires_at__isnull=True)
        .exclude(state=State.RUNNING)
        .exists()
    ) or (
        # Its own outcome, though another attempt has claimed the row since (a short retry's
        # next attempt on another worker, before this keeper's refused renewal was noted).
        ExecutionEvent.objects.filter(
            execution_id=execution_id,
            fencing_token=token,
            actor=worker[:255],
            from_state=State.RUNNING,
            kind__in=_OWN_OUTCOMES,
        ).exists()
    )
    if not ended_by_itself:
        _note(execution_id, EventKind.LEASE_LOST, worker=worker, data={"attempt_token": token})


def succeed(execution: Execution, token: int, result: Any, *, worker: str, data: dict[str, Any]) -> None:
    """Mark the attempt holding ``token`` succeeded, or raise ``StaleExecutionError``.

    Called inside the body's transaction in atomic mode, so the body's writes and this
    mark commit together or not at all.
    """
    now = timezone.now()
    if fastpath.enabled():
        matched = fastpath.succeed(execution.pk, token, result, worker=worker, data=data, now=now)
    else:
        with transaction.atomic():
            matched = _cas(
                execution,
                State.RUNNING,
                token,
                state=State.SUCCEEDED,
                result=result,
                finished_at=now,
                lease_expires_at=None,
                updated_at=now,
            )
            if matched:
                _event(
                    execution,
                    EventKind.SUCCEEDED,
                    from_state=State.RUNNING,
                    to_state=State.SUCCEEDED,
                    actor=worker,
                    data=data,
                    at=now,
                )
    if not matched:
        raise StaleExecutionError(
            f"execution {execution.pk}: success of attempt with fencing token {token} refused "
            f"(the execution was re-claimed, rescued or cancelled meanwhile)",
            execution_id=execution.pk,
            token=token,
        )
    execution.state = State.SUCCEEDED
    execution.result = result
    execution.finished_at = now
    execution.lease_expires_at = None


def record_stale_write(execution_id: int, token: int, *, worker: str, what: str) -> bool:
    """Audit a refused write-back from an attempt that no longer owns the execution.

    Not when the attempt's own success is what refused it: a success whose commit reached the
    server while its reply was lost (an in-doubt commit), retried, finds the row already
    ``SUCCEEDED`` under the same token. That is no stale write; False is returned.
    """
    if (
        what == "succeed"
        and Execution.objects.filter(pk=execution_id, state=State.SUCCEEDED, fencing_token=token).exists()
        and not ExecutionEvent.objects.filter(  # an operator's "mark succeeded" keeps the token
            execution_id=execution_id, kind=EventKind.OPERATOR, to_state=State.SUCCEEDED, fencing_token=token
        ).exists()
    ):
        log.info(
            "the success was recorded already (its first commit's reply was lost)",
            extra={"execution_id": execution_id, "fencing_token": token},
        )
        return False
    _note(execution_id, EventKind.STALE_WRITE_REJECTED, worker=worker, data={"attempt_token": token, "write": what})
    return True


def schedule_retry(
    execution: Execution,
    token: int,
    *,
    delay_seconds: float,
    error: str,
    traceback: str,
    worker: str,
    actor_kind: Actor = Actor.WORKER,
    reason: str = "",
    max_attempts: int | None = None,
) -> bool:
    """Move the attempt holding ``token`` to ``RETRYING`` and arrange the next attempt.

    Delays up to ``max_broker_countdown_seconds`` are published at once with a countdown
    (after commit); longer ones are parked in the ledger and published by the rescuer when
    due, because the Redis transport re-delivers long countdowns after its visibility
    timeout (kombu#337). Returns False (and changes nothing) if ``token`` is stale.

    The next attempt is not claimable before ``scheduled_for`` (see ``claim``). A broker
    countdown's ``due_at`` is a republish check after it; a parked retry's is the due time.
    ``max_attempts``, given by an explicit ``retry(max_retries=...)``, becomes this
    execution's attempts budget (claims and the rescuer honour it over the policy's).
    When the rescuer calls this, the lease must have expired by the database's clock.

    The due time is the database's clock plus the delay, computed by the ``UPDATE`` itself,
    not the caller's: a worker whose clock ran 10 minutes ahead would otherwise write a due
    time 10 minutes late (the claim turns the punctual message away as early, and the
    rescuer publishes the row only then), and one 10 minutes behind a due time already
    passed (the backoff ignored: the rescuer publishes it at once).
    """
    conf = platform_settings()
    now = timezone.now()
    delay = timedelta(seconds=delay_seconds)
    on_broker = delay_seconds <= conf.max_broker_countdown_seconds
    task_id = new_task_id() if on_broker else ""
    publish_count = 1 if on_broker else 0
    find_transition(State.RUNNING, State.RETRYING, actor_kind)
    with transaction.atomic():
        changes: dict[str, Any] = {
            "state": State.RETRYING,
            "scheduled_for": _db_now(delay),
            "due_at": _db_now(delay + republish_interval(1) if on_broker else delay),
            "publish_count": publish_count,
            "lease_expires_at": None,
            "last_error": error,
            "last_traceback": traceback,
            "updated_at": now,
        }
        if task_id:
            changes["celery_task_id"] = task_id
        if max_attempts is not None:
            changes["max_attempts"] = max_attempts
        only_if = [_lease_over()] if actor_kind == Actor.RESCUER else []
        if not _cas(execution, State.RUNNING, token, *only_if, **changes):
            return False
        # The two instants were the database's: read them back (in this transaction).
        changes["scheduled_for"], changes["due_at"] = Execution.objects.values_list("scheduled_for", "due_at").get(
            pk=execution.pk
        )
        eta = changes["scheduled_for"]
        for name, value in changes.items():
            setattr(execution, name, value)
        _event(
            execution,
            EventKind.RESCUED if actor_kind == Actor.RESCUER else EventKind.RETRY_SCHEDULED,
            from_state=State.RUNNING,
            to_state=State.RETRYING,
            actor=worker,
            reason=reason,
            data={
                "delay_seconds": delay_seconds,
                "due": eta.isoformat(),
                "parked_in_ledger": not on_broker,
                "error": error[:1000],
            },
            at=now,
        )
        if on_broker:
            publish_on_commit(execution, task_id=task_id, countdown=delay_seconds)
    return True


def wait_for_limit(
    execution: Execution,
    token: int,
    *,
    delay_seconds: float,
    worker: str,
    reason: str,
    data: dict[str, Any],
    limit_id: int,
    backing_off: bool = False,
) -> bool:
    """Give back the claim of the attempt holding ``token``: a fleet-wide limit is full.

    The row goes ``RUNNING → WAITING`` with its attempt uncounted (``attempts`` back to what
    it was before the claim; the fencing token keeps growing). Like a retry's, a short wait
    rides on the broker as a countdown and a long one is parked; either way ``due_at`` is the
    rescuer's backstop, and a holder that frees a slot of limit ``limit_id`` (the one that
    refused it, kept in ``waiting_on_limit``) wakes its first waiter at once (``wake_waiter``).
    ``backing_off``: the slots could not be counted (the lock backend unreachable, the lease
    ran out while taking them); ``limit_backoffs`` counts such waits in a row, and the worker
    doubles the next one's delay with it (any other wait starts the count again). Returns
    False, changing nothing, if ``token`` is stale.
    """
    conf = platform_settings()
    now = timezone.now()
    delay = timedelta(seconds=max(0.0, delay_seconds))
    on_broker = delay_seconds <= conf.max_broker_countdown_seconds
    task_id = new_task_id() if on_broker else ""
    find_transition(State.RUNNING, State.WAITING, Actor.WORKER)
    with transaction.atomic():
        changes: dict[str, Any] = {
            "state": State.WAITING,
            "attempts": max(0, execution.attempts - 1),
            "due_at": _db_now(delay + republish_interval(1) if on_broker else delay),
            "publish_count": 1 if on_broker else 0,
            "celery_task_id": task_id,
            "lease_expires_at": None,
            "scheduled_for": None,  # for a waiting row: when it was last woken (none yet)
            "waiting_on_limit": limit_id,
            "limit_backoffs": execution.limit_backoffs + 1 if backing_off else 0,
            "updated_at": now,
        }
        if not _cas(execution, State.RUNNING, token, **changes):
            return False
        changes["due_at"] = Execution.objects.values_list("due_at", flat=True).get(pk=execution.pk)
        for name, value in changes.items():
            setattr(execution, name, value)
        _event(
            execution,
            EventKind.WAITING_FOR_LIMIT,
            from_state=State.RUNNING,
            to_state=State.WAITING,
            actor=worker,
            reason=reason,
            data={**data, "delay_seconds": round(delay_seconds, 3), "parked_in_ledger": not on_broker},
            at=now,
        )
        if on_broker:
            publish_on_commit(execution, task_id=task_id, countdown=delay_seconds)
    return True


#: A woken row whose new message has not claimed it after this long may be woken again (its
#: message may have been lost); before that, wakes go to the next waiter.
WOKEN_GRACE = timedelta(seconds=30)


def wake_waiter(limit_id: int, *, actor: str, reason: str) -> bool:
    """Publish the longest-waiting ``WAITING`` execution refused by limit ``limit_id`` now: a
    slot of that limit has just freed. Only a row that waits on this limit: a row of the same
    task waiting on its job's limit would take the slot, be refused by its own limit again and
    give the slot back, and the wake would be lost to the rows that could use it. Its new
    message supersedes the one it had (see ``claim``).
    A row already woken whose message is on its way is passed over (``scheduled_for`` holds
    when a waiting row was woken): two slots freed together wake two waiters, and one row does
    not collect a message per release. False if nothing waits (or every candidate moved)."""
    now = timezone.now()
    for execution in _waiters(limit_id, now - WOKEN_GRACE):
        count = execution.publish_count + 1
        task_id = new_task_id()
        with transaction.atomic():
            if not _cas(
                execution,
                State.WAITING,
                execution.fencing_token,
                Q(celery_task_id=execution.celery_task_id),
                publish_count=count,
                celery_task_id=task_id,
                due_at=_db_now(republish_interval(count)),
                scheduled_for=now,
                updated_at=now,
            ):
                continue
            execution = Execution.objects.select_related("job").get(pk=execution.pk)  # all a message needs
            _event(
                execution,
                EventKind.WOKEN,
                from_state=State.WAITING,
                to_state=State.WAITING,
                actor=actor,
                reason=reason,
                data={"publication": count, "celery_task_id": task_id},
                at=now,
            )
            publish_on_commit(execution, task_id=task_id, countdown=None)
        return True
    return False


def _waiters(limit_id: int, woken_before: datetime) -> list[Execution]:
    """The first few ``WAITING`` rows refused by limit ``limit_id`` not woken since
    ``woken_before``, oldest first. Run after every limited body, and nearly always finding
    none: one fixed statement (the ORM's compilation cost several times the query's own time)
    with the state as a literal, so PostgreSQL and SQLite use the partial index over waiting
    rows (migration 0011)."""
    qn = connection.ops.quote_name
    fields = ("id", "fencing_token", "publish_count", "celery_task_id")
    sql = (
        f"SELECT {', '.join(map(qn, fields))} FROM {qn(Execution._meta.db_table)} "
        f"WHERE {qn('state')} = 'WAITING' AND {qn('waiting_on_limit')} = %s "
        f"AND ({qn('scheduled_for')} IS NULL OR {qn('scheduled_for')} < %s) ORDER BY {qn('id')} LIMIT 3"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit_id, woken_before])
        rows = cursor.fetchall()
    return [Execution(pk=pk, fencing_token=token, publish_count=count, celery_task_id=task_id, state=State.WAITING)
            for pk, token, count, task_id in rows]  # fmt: skip


def recall_waiters(limit_id: int, *, within_seconds: float) -> int:
    """Make the executions refused by limit ``limit_id`` due within ``within_seconds`` (by the
    database's clock), those due later only: the limit was raised or removed. Returns how many."""
    due = _db_now(timedelta(seconds=within_seconds))
    rows = Execution.objects.filter(state=State.WAITING, waiting_on_limit=limit_id, due_at__gt=due)
    return rows.update(due_at=due, updated_at=timezone.now())


#: ``waiting_on_limit`` of a waiting row the rescuer recalled though it named no limit (no
#: limit has this id): it is not recalled again, and a refusal after its claim names the limit.
RECALLED = 0


def recall_unnamed_waiters(*, batch: int = 1000) -> int:
    """Make due now the ``WAITING`` executions that name no limit: parked by a release before
    migration 0011 (or by one of its workers during a rolling deploy), a freed slot never wakes
    them, and their backstops can be hours away. Each is recalled once (``RECALLED`` in its
    limit column): recalled again on every pass, its message would be superseded before a
    worker took it. Run by the rescuer; nearly always none. Returns how many."""
    ids = list(
        Execution.objects.filter(state=State.WAITING, waiting_on_limit__isnull=True)
        .order_by("id")
        .values_list("pk", flat=True)[:batch]
    )
    if not ids:
        return 0
    return Execution.objects.filter(pk__in=ids, state=State.WAITING, waiting_on_limit__isnull=True).update(
        due_at=_db_now(), waiting_on_limit=RECALLED, updated_at=timezone.now()
    )


def count_waiting(
    *, task_name: str | None = None, job_id: int | None = None, limit_id: int | None = None, cap: int = 10_000
) -> int:
    """How many executions of a task (or of a job, or refused by limit ``limit_id``) wait,
    counted up to ``cap`` (the partial indexes over waiting rows make it cheap; a larger
    backlog reads as ``cap``)."""
    qn = connection.ops.quote_name
    value: int | str | None
    if limit_id is not None:
        column, value = "waiting_on_limit", limit_id
    else:
        column, value = ("job_id", job_id) if job_id is not None else ("task_name", task_name)
    sql = (
        f"SELECT COUNT(*) FROM (SELECT 1 FROM {qn(Execution._meta.db_table)} "
        f"WHERE {qn('state')} = 'WAITING' AND {qn(column)} = %s LIMIT {int(cap)}) AS waiting"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [value])
        return int(cursor.fetchone()[0])


def dead_letter(execution: Execution, token: int, *, error: str, traceback: str, worker: str) -> bool:
    """Move the attempt holding ``token`` to the dead-letter state ``FAILED``."""
    if execution.fencing_token != token:
        return False
    return _dead_letter(execution, actor=worker, actor_kind=Actor.WORKER, error=error, traceback=traceback)


def _dead_letter(
    execution: Execution,
    *,
    actor: str,
    actor_kind: Actor,
    error: str,
    traceback: str,
    only_if: Sequence[Q] = (),
    attempt_lost: bool = False,
) -> bool:
    """``attempt_lost``: the last attempt did not end by its own worker recording an outcome
    (its worker was lost); noted in the event, for the flows (``core/flows.py``: such a step
    may have done its work)."""
    source = execution.state
    find_transition(source, State.FAILED, actor_kind)
    now = timezone.now()
    with transaction.atomic():
        if not _cas(
            execution,
            source,
            execution.fencing_token,
            *only_if,
            state=State.FAILED,
            finished_at=now,
            lease_expires_at=None,
            due_at=None,
            last_error=error,
            last_traceback=traceback,
            updated_at=now,
        ):
            return False
        execution.state = State.FAILED
        execution.finished_at = now
        execution.last_error = error
        execution.last_traceback = traceback
        _event(
            execution,
            EventKind.DEAD_LETTERED,
            from_state=source,
            to_state=State.FAILED,
            actor=actor,
            data={"error": error[:1000], **({"attempt_lost": True} if attempt_lost else {})},
            at=now,
        )
    log.warning(
        "execution dead-lettered",
        extra={"execution_id": execution.pk, "idempotency_key": execution.idempotency_key, "error": error},
    )
    return True


# --- the rescuer's side ------------------------------------------------------------------------


def rescue_expired(execution: Execution, *, max_attempts: int, now: datetime) -> str:
    """Handle a ``RUNNING`` row whose lease expired: re-queue it, or dead-letter it.

    Returns ``"rescued"``, ``"dead_lettered"`` or ``"skipped"`` (the row moved meanwhile, or
    its lease is live by the database's clock: renewed since it was read). ``now`` stamps the
    events only: a rescuer host whose clock is behind must not rescue late.
    ``max_attempts`` yields to a budget stored on the row (see ``schedule_retry``).
    """
    if execution.state != State.RUNNING:
        return "skipped"  # whether its lease ran out is the database's clock's call, in the CAS below
    try:
        return _rescue_expired(execution, max_attempts=max_attempts)
    except OperationalError as exc:
        # InnoDB picks one of two transactions that lock the row and its events in opposite
        # orders (the owner renewing its lease, say) and rolls it back whole: nothing was
        # written. The row is read again at the next pass, as a row that moved meanwhile.
        if not _deadlock_victim(exc) or connection.in_atomic_block:
            raise
        log.info(
            "rescue of an expired lease lost a deadlock; retried at the next pass", extra={"execution_id": execution.pk}
        )
        return "skipped"


#: MySQL/MariaDB's "Deadlock found when trying to get lock; try restarting transaction".
_MYSQL_DEADLOCK = 1213


def _deadlock_victim(exc: OperationalError) -> bool:
    return connection.vendor == "mysql" and bool(exc.args) and exc.args[0] == _MYSQL_DEADLOCK


def _rescue_expired(execution: Execution, *, max_attempts: int) -> str:
    owner = execution.worker
    max_attempts = execution.max_attempts or max_attempts
    if execution.attempts >= max_attempts:
        error = (
            f"lease expired during attempt {execution.attempts} (worker {owner} lost or stalled); "
            f"attempts exhausted: {execution.attempts} of {max_attempts}"
        )
        done = _dead_letter(
            execution, actor="rescuer", actor_kind=Actor.RESCUER, error=error, traceback="", only_if=[_lease_over()],
            attempt_lost=True,
        )  # fmt: skip
        return "dead_lettered" if done else "skipped"
    done = schedule_retry(
        execution,
        execution.fencing_token,
        delay_seconds=0,
        error=execution.last_error,
        traceback=execution.last_traceback,
        worker="rescuer",
        actor_kind=Actor.RESCUER,
        reason=f"lease expired during attempt {execution.attempts} (worker {owner} lost or stalled)",
    )
    return "rescued" if done else "skipped"


def republish_due(execution: Execution, *, now: datetime) -> bool:
    """Publish a ``PENDING``/``RETRYING`` row whose ``due_at`` passed without a claim."""
    if execution.state not in CLAIMABLE_STATES:
        return False
    count = execution.publish_count + 1
    task_id = new_task_id()
    with transaction.atomic():
        # Due by the database's clock, and the next check set by it too: a rescuer on a host
        # whose clock runs ahead selects rows early and changes nothing.
        rows = Execution.objects.filter(
            pk=execution.pk,
            state=execution.state,
            fencing_token=execution.fencing_token,
            publish_count=execution.publish_count,
            due_at__lte=UtcNow(),
        ).update(publish_count=count, celery_task_id=task_id, due_at=_db_now(republish_interval(count)), updated_at=now)
        if rows != 1:
            return False
        due_at = Execution.objects.values_list("due_at", flat=True).get(pk=execution.pk)
        first = execution.publish_count == 0
        execution.publish_count = count
        execution.celery_task_id = task_id
        execution.due_at = due_at
        _event(
            execution,
            EventKind.REPUBLISHED,
            from_state=execution.state,
            to_state=execution.state,
            actor="rescuer",
            reason="due" if first else f"not claimed since publication {count - 1}",
            data={
                "publication": count,
                "celery_task_id": task_id,
                "next_check": due_at.isoformat() if due_at else None,
            },
            at=now,
        )
        publish_on_commit(execution, task_id=task_id, countdown=None)
    return True


# --- operators -----------------------------------------------------------------------------------


def operator_transition(
    execution_id: int,
    target: str,
    *,
    user: str,
    reason: str,
    expected_state: str | None = None,
    expected_token: int | None = None,
) -> Execution:
    """Apply an operator's state change along a legal edge, audited with who and why.

    ``expected_state`` (and ``expected_token``, the fencing token) are what the operator
    saw; if the row moved since, nothing changes (so the same form submitted twice acts once,
    even if the row went through another attempt and came back to the same state).

    Stopping a ``RUNNING`` attempt (mark failed, cancel) cannot stop its body: a revoke is
    best effort and does nothing on thread or solo pools. So the row keeps the attempt's
    lease expiry as a *fence*: that attempt may run until then (its renewals already fail,
    the state changed), and no new attempt is claimed before it. A "retry now" of such a
    row is parked until the fence (``due_at``; the rescuer publishes it then) instead of
    published at once; claims compare the fence with the database's clock either way.
    """
    if not reason or not reason.strip():
        raise LedgerError("a reason is required for an operator action")
    execution = get(execution_id)
    source = execution.state
    if expected_state is not None and expected_state != source:
        raise IllegalTransitionError(
            f"execution {execution_id} is {source} now, not {expected_state}: nothing changed",
            source=source,
            target=target,
        )
    if expected_token is not None and expected_token != execution.fencing_token:
        raise IllegalTransitionError(
            f"execution {execution_id} ran another attempt since (token {execution.fencing_token}, "
            f"not {expected_token}): nothing changed",
            source=source,
            target=target,
        )
    transition = find_transition(source, target, Actor.OPERATOR)
    now = timezone.now()
    changes: dict[str, Any] = {"state": target, "updated_at": now}
    data: dict[str, Any] = {"action": transition.name}
    task_id = ""
    fence = execution.lease_expires_at
    if target == State.PENDING:
        # The fence (if any) stays on the row: the claim checks it with the database's clock.
        # Whether to publish now or park until it passes is this host's estimate.
        parked = fence is not None and fence > now
        task_id = "" if parked else new_task_id()
        changes.update(
            attempts=0,  # a fresh attempt budget; the history keeps the earlier attempts
            max_attempts=None,
            scheduled_for=None,
            due_at=fence if parked else now + republish_interval(1),
            publish_count=0 if parked else 1,
            finished_at=None,
        )
        if task_id:
            changes["celery_task_id"] = task_id
        if parked and fence is not None:
            data["not_before"] = fence.isoformat()
    else:
        changes.update(finished_at=now, due_at=None)
        # ``lease_expires_at`` is left as it is, whatever the source: on a RUNNING row it is the
        # stopped attempt's last lease, which becomes the fence; on a PENDING or RETRYING row it
        # can only be such a fence, carried over by an earlier stop, and clearing it here would
        # let a later "retry now" start a body beside the one that may still run.
        if source == State.RUNNING and fence is not None:
            data["fence"] = fence.isoformat()
        if target == State.FAILED:
            changes["last_error"] = f"marked failed by {user}: {reason}"
    with transaction.atomic():
        if not _cas(execution, source, execution.fencing_token, **changes):
            raise IllegalTransitionError(
                f"execution {execution_id} changed while the action was applied: nothing changed",
                source=source,
                target=target,
            )
        for name, value in changes.items():
            setattr(execution, name, value)
        _event(
            execution,
            EventKind.OPERATOR,
            from_state=source,
            to_state=target,
            actor=user,
            reason=reason,
            data=data,
            at=now,
        )
        if task_id:
            publish_on_commit(execution, task_id=task_id, countdown=None)
    return execution


# --- retention ---------------------------------------------------------------------------------

#: States whose rows the retention prunes. Dead letters (``FAILED``) wait for an operator.
PRUNABLE_STATES = (State.SUCCEEDED, State.CANCELLED)


#: Flow runs whose step executions may be pruned like any others.
FINISHED_FLOWS = (FlowState.SUCCEEDED, FlowState.COMPENSATED)


def prune(older_than: datetime, *, batch_size: int = 1000) -> int:
    """Delete succeeded and cancelled executions finished before ``older_than``, events included.

    One batch per call (oldest first), so a large backlog is worked off over several
    maintenance passes without a long transaction. Returns how many executions went.
    """
    with transaction.atomic():
        # Locked, so an operator's retry cannot move a row between this choice and the delete.
        ids = list(
            Execution.objects.select_for_update()
            .filter(state__in=PRUNABLE_STATES, finished_at__lt=older_than)
            # A step of a flow still under way is its run's memory of what ran: without it the
            # run would submit the step (or its compensation) again (review of the flows).
            .exclude(flow_id__in=FlowRun.objects.exclude(state__in=FINISHED_FLOWS).values("pk"))
            .order_by("finished_at")
            .values_list("pk", flat=True)[:batch_size]
        )
        if not ids:
            return 0
        ExecutionEvent.objects.filter(execution_id__in=ids).delete()
        Execution.objects.filter(pk__in=ids).delete()
    log.info("pruned %d executions finished before %s", len(ids), older_than.isoformat())
    return len(ids)
