"""``IdempotentTask``: the Celery task base every platform job runs through.

Each delivery goes claim → run → record against the ledger:

* **claim** — a compare-and-set on the execution row. A delivery for a key another live
  attempt is running is absorbed (``duplicate_delivery``); a key that already succeeded
  returns the stored result without running the body.
* **run** — the body, with ``self.execution``, ``self.idempotency_key`` and
  ``self.fencing_token`` set, while a lease heartbeat runs. With ``atomic = True`` the body
  and the success mark share one database transaction.
* **record** — success, a retry (exponential backoff with full jitter, from Celery's own
  ``autoretry_for`` / ``retry_backoff`` / ``retry_backoff_max`` / ``retry_jitter`` /
  ``max_retries``, overridable per job), or the dead letter with its traceback.

Celery's ``autoretry_for`` wrapper is bypassed: the ledger decides retries, using the same
options, so that attempts are counted by the ledger rather than by message headers and
long delays are parked in the ledger instead of riding the broker.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback as tb_module
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, cast

from celery import Task
from celery.canvas import Signature
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject, Retry, SoftTimeLimitExceeded
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from .. import tracing
from ..conf import platform_settings
from ..core.publisher import HEADER_EXECUTION, HEADER_LEASE, forwarded
from ..core.validation import encode_result, is_idempotent
from ..domain.policies import UNBOUNDED_ATTEMPTS_CAP, resolve_error_classes
from ..exceptions import ConfigurationError, IdempotencyKeyConflictError, StaleExecutionError, TaskError
from ..observability.logs import execution_context, remember_task
from .lazy import lazy_module
from .owner import owner_alive, worker_identity
from .recorder import Parked, success_recorder
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .. import models
    from ..core import flows, leases, ledger, submission
    from ..core import types as core_types
    from ..models import Execution, JobDefinition
    from . import limits
else:
    # Loaded at first use: this module (``taskplatform.tasks``) must import before
    # ``django.setup()``, and these define or import Django models (``worker/lazy.py``).
    models = lazy_module("taskplatform.models")
    leases = lazy_module("taskplatform.core.leases")
    ledger = lazy_module("taskplatform.core.ledger")
    flows = lazy_module("taskplatform.core.flows")
    limits = lazy_module("taskplatform.worker.limits")
    submission = lazy_module("taskplatform.core.submission")
    core_types = lazy_module("taskplatform.core.types")

log = logging.getLogger("taskplatform.tasks")

__all__ = ["UNBOUNDED_ATTEMPTS_CAP", "IdempotentTask", "PlatformRetry"]

#: Pause before a message whose row could not be written goes back to the queue: while the
#: ledger database is down, redeliveries come about this often per pool process.
REQUEUE_PAUSE_SECONDS = 1.0
#: Pause between two tries to record a finished non-atomic body's success while the ledger
#: database is unreachable (see ``_record_while_leased``).
RECORD_RETRY_SECONDS = 1.0


class PlatformRetry(Retry):
    """Raised by ``IdempotentTask.retry()``: the ledger schedules the next attempt."""

    def __init__(self, exc: Exception | None, countdown: float | None, max_retries: int | None) -> None:
        super().__init__(exc=exc, when=cast(Any, countdown))
        self.countdown = countdown
        self.max_retries = max_retries


def _retry_db(fn: Any) -> Any:
    """Run ``fn`` once more on a fresh connection if the current one turned out dead."""
    try:
        return fn()
    except (InterfaceError, OperationalError):
        if connection.in_atomic_block:
            raise
        connection.close()
        return fn()


#: Pause between two tries of a claim while the ledger database is unreachable.
CLAIM_RETRY_SECONDS = 1.0


def _claim_patiently(fn: Any, *, patience: float) -> Any:
    """Run ``fn``, a delivery's claim, retrying on a fresh connection while the database is
    unreachable, for up to ``patience`` seconds (the lease).

    The claim may have committed although its reply was lost; a retry with the same start
    mark adopts it (``ledger.claim``) while its lease is live. Giving up at once and putting
    the message back made the redelivery, with a new mark, absorb itself as a duplicate of
    its own claim: the attempt expired unrun and was counted as spent.
    """
    deadline = time.monotonic() + patience
    pause = 0.0  # the first retry at once: the connection may merely have been a stale one
    while True:
        try:
            return fn()
        except (InterfaceError, OperationalError) as exc:
            if connection.in_atomic_block:
                raise
            connection.close()
            if time.monotonic() + pause >= deadline:
                raise
            log.warning("the ledger is unreachable; retrying the claim: %s", exc, exc_info=pause == 0.0)
        time.sleep(pause)  # an outage must not spin the pool process
        pause = CLAIM_RETRY_SECONDS


def _record_while_leased(fn: Any, watch: leases.Watch) -> Any:
    """Run ``fn``, the success write-back of a finished non-atomic body, retrying on a fresh
    connection while the database is unreachable and the attempt's lease may still be live.

    The body's effects are committed already. Giving up at the first error left the attempt
    to its lease and the rescuer, which ran the body a second time after a database outage of
    a few seconds. The write is fenced by the token, so retrying is safe; once the lease has
    certainly run out (``watch.lost``) the rescuer may act, and the error goes up.
    """
    pause = 0.0  # the first retry at once: the connection may merely have been a stale one
    while True:
        try:
            return fn()
        except (InterfaceError, OperationalError) as exc:
            if connection.in_atomic_block:
                raise
            connection.close()
            if watch.lost:
                raise
            first = pause == 0.0
            log.warning("the ledger is unreachable; retrying to record the success: %s", exc, exc_info=first)
        time.sleep(pause)  # an outage must not spin the pool process
        pause = RECORD_RETRY_SECONDS


def _ignores_result(task: Task, request: Any) -> bool:
    """Whether Celery stores no result for this request: the request's own ``ignore_result``
    (``apply_async(ignore_result=...)``, set on the request only when given) overrides the
    task's, as Celery's tracer decides (``celery.app.task.get_actual_ignore_result``)."""
    explicit = vars(request).get("ignore_result")
    return bool(task.ignore_result if explicit is None else explicit)


def _defer_success(task: Task, request: Any) -> bool:
    """Whether a finished non-atomic body's success goes to the recorder thread
    (``worker/recorder.py``), unless ``TASKPLATFORM_DEFERRED_SUCCESS`` is off. Not when
    something may read the ledger as soon as Celery reports the task done: a result Celery
    stores (once ``.get()`` returns, the ledger says SUCCEEDED; the request's
    ``ignore_result`` overrides the task's, as in Celery), or a callback, chain or chord
    Celery publishes right after the body. Not for ``apply()`` and eager calls, and not on
    SQLite, whose one writer at a time would make the recorder wait for the next body."""
    if request.is_eager or not platform_settings().deferred_success:
        return False
    if not _ignores_result(task, request):
        return False
    if request.callbacks or request.chain or request.chord:
        return False
    execution = getattr(request, "tp_execution", None)
    if execution is not None and execution.flow_id is not None:
        return False  # a flow moves on once this success is written (``core/flows.py``)
    return bool(connection.vendor != "sqlite")


def _success_data(started: float, ended: float, note: str | None) -> dict[str, Any]:
    """The ``succeeded`` event's data: the body's duration, and why the result was not
    stored as returned, if it was not."""
    data: dict[str, Any] = {"duration_ms": round((ended - started) * 1000, 1)}
    if note:
        data["note"] = note
    return data


def _parked_for_claim() -> Parked | None:
    """The success this pool process parked after its previous body, for the claim about to
    run to carry (``worker/recorder.py``): one commit for both. None inside a transaction, whose
    rollback would take the success with it, and where a claim cannot carry one."""
    if connection.in_atomic_block or not connection.get_autocommit() or not ledger.carries_successes():
        return None
    return success_recorder().take()


def _log_forwarded(execution_id: Any, task_id: str, whose: str) -> None:
    """The ERROR of a message run as a call of its own because its ledger headers name an
    execution that is not its (``whose``): under ``forwarded_execution_id``, not
    ``execution_id``, so the parent's execution is not the one the line is filed under."""
    log.error(
        "message carries the ledger headers of execution %s, %s (headers forwarded from a parent task?): "
        "run as a call of its own",
        execution_id,
        whose,
        extra={"forwarded_execution_id": execution_id, "celery_task_id": task_id},
    )


#: The longest task name the ledger stores (``Execution.task_name``; a test keeps them equal).
TASK_NAME_MAX_LENGTH = 200
#: The longest lease a message may ask for (``HEADER_LEASE``): a week.
MAX_HEADER_LEASE_SECONDS = 7 * 24 * 3600


def _retry_message(delay: float, exc: BaseException) -> str:
    """What Celery logs for a scheduled retry: where it waits (the ledger schedules it)."""
    from celery.utils.saferepr import saferepr  # as Celery's own lines: a broken __repr__ cannot raise here

    if delay <= platform_settings().max_broker_countdown_seconds:
        return f"Retry in {delay:.1f}s (published with a broker countdown): {saferepr(exc)}"
    return f"Retry in {delay:.1f}s (parked in the ledger; the rescuer publishes it when due): {saferepr(exc)}"


def _header_lease(headers: dict[str, Any]) -> int | None:
    """The job's lease the publisher put in the message, if it is a sane number of seconds
    (a message from elsewhere may carry anything: then the task's own lease applies)."""
    value = headers.get(HEADER_LEASE)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_HEADER_LEASE_SECONDS:
        return value
    return None


def _ledger_replaceable(app: Any, sig: Any) -> bool:
    """A replacement that ``submit()`` can record: one IdempotentTask, no callbacks, no chord."""
    if type(sig) is not Signature or not isinstance(sig.task, str):
        return False
    if any(sig.options.get(option) for option in ("link", "link_error", "chord", "chain")):
        return False
    return is_idempotent(app.tasks.get(sig.task))


class IdempotentTask(Task):
    """Celery task base: one ledger execution per idempotency key, run at most once at a time.

    Class options (also accepted by ``@shared_task(base=IdempotentTask, ...)``):

    ``atomic``
        Run the body and the success mark in one database transaction (guarantee G3). A body
        that raises ``celery.exceptions.Ignore`` has succeeded with no result: its writes
        commit with the success mark, then ``Ignore`` goes on to Celery. ``self.replace(sig)``
        is such an ``Ignore``; its replacement ``sig`` is published after that commit (and
        not at all if the attempt rolls back).
    ``lease_seconds``
        Lease held while the body runs; default ``TASKPLATFORM_LEASE_SECONDS``.

    Override ``derive_idempotency_key(self, *args, **kwargs)`` to derive a business key (say
    ``f"coupon:{campaign}:{user}"``); by default a plain Celery call is keyed by its task id
    and ``submit()`` by the key it is given (or a fresh one).
    """

    atomic: bool = False
    lease_seconds: int | None = None
    #: Celery's request class for this task: remembers the execution a message names, so
    #: Celery's own log lines about it carry the execution's fields.
    Request = "taskplatform.worker.request:LedgerRequest"
    #: How the core and the beat recognise this class without importing it (``core.validation``).
    taskplatform_idempotent = True
    acks_late = True
    reject_on_worker_lost = True
    ignore_result = True  # the ledger stores results; a result backend is optional

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Refuse a task whose name the ledger cannot store whole (``Execution.task_name``):
        a database that truncates it (MariaDB outside strict mode) would make every message
        of the task name a row of another task."""
        super().on_bound(app)
        name = cls.name
        if isinstance(name, str) and len(name) > TASK_NAME_MAX_LENGTH:
            raise ConfigurationError(
                f"task name {name[:60]!r}… is {len(name)} characters; the ledger stores at most {TASK_NAME_MAX_LENGTH}"
            )

    # --- what the body sees -----------------------------------------------------------

    @property
    def execution(self) -> Execution | None:
        """The ledger row of the attempt being run (None outside a worker run)."""
        return getattr(self.request, "tp_execution", None)

    @property
    def idempotency_key(self) -> Any:
        """The running execution's idempotency key: pass it downstream (``Idempotency-Key``)."""
        execution = self.execution
        return execution.idempotency_key if execution is not None else None

    @property
    def fencing_token(self) -> int | None:
        """Increases on every claim; pass it downstream so stale writers can be refused."""
        execution = self.execution
        return execution.fencing_token if execution is not None else None

    @property
    def lease_lost(self) -> bool:
        """True once this attempt no longer owns its key: a lease renewal was refused, or
        renewals kept failing until the lease had certainly run out."""
        watch: leases.Watch | None = getattr(self.request, "tp_watch", None)
        if watch is None:
            return False
        leases.lease_keeper().ensure_running()  # a body that polls this also revives a dead keeper
        return watch.lost

    def derive_idempotency_key(self, *args: Any, **kwargs: Any) -> str | None:
        """Override to derive a business key from the arguments; None uses the task id."""
        return None

    # --- policy -----------------------------------------------------------------------

    def retry_policy(self, job: JobDefinition | None = None) -> RetryPolicy:
        """This task's Celery retry options, with the job definition's overrides applied."""
        max_retries = self.max_retries
        max_attempts = UNBOUNDED_ATTEMPTS_CAP if max_retries is None else int(max_retries) + 1
        backoff = getattr(self, "retry_backoff", False)
        base = 0 if backoff is False else int(max(1.0, float(backoff)))
        cap = int(getattr(self, "retry_backoff_max", 600))
        jitter = bool(getattr(self, "retry_jitter", True))
        retry_on = tuple(getattr(self, "autoretry_for", ()) or ())
        fatal = tuple(getattr(self, "dont_autoretry_for", ()) or ())
        if job is not None:
            if job.max_attempts:
                max_attempts = job.max_attempts
            if job.backoff_base_seconds is not None:
                base = job.backoff_base_seconds
            if job.backoff_max_seconds is not None:
                cap = job.backoff_max_seconds
            if job.jitter is not None:
                jitter = job.jitter
            if job.retry_on:
                retry_on = resolve_error_classes(job.retry_on)
            if job.fatal_errors:
                fatal = fatal + resolve_error_classes(job.fatal_errors)
        return RetryPolicy(
            max_attempts=max_attempts,
            backoff_base_seconds=base,
            backoff_max_seconds=cap,
            jitter=jitter,
            fixed_delay_seconds=int(self.default_retry_delay or 0),
            retry_on=retry_on,
            fatal=fatal,
        )

    def lease_for(self, job: JobDefinition | None) -> int:
        if job is not None and job.lease_seconds:
            return job.lease_seconds
        return self.lease_seconds or platform_settings().lease_seconds

    # --- the protocol -----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or not request.id:
            return super().__call__(*args, **kwargs)  # a plain function call: no ledger
        if tracing.ACTIVE:
            return self._run_traced(request, args, kwargs)
        return self._run_under_ledger(request, args, kwargs)

    def _run_traced(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``_run_under_ledger`` inside a ``taskplatform.attempt`` span saying how it ended
        (``tracing``): succeeded, absorbed, retry (with its delay and where it waits), failed."""
        attributes = {"taskplatform.task": self.name, "celery.task_id": request.id}
        with tracing.span("taskplatform.attempt", attributes, record_errors=False) as span:
            try:
                result = self._run_under_ledger(request, args, kwargs)
            except Retry as exc:
                delay = float(exc.when) if isinstance(exc.when, (int, float)) else 0.0
                parked = delay > platform_settings().max_broker_countdown_seconds
                outcome = getattr(request, "tp_outcome", None) or "retry"
                span.set_attributes(
                    {"taskplatform.outcome": outcome, "taskplatform.retry_in_s": delay, "taskplatform.parked": parked}
                )
                span.record_exception(exc.exc or exc)
                raise
            except Ignore:
                span.set_attribute("taskplatform.outcome", getattr(request, "tp_outcome", None) or "succeeded (Ignore)")
                raise
            except Reject:
                span.set_attribute("taskplatform.outcome", "requeued")
                raise
            except BaseException as exc:
                span.set_attribute("taskplatform.outcome", getattr(request, "tp_outcome", None) or "failed")
                span.record_exception(exc)
                span.set_status(tracing.error_status(str(exc)))
                raise
            claimed = getattr(request, "tp_execution", None) is not None
            outcome = getattr(request, "tp_outcome", None) or ("succeeded" if claimed else "absorbed")
            span.set_attribute("taskplatform.outcome", outcome)
            return result

    def _claim(
        self, request: Any, worker: str, args: tuple[Any, ...], kwargs: dict[str, Any], started_at: datetime
    ) -> core_types.Claim | None:
        """Claim the execution this delivery is for (creating it first for a plain Celery call).

        ``started_at`` is the same on a retry after a database error, so a claim that committed
        although its reply was lost is recognised as this delivery's own (``ledger.claim``).
        """
        parked: Parked | None = None
        try:
            parked = _parked_for_claim()
            try:
                return self._claim_carrying(request, worker, args, kwargs, started_at, parked)
            except DatabaseError as exc:
                # Refused, not unreachable: perhaps for what the success carried. The success
                # goes to the recorder, and the claim is made again alone, so one bad success
                # cannot fail another execution's delivery.
                if parked is None or parked.attempt.written is not None:
                    raise
                if isinstance(exc, (InterfaceError, OperationalError)):
                    raise
                log.warning("a claim carrying a success was refused; claiming alone", exc_info=True)
            refused, parked = parked, None
            success_recorder().settle(refused)
            return self._claim_carrying(request, worker, args, kwargs, started_at, None)
        finally:
            if parked is not None:
                success_recorder().settle(parked)

    def _claim_carrying(
        self,
        request: Any,
        worker: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        started_at: datetime,
        parked: Parked | None,
    ) -> core_types.Claim | None:
        carried = parked.attempt if parked is not None else None
        headers = request.headers or {}
        execution_id = headers.get(HEADER_EXECUTION)
        if execution_id is not None and forwarded(headers, request.id):
            # Another message's ledger headers, forwarded by a parent to this child (of this
            # task or another): its execution is not this message's, which neither claims it
            # (with its own arguments, while the parent waits for a retry) nor is absorbed.
            _log_forwarded(execution_id, request.id, "of another message")
            execution_id = None
        if execution_id is not None:
            delivery = core_types.Delivery(int(execution_id), self.name, list(args), dict(kwargs), worker, request.id)
            claim = ledger.claim_message(
                delivery,
                default_lease_seconds=_header_lease(headers) or self.lease_for(None),
                lease_seconds_for=self.lease_for,
                max_attempts_for=lambda job: self.retry_policy(job).max_attempts,
                owner_alive=owner_alive,
                started_at=started_at,
                carried=carried,
            )
            if claim is None:
                log.error(
                    "message for a missing execution dropped (pruned, or published before commit)",
                    extra={"execution_id": execution_id, "celery_task_id": request.id},
                )
            if claim is None or claim.outcome != "foreign":
                return claim
            _log_forwarded(execution_id, request.id, f"of task {claim.execution.task_name}")
            carried = None  # the claim's statement carried it, or the recorder writes it (``settle``)
        key = self.derive_idempotency_key(*args, **kwargs)
        if not key:
            # A replacement made by ``self.replace()`` inherits its parent's task id: it is
            # another execution, and must not be absorbed by the parent's (finished) row.
            nesting = int(getattr(request, "replaced_task_nesting", 0) or 0)
            key = f"{request.id}:replaced:{nesting}" if nesting else request.id
        delivery_info = request.delivery_info or {}
        spec = core_types.NewExecution(
            idempotency_key=str(key)[:255],
            task_name=self.name,
            args=list(args),
            kwargs=dict(kwargs),
            trigger=models.Trigger.CELERY,
            queue=str(delivery_info.get("routing_key") or "")[:100],
            celery_task_id=request.id,
            publish_count=1,
            trace_context=tracing.traceparent(),
        )
        lease_seconds = self.lease_for(None)  # a plain call has no job definition
        created = ledger.create_claimed(
            spec,
            worker=worker,
            celery_task_id=request.id,
            lease_seconds=lease_seconds,
            started_at=started_at,
            carried=carried,
        )
        if created is not None:
            return created
        execution = ledger.ensure(spec)
        if execution.task_name != self.name:
            # The key (derived from this call's arguments) names an execution of another task:
            # absorbed by it, this call would silently never run. Refused, loudly: keys are
            # global, and a derived key should name its task.
            raise IdempotencyKeyConflictError(
                f"idempotency key {execution.idempotency_key!r} of this {self.name} call already names "
                f"execution {execution.pk} of task {execution.task_name!r}; derive keys that name their task",
                execution_id=execution.pk,
            )
        return ledger.claim(
            execution,
            worker=worker,
            celery_task_id=request.id,
            lease_seconds=self.lease_for(execution.job),
            max_attempts=self.retry_policy(execution.job).max_attempts,
            owner_alive=owner_alive,
            started_at=started_at,
        )

    def _run_under_ledger(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        worker = worker_identity(request.hostname or "local")
        started_at = timezone.now()
        try:
            claim = _claim_patiently(
                lambda: self._claim(request, worker, args, kwargs, started_at), patience=self.lease_for(None)
            )
        except (InterfaceError, OperationalError) as exc:
            # The claim could not be made (the ledger is unreachable from this worker). A plain
            # Celery call's message is the only record of the work; a submitted execution's row
            # would wait for the rescuer's next look (minutes, and a rescuer that can reach the
            # database may not exist during a partition of this host). Either way the message
            # goes back to the queue rather than be acknowledged as a failure. Other database
            # errors (a value the database refuses) would fail every time: they are not requeued.
            log.error(
                "the ledger is unreachable; the message goes back to the queue",
                exc_info=True,
                extra={"celery_task_id": request.id},
            )
            time.sleep(REQUEUE_PAUSE_SECONDS)  # not synchronisation: an outage must not spin the pool
            raise Reject(exc, requeue=True) from exc
        if claim is None:
            return None
        execution = claim.execution
        # An absorbed duplicate holds no token of its own (claim.token is the running attempt's).
        own_token = claim.token if claim.outcome == "claimed" else None
        remember_task(request.id, execution.pk, execution.idempotency_key, own_token, tracing.current_trace_id())
        if tracing.ACTIVE:
            tracing.annotate(
                {
                    "taskplatform.execution_id": execution.pk,
                    "taskplatform.idempotency_key": execution.idempotency_key,
                    "taskplatform.attempt": execution.attempts,
                    "taskplatform.fencing_token": own_token,
                    "taskplatform.claim": claim.outcome,
                }
            )
        with execution_context(execution.pk, execution.idempotency_key, own_token):
            return self._run_claimed(request, claim, worker, args, kwargs)

    def _run_claimed(
        self, request: Any, claim: core_types.Claim, worker: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        execution = claim.execution
        if claim.outcome != "claimed":
            log.info(
                "delivery absorbed: %s",
                claim.outcome,
                extra={"execution_id": execution.pk, "idempotency_key": execution.idempotency_key},
            )
            if claim.outcome == "exhausted" and execution.flow_id is not None:
                # This delivery dead-lettered a step whose last attempt was lost: its flow moves
                # on now, not at the rescuer's next look at the run (``flows.CHECK_SECONDS``).
                flows.advance_quietly(execution.flow_id)
            return execution.result if claim.outcome == "finished" else None

        token = claim.token
        held: limits.Held | None = None
        renewed_at: float | None = None  # when the lease was last extended, if not by the claim
        taken: limits.Held | limits.Refusal | None = None
        applicable = limits.rules_for(execution)
        try:
            if applicable:  # a fleet-wide limit: a slot of each, or the execution waits
                # Taking the slots may outlast the lease (a lock server slow to answer, many
                # slot names on Redlock): the rescuer may have re-queued the row and another
                # attempt claimed it. The body starts only while this attempt still holds a
                # live lease: ``acquire`` renews it once the running slots are taken, before
                # the start slots, and the lease keeper counts from that renewal.
                def confirm() -> bool:
                    nonlocal renewed_at
                    sent = time.monotonic()
                    renewed = bool(
                        _retry_db(lambda: ledger.renew_lease(execution.pk, token, claim.lease_seconds, starting=True))
                    )
                    renewed_at = sent if renewed else None
                    return renewed

                taken = limits.acquire(
                    applicable, execution, lease_seconds=claim.lease_seconds, worker=worker, confirm=confirm
                )
                if isinstance(taken, limits.Refusal):
                    if taken.kind == "lease":
                        log.warning(
                            "lease ran out while the limits' slots were taken; the body does not start",
                            extra={"execution_id": execution.pk, "fencing_token": token},
                        )
                    # If nobody has acted on the row yet, the claim is given back uncounted and
                    # the execution waits; if the rescuer or another attempt has, the wait is
                    # refused as stale.
                    return self._wait_for_limit(request, execution, token, taken, worker)
                held = taken
            request.tp_execution = execution
            request.retries = execution.attempts - 1
            watch = leases.lease_keeper().watch(execution.pk, token, claim.lease_seconds, worker, renewed_at=renewed_at)
            request.tp_watch = watch
        except BaseException:
            # Between the slots and the body (a soft time limit, a keeper that cannot start its
            # thread, a database error): the slots go back, or the slot keeper would renew
            # them for as long as this process lives and the limit would be one short for good.
            if held is None and isinstance(taken, limits.Held):
                held = taken  # raised between acquire's return and the assignment
            if held is not None:
                limits.give_back(held, worker=worker)
            raise
        body = getattr(self, "_orig_run", self.run)  # bypass Celery's autoretry wrapper
        started = time.monotonic()
        returned = False  # set once the body returned: later errors are the ledger's, not the body's
        deferred = False  # the success handed to the recorder, which stops the lease's renewal
        try:
            if self.atomic:
                ignored: Ignore | None = None
                try:
                    with transaction.atomic():
                        try:
                            result = body(*args, **kwargs)
                        except Ignore as exc:
                            # Ignore (also raised by self.replace()) ends the body as a success: its
                            # writes must commit with the success mark, not be rolled back under it.
                            ignored, result = exc, None
                        returned = True
                        note = "body raised Ignore" if ignored is not None else ""
                        self._record_success(execution, token, result, worker, started, note=note)
                finally:
                    # The body ran and its transaction ended: its limits' slots free now (the
                    # wake is published after this commit, never inside the body's transaction).
                    limits.release(held, worker=worker)
                if ignored is not None:
                    raise ignored
            else:
                try:
                    result = body(*args, **kwargs)
                finally:
                    # The body ended: the slots of its limits free now, not after the success is
                    # written (which the recorder may do a little later).
                    limits.release(held, worker=worker)
                returned = True
                if _defer_success(self, request):
                    deferred = self._hand_over_success(execution, token, result, worker, started, watch)
                    if deferred:
                        return result
                self._record_finished(execution, token, result, worker, started, watch)
            return result
        except StaleExecutionError as exc:
            if ledger.record_stale_write(execution.pk, token, worker=worker, what="succeed"):
                log.warning(str(exc), extra={"execution_id": execution.pk, "fencing_token": token})
                request.tp_outcome = "stale: another attempt owns the execution"
                return None
            return result  # this attempt's own success, recorded by a commit whose reply was lost
        except Ignore:
            if not returned:  # not atomic: the body's writes are committed already
                try:
                    _record_while_leased(
                        lambda: self._record_success(
                            execution, token, None, worker, started, note="body raised Ignore"
                        ),
                        watch,
                    )
                except StaleExecutionError as exc:  # a sibling handler would not see it
                    if ledger.record_stale_write(execution.pk, token, worker=worker, what="succeed"):
                        log.warning(str(exc), extra={"execution_id": execution.pk, "fencing_token": token})
            raise
        except PlatformRetry as exc:
            self._record_failure(execution, token, exc.exc or exc, worker, started, explicit=exc)
        except Retry as exc:  # raised by the body directly, Celery style
            countdown = exc.when if isinstance(exc.when, (int, float)) else None
            explicit = PlatformRetry(exc.exc, countdown, None)
            self._record_failure(execution, token, exc.exc or exc, worker, started, explicit=explicit)
        except Exception as exc:
            if returned:
                # The body finished but its success could not be recorded (database down, or
                # the commit's outcome unknown). Not a body failure: the attempt stays RUNNING,
                # its lease expires and the rescuer re-queues it. In atomic mode the body's
                # writes were rolled back with the mark; otherwise downstream effects must be
                # idempotent on ``idempotency_key``.
                log.error(
                    "success of a finished body could not be recorded; the rescuer will re-queue it",
                    exc_info=True,
                    extra={"execution_id": execution.pk, "fencing_token": token},
                )
                request.tp_outcome = "unrecorded: left to the rescuer"
                raise
            self._record_failure(execution, token, exc, worker, started)
        finally:
            if not deferred:
                leases.lease_keeper().unwatch(watch)
            limits.release(held, worker=worker)  # released with the body already; here if that raised first
            if execution.flow_id is not None:
                flows.advance_quietly(execution.flow_id)  # the step's outcome is written: the flow's next move
        raise AssertionError("unreachable")  # pragma: no cover - _record_failure always raises

    def _wait_for_limit(
        self, request: Any, execution: Execution, token: int, refusal: limits.Refusal, worker: str
    ) -> NoReturn:
        """The claim found a fleet-wide limit full: give it back; the execution waits in the
        ledger and is published again when a slot frees (``worker/limits.py``)."""
        if _retry_db(lambda: limits.wait(execution, token, refusal, worker=worker)):
            request.tp_outcome = f"waiting: {refusal.reason}"
            log.info(
                "limit reached; the execution waits for a slot: %s",
                refusal.reason,
                extra={"execution_id": execution.pk, "wait_seconds": round(refusal.delay_seconds, 2)},
            )
        else:
            ledger.record_stale_write(execution.pk, token, worker=worker, what="wait_for_limit")
            request.tp_outcome = "stale: another attempt owns the execution"
        # Not a return: Celery would take the delivery for a success and run its callbacks, the
        # rest of its chain, its chord's body, with None, before the body has run. ``Ignore``
        # ends the delivery with none of that (a limited task does not compose with canvas:
        # its result is the ledger's, read from the execution).
        raise Ignore("waiting for a slot of a fleet-wide limit")

    def on_replace(self, sig: Any) -> Any:
        """``self.replace(sig)``: the replacement goes through the ledger when it can.

        A replacement by one ``IdempotentTask`` (a plain signature, no callbacks, no chord) is
        submitted as an execution keyed from this one (``<key>:replaced``) in the attempt's own
        transaction: its row exists before its message (G1: nothing can lose it between commit
        and publish), in atomic mode it is published only when the body's writes and success
        commit (a stale attempt rolls it back), and a parent run twice (rescued after it had
        already replaced itself) replaces itself once. A chain, a group or a signature with
        callbacks keeps Celery's own publication, after the commit in atomic mode.
        """
        execution = self.execution
        if execution is None or self.request.is_eager:
            return super().on_replace(sig)
        if execution.flow_id is not None:
            # The flow would take the replaced step for done and move on before the replacement
            # ran, and nothing would undo the replacement's work: refused, the step fails.
            raise TaskError(
                "a flow's step cannot replace itself (self.replace): its flow would move on before "
                "the replacement ran; make the replacement a step of the flow"
            )
        if _ledger_replaceable(self.app, sig):
            key = f"{execution.idempotency_key}:replaced"
            if len(key) > 255:
                key = f"execution:{execution.pk}:replaced"
            try:
                submission.submit(
                    sig.task, list(sig.args), dict(sig.kwargs), idempotency_key=key,
                    queue=sig.options.get("queue"), priority=sig.options.get("priority"),
                )  # fmt: skip
            except IdempotencyKeyConflictError:
                # An earlier attempt of this execution already replaced itself (with other
                # arguments): that replacement stands.
                log.warning("replacement already recorded by an earlier attempt", extra={"execution_id": execution.pk})
            raise Ignore("Replaced by new task")
        if not (self.atomic and connection.in_atomic_block):
            return super().on_replace(sig)
        execution_id = execution.pk

        def publish() -> None:
            try:
                sig.delay()
            except Exception:
                # The attempt has committed as SUCCEEDED: nothing re-runs it. Say so loudly.
                log.error(
                    "the replacement of a succeeded atomic task could not be published",
                    exc_info=True,
                    extra={"execution_id": execution_id},
                )

        transaction.on_commit(publish)
        raise Ignore("Replaced by new task")

    def _record_finished(
        self,
        execution: Execution,
        token: int,
        result: Any,
        worker: str,
        started: float,
        watch: leases.Watch,
        until: float | None = None,
        encoded: tuple[Any, str | None] | None = None,
    ) -> None:
        """The success of a finished non-atomic body, retried while its lease may be live."""

        def write() -> None:
            self._record_success(execution, token, result, worker, started, until=until, encoded=encoded)

        _record_while_leased(write, watch)

    def _hand_over_success(
        self,
        execution: Execution,
        token: int,
        result: Any,
        worker: str,
        started: float,
        watch: leases.Watch,
    ) -> bool:
        """Give the success write of a finished non-atomic body to the recorder thread
        (``worker/recorder.py``): what the pool process would do, with the lease renewed until
        it lands. The result is encoded here, now: a shared object the next body or a hook
        changes must not change it. False if the recorder could not take it (no thread could
        be started, say): the caller writes it itself."""
        ended = time.monotonic()
        encoded = encode_result(result, copy=True)

        def write() -> None:
            with execution_context(execution.pk, execution.idempotency_key, token):
                try:
                    self._record_finished(
                        execution, token, result, worker, started, watch, until=ended, encoded=encoded
                    )
                except StaleExecutionError as exc:
                    if ledger.record_stale_write(execution.pk, token, worker=worker, what="succeed"):
                        log.warning(str(exc), extra={"execution_id": execution.pk, "fencing_token": token})
                except Exception:
                    log.error(
                        "success of a finished body could not be recorded; the rescuer will re-queue it",
                        exc_info=True,
                        extra={"execution_id": execution.pk, "fencing_token": token},
                    )
                    connection.close()
                finally:
                    leases.lease_keeper().unwatch(watch)

        try:
            if ledger.carries_successes():
                stored, why_not = encoded
                attempt = core_types.FinishedAttempt(
                    execution.pk, token, stored, worker, _success_data(started, ended, why_not), timezone.now()
                )
                success_recorder().park(
                    Parked(attempt, write, self._carried_success(execution, token, worker, watch), watch)
                )
            else:
                success_recorder().record(write, watch)
        except Exception:
            log.warning("the success recorder could not take a success; writing it here", exc_info=True)
            return False
        return True

    @staticmethod
    def _carried_success(execution: Execution, token: int, worker: str, watch: leases.Watch) -> Callable[[bool], None]:
        """What follows a parked success that the next claim's statement wrote (True) or found
        stale (False): as after the recorder's own write. Never raises into that claim."""

        def finish(written: bool) -> None:
            try:
                if not written:
                    with execution_context(execution.pk, execution.idempotency_key, token):
                        if ledger.record_stale_write(execution.pk, token, worker=worker, what="succeed"):
                            log.warning(
                                "execution %s: success of attempt with fencing token %s refused (the execution "
                                "was re-claimed, rescued or cancelled meanwhile)",
                                execution.pk,
                                token,
                                extra={"execution_id": execution.pk, "fencing_token": token},
                            )
            except SoftTimeLimitExceeded:
                # Raised here, a soft limit is a late one of the task that finished (its timer
                # raced its end): the next task's claim has committed, and must not be failed by it.
                log.warning(
                    "a late soft time limit of a finished task was ignored", extra={"execution_id": execution.pk}
                )
            except Exception:
                log.error("a refused success could not be audited", exc_info=True, extra={"execution_id": execution.pk})
            finally:
                leases.lease_keeper().unwatch(watch)

        return finish

    def _record_success(
        self,
        execution: Execution,
        token: int,
        result: Any,
        worker: str,
        started: float,
        note: str = "",
        until: float | None = None,
        encoded: tuple[Any, str | None] | None = None,
    ) -> None:
        stored, why_not = encoded if encoded is not None else encode_result(result)
        ended = time.monotonic() if until is None else until
        ledger.succeed(execution, token, stored, worker=worker, data=_success_data(started, ended, why_not or note))

    def _record_failure(
        self,
        execution: Execution,
        token: int,
        exc: BaseException,
        worker: str,
        started: float,
        explicit: PlatformRetry | None = None,
    ) -> None:
        """Record a failed attempt as a retry or a dead letter, then raise for Celery."""
        request: Any = self.request  # its ``tp_outcome`` is read by the attempt's span (``_run_traced``)
        policy = self.retry_policy(execution.job)  # read now: a job edit applies to this retry
        error = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
        trace = "".join(tb_module.format_exception(exc)) if exc.__traceback__ else ""
        # An explicit retry(max_retries=N) sets this execution's budget; the ledger keeps it.
        max_attempts = execution.max_attempts or policy.max_attempts
        budget = None
        if explicit is not None and explicit.max_retries is not None:
            max_attempts = budget = explicit.max_retries + 1
        verdict = "retry" if explicit is not None else policy.classify(exc)
        duration_ms = round((time.monotonic() - started) * 1000, 1)
        if verdict == "retry" and execution.attempts < max_attempts:
            if explicit is not None and explicit.countdown is not None:
                delay: float = max(0.0, float(explicit.countdown))
            else:
                delay = policy.delay_seconds(execution.attempts)
            scheduled = _retry_db(
                lambda: ledger.schedule_retry(
                    execution,
                    token,
                    delay_seconds=delay,
                    error=error,
                    traceback=trace,
                    worker=worker,
                    reason=f"attempt {execution.attempts} of {max_attempts} failed after {duration_ms} ms",
                    max_attempts=budget,
                )
            )
            if not scheduled:
                ledger.record_stale_write(execution.pk, token, worker=worker, what="schedule_retry")
                request.tp_outcome = "stale: another attempt owns the execution"
            raise Retry(
                message=_retry_message(delay, exc),
                exc=exc if isinstance(exc, Exception) else None,
                when=cast(Any, delay),
            )
        if verdict == "retry":
            error = f"{error} (attempts exhausted: {execution.attempts} of {max_attempts})"
        if _retry_db(lambda: ledger.dead_letter(execution, token, error=error, traceback=trace, worker=worker)):
            request.tp_outcome = "dead letter"
        else:
            ledger.record_stale_write(execution.pk, token, worker=worker, what="dead_letter")
            request.tp_outcome = "stale: another attempt owns the execution"
        if explicit is not None and not isinstance(exc, Exception):
            raise MaxRetriesExceededError(error)
        raise exc

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Ask for another attempt: the ledger schedules it (or dead-letters when exhausted).

        Same signature as Celery's ``Task.retry``; ``countdown``/``eta`` set the delay,
        otherwise the job's backoff policy does. Changing ``args``/``kwargs`` on retry is
        not supported: an execution's arguments are fixed in the ledger.
        """
        if self.execution is None:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        if exc is None:
            current = sys.exc_info()[1]
            exc = current if isinstance(current, Exception) else None
        if countdown is None and eta is not None:
            countdown = max(0.0, (eta - timezone.now()).total_seconds())
        raise PlatformRetry(exc, countdown, max_retries)
