"""``submit()``: how views, services and the beat start work, with the ledger row written first."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, overload

from django.db import transaction
from django.utils import timezone

from .. import tracing
from ..conf import platform_settings
from ..exceptions import (
    IdempotencyKeyConflictError,
    InvalidArgumentsError,
    InvalidIdempotencyKeyError,
    SubmissionError,
)
from ..models import Execution, JobDefinition, Trigger
from . import ledger
from .publisher import new_task_id, publish, publish_many, publish_many_on_commit, publish_on_commit
from .types import NewExecution
from .validation import check_idempotency_key, encode_arguments, resolve_task

if TYPE_CHECKING:
    from celery import Task


def submit(
    task_or_name: Task | str | JobDefinition,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    idempotency_key: str | None = None,
    countdown: float | None = None,
    eta: datetime | None = None,
    queue: str | None = None,
    priority: int | None = None,
    on_commit: bool = True,
    trigger: str = Trigger.API,
    slot: datetime | None = None,
) -> Execution:
    """Record an execution in the ledger and publish it once the transaction commits.

    The options are documented on ``submit_or_get``, which also says whether the call
    created the execution.
    """
    execution, _created = submit_or_get(
        task_or_name, args, kwargs, idempotency_key=idempotency_key, countdown=countdown, eta=eta, queue=queue,
        priority=priority, on_commit=on_commit, trigger=trigger, slot=slot,
    )  # fmt: skip
    return execution


def submit_or_get(
    task_or_name: Task | str | JobDefinition,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    idempotency_key: str | None = None,
    countdown: float | None = None,
    eta: datetime | None = None,
    queue: str | None = None,
    priority: int | None = None,
    on_commit: bool = True,
    trigger: str = Trigger.API,
    slot: datetime | None = None,
) -> tuple[Execution, bool]:
    """``submit()``, also saying whether this call created the execution (False: the key existed).

    Record an execution in the ledger and publish it once the transaction commits.

    ``task_or_name`` is an ``IdempotentTask``, its registered name, or a ``JobDefinition``
    (whose task, default arguments, queue, priority, time limits and retry policy apply).
    The same ``idempotency_key`` always returns the same execution, which is published only
    once; reusing a key for a different task or different arguments is refused. Without a
    key, a task's ``derive_idempotency_key`` decides, else every call is a new execution.

    Invalid input raises a ``SubmissionError`` subclass and records nothing. A broker that
    is down does not fail the call: the row waits and the rescuer publishes it.

    ``slot`` is the schedule slot a beat publication is for; it is recorded as the
    execution's ``scheduled_for`` (its lateness is ``created_at - scheduled_for``).
    """
    if not tracing.ACTIVE:
        return _submit_or_get(
            task_or_name, args, kwargs, idempotency_key=idempotency_key, countdown=countdown, eta=eta, queue=queue,
            priority=priority, on_commit=on_commit, trigger=trigger, slot=slot,
        )  # fmt: skip
    name = task_or_name.task if isinstance(task_or_name, JobDefinition) else getattr(task_or_name, "name", task_or_name)
    with tracing.span("taskplatform.submit", {"taskplatform.task": name, "taskplatform.trigger": trigger}):
        execution, created = _submit_or_get(
            task_or_name, args, kwargs, idempotency_key=idempotency_key, countdown=countdown, eta=eta, queue=queue,
            priority=priority, on_commit=on_commit, trigger=trigger, slot=slot,
        )  # fmt: skip
        tracing.annotate(
            {
                "taskplatform.execution_id": execution.pk,
                "taskplatform.idempotency_key": execution.idempotency_key,
                "taskplatform.created": created,
            }
        )
        return execution, created


def _submit_or_get(
    task_or_name: Task | str | JobDefinition,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    idempotency_key: str | None,
    countdown: float | None,
    eta: datetime | None,
    queue: str | None,
    priority: int | None,
    on_commit: bool,
    trigger: str,
    slot: datetime | None,
    flow_id: int | None = None,
) -> tuple[Execution, bool]:
    spec, delay = _spec(
        task_or_name, args, kwargs, idempotency_key=idempotency_key, countdown=countdown, eta=eta, queue=queue,
        priority=priority, trigger=trigger, slot=slot, flow_id=flow_id,
    )  # fmt: skip
    key, task_id, args_list, kwargs_dict = spec.idempotency_key, spec.celery_task_id, spec.args, spec.kwargs
    execution, created = ledger.create(spec)
    if not created:
        if execution.task_name != spec.task_name or execution.args != args_list or execution.kwargs != kwargs_dict:
            raise IdempotencyKeyConflictError(
                f"idempotency key {key!r} already names execution {execution.pk} of task "
                f"{execution.task_name!r} with other arguments; use a new key for new work",
                execution_id=execution.pk,
            )
        return execution, False
    if task_id:  # not parked in the ledger
        if on_commit:
            publish_on_commit(execution, task_id=task_id, countdown=delay or None, robust=False)
        else:
            publish(execution, task_id=task_id, countdown=delay or None)
    return execution, True


def _spec(
    task_or_name: Task | str | JobDefinition,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    idempotency_key: str | None,
    countdown: float | None,
    eta: datetime | None,
    queue: str | None,
    priority: int | None,
    trigger: str,
    slot: datetime | None,
    flow_id: int | None = None,
) -> tuple[NewExecution, float]:
    """What ``submit()`` records (checked: a ``SubmissionError`` for bad input), and its broker
    countdown (0: none). A delay beyond ``TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS`` is parked
    in the ledger: no task id, nothing to publish now."""
    job: JobDefinition | None = None
    if isinstance(task_or_name, JobDefinition):
        job = task_or_name
        task = resolve_task(job.task)
    else:
        task = resolve_task(task_or_name)
    if job is not None:
        args = job.args if args is None else args
        kwargs = job.kwargs if kwargs is None else kwargs
        queue = queue if queue is not None else job.queue
        priority = priority if priority is not None else job.priority
    args_list, kwargs_dict, _size = encode_arguments(args, kwargs)
    if idempotency_key is None:
        derived = task.derive_idempotency_key(*args_list, **kwargs_dict)
        idempotency_key = derived if derived is not None else f"{task.name}:{uuid.uuid4()}"
    key = check_idempotency_key(idempotency_key)
    if flow_id is None and key.startswith("flow:"):
        # The flows' own keys (``core/flows.py``): a row submitted under one would pass for a step.
        raise InvalidIdempotencyKeyError(f"idempotency keys starting with 'flow:' are the flows' own, not {key!r}")
    if countdown is not None and eta is not None:
        raise InvalidArgumentsError("give countdown or eta, not both")
    if eta is not None and timezone.is_naive(eta):
        raise InvalidArgumentsError("eta must be a timezone-aware datetime")
    now = timezone.now()
    delay = max(0.0, (eta - now).total_seconds()) if eta is not None else max(0.0, float(countdown or 0))
    on_broker = delay <= platform_settings().max_broker_countdown_seconds
    start = now + timedelta(seconds=delay) if delay else now
    spec = NewExecution(
        idempotency_key=key,
        task_name=task.name,
        args=args_list,
        kwargs=kwargs_dict,
        trigger=trigger,
        job=job,
        queue=queue or "",
        priority=priority,
        scheduled_for=start if delay else slot,
        due_at=start + ledger.republish_interval(1) if on_broker else start,
        celery_task_id=new_task_id() if on_broker else "",
        publish_count=1 if on_broker else 0,
        trace_context=tracing.traceparent(),
        flow_id=flow_id,
    )
    return spec, delay


def slot_spec(
    task_or_name: Task | str | JobDefinition,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    idempotency_key: str,
    slot: datetime,
    queue: str | None = None,
    priority: int | None = None,
) -> NewExecution:
    """What ``submit(task_or_name, args, kwargs, idempotency_key=…, slot=slot)`` records, for
    a beat that records a batch of slots in one ``ledger.create_many`` and publishes the new
    rows with ``publish_many_on_commit``; ``submit()``'s ``SubmissionError`` for bad input."""
    spec, _delay = _spec(
        task_or_name, args, kwargs, idempotency_key=idempotency_key, countdown=None, eta=None, queue=queue,
        priority=priority, trigger=Trigger.BEAT, slot=slot,
    )  # fmt: skip
    return spec


#: The fields an item of ``submit_many`` may have.
ITEM_FIELDS = frozenset({"args", "kwargs", "idempotency_key", "countdown", "eta"})


@dataclass(frozen=True)
class SubmitManyResult(Sequence[Execution]):
    """What ``submit_many`` did: one execution per item, in the items' order.

    It is a sequence of executions (``result[i]`` is item ``i``'s; two items with the same
    key share one). ``created[i]`` is True when item ``i`` inserted its row, False when the
    key already existed before the call, or was taken by an earlier item of the same batch.
    ``existing_keys`` lists the keys that existed before the call, each once: those rows
    were not published again.
    """

    executions: tuple[Execution, ...]
    created: tuple[bool, ...]
    existing_keys: tuple[str, ...]

    @overload
    def __getitem__(self, index: int) -> Execution: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Execution]: ...
    def __getitem__(self, index: int | slice) -> Execution | Sequence[Execution]:
        return self.executions[index]

    def __len__(self) -> int:
        return len(self.executions)

    @property
    def created_count(self) -> int:
        """How many rows this call inserted."""
        return sum(self.created)


def _item_error(index: int, exc: SubmissionError) -> SubmissionError:
    """``exc`` again, its message and context naming the item it is about."""
    return type(exc)(f"item {index}: {exc}", index=index, **exc.context)


def submit_many(
    task_or_name: Task | str | JobDefinition,
    items: Iterable[Mapping[str, Any]],
    *,
    queue: str | None = None,
    priority: int | None = None,
    on_commit: bool = True,
    trigger: str = Trigger.API,
) -> SubmitManyResult:
    """Record many executions of one task in a few statements (on PostgreSQL one per 1,000
    rows), and publish them in a batch once the transaction commits.

    Each item is a dict with any of ``args`` (list), ``kwargs`` (dict), ``idempotency_key``,
    ``countdown`` (seconds) and ``eta`` (aware datetime); a ``JobDefinition``'s default
    arguments apply to an item that gives none. ``queue`` and ``priority`` apply to the whole
    batch. Each item keeps ``submit()``'s semantics:

    * its key is the one given, else the task's ``derive_idempotency_key``, else a new one;
    * a key whose row already exists returns that execution, not published again
      (``result.created[i]`` is False and the key is in ``result.existing_keys``); two items
      with the same key and arguments collapse onto one row;
    * a far countdown or eta (beyond ``TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS``) is parked
      in the ledger and published by the rescuer when due.

    The batch is all or nothing: every item is validated first, and a bad item (unknown task,
    arguments that are not JSON or over the size limit, a bad key, countdown with eta, an
    unknown field) or a key reused with other arguments (by a row that exists or by another
    item) raises the ``SubmissionError`` subclass ``submit()`` would, its message and
    ``context["index"]`` naming the item. Then nothing is committed and nothing is published;
    in the caller's transaction only the batch's savepoint is rolled back.

    The rows are inserted in the caller's transaction; the messages are sent after it
    commits (``on_commit=False``: as soon as the rows are inserted). A broker that fails
    the batch does not fail the call: the rows wait and the rescuer publishes them.
    """
    if not tracing.ACTIVE:
        return _submit_many(task_or_name, items, queue=queue, priority=priority, on_commit=on_commit, trigger=trigger)
    name = task_or_name.task if isinstance(task_or_name, JobDefinition) else getattr(task_or_name, "name", task_or_name)
    with tracing.span("taskplatform.submit_many", {"taskplatform.task": name, "taskplatform.trigger": trigger}):
        result = _submit_many(task_or_name, items, queue=queue, priority=priority, on_commit=on_commit, trigger=trigger)
        tracing.annotate({"taskplatform.items": len(result), "taskplatform.created": result.created_count})
        return result


def _submit_many(
    task_or_name: Task | str | JobDefinition,
    items: Iterable[Mapping[str, Any]],
    *,
    queue: str | None,
    priority: int | None,
    on_commit: bool,
    trigger: str,
) -> SubmitManyResult:
    job: JobDefinition | None = None
    if isinstance(task_or_name, JobDefinition):
        job = task_or_name
        task = resolve_task(job.task)
        queue = queue if queue is not None else job.queue
        priority = priority if priority is not None else job.priority
    else:
        task = resolve_task(task_or_name)
    if isinstance(items, (str, bytes, Mapping)):
        raise InvalidArgumentsError(f"items must be an iterable of dicts, not {type(items).__name__}")
    conf = platform_settings()
    now = timezone.now()
    republish_after = ledger.republish_interval(1)
    specs: list[NewExecution] = []  # one per distinct key, in the order of first appearance
    delays: list[float] = []  # each spec's broker countdown (0: none)
    spec_item: list[int] = []  # each spec's first item
    spec_of_key: dict[str, int] = {}
    item_spec: list[int] = []  # each item's spec
    for index, item in enumerate(items):
        try:
            spec, delay = _item_spec(
                task, job, item, queue=queue, priority=priority, trigger=trigger, now=now,
                republish_after=republish_after, max_countdown=conf.max_broker_countdown_seconds,
            )  # fmt: skip
        except SubmissionError as exc:
            raise _item_error(index, exc) from exc
        seen = spec_of_key.get(spec.idempotency_key)
        if seen is None:
            spec_of_key[spec.idempotency_key] = len(specs)
            item_spec.append(len(specs))
            specs.append(spec)
            delays.append(delay)
            spec_item.append(index)
        elif specs[seen].args == spec.args and specs[seen].kwargs == spec.kwargs:
            item_spec.append(seen)  # a repeat within the batch: the same execution
        else:
            raise IdempotencyKeyConflictError(
                f"item {index}: idempotency key {spec.idempotency_key!r} is also item {spec_item[seen]}'s, "
                f"with other arguments; use a new key for new work",
                index=index,
                other_index=spec_item[seen],
            )
    if not specs:
        return SubmitManyResult(executions=(), created=(), existing_keys=())
    if context := tracing.traceparent():
        specs = [replace(spec, trace_context=context) for spec in specs]

    with transaction.atomic():  # all or nothing: a conflict found below rolls the batch back
        pairs = ledger.create_many(specs)
        for position, ((execution, created), spec) in enumerate(zip(pairs, specs, strict=True)):
            if not created and (
                execution.task_name != spec.task_name or execution.args != spec.args or execution.kwargs != spec.kwargs
            ):
                raise IdempotencyKeyConflictError(
                    f"item {spec_item[position]}: idempotency key {spec.idempotency_key!r} already names "
                    f"execution {execution.pk} of task {execution.task_name!r} with other arguments; use a "
                    f"new key for new work (nothing of this batch was recorded)",
                    execution_id=execution.pk,
                    index=spec_item[position],
                )
        entries = [
            (execution, spec.celery_task_id, delay or None)
            for (execution, created), spec, delay in zip(pairs, specs, delays, strict=True)
            if created and spec.celery_task_id  # existing rows are not published again; parked rows wait
        ]
        if on_commit:
            publish_many_on_commit(entries, robust=False)
    if not on_commit:
        publish_many(entries)

    return SubmitManyResult(
        executions=tuple(pairs[s][0] for s in item_spec),
        created=tuple(pairs[s][1] and spec_item[s] == index for index, s in enumerate(item_spec)),
        existing_keys=tuple(spec.idempotency_key for spec, (_e, new) in zip(specs, pairs, strict=True) if not new),
    )


def _item_spec(
    task: Any,
    job: JobDefinition | None,
    item: Any,
    *,
    queue: str | None,
    priority: int | None,
    trigger: str,
    now: datetime,
    republish_after: timedelta,
    max_countdown: float,
) -> tuple[NewExecution, float]:
    """One item of ``submit_many`` checked and turned into what ``create_many`` records, and
    its broker countdown (0: none); the same rules as ``submit_or_get``."""
    if not isinstance(item, Mapping):
        raise InvalidArgumentsError(f"an item must be a dict, not {type(item).__name__}")
    unknown = set(item) - ITEM_FIELDS
    if unknown:
        raise InvalidArgumentsError(
            f"unknown item field(s) {', '.join(sorted(map(repr, unknown)))}; an item may have "
            f"{', '.join(sorted(ITEM_FIELDS))}"
        )
    args, kwargs = item.get("args"), item.get("kwargs")
    if job is not None:
        args = job.args if args is None else args
        kwargs = job.kwargs if kwargs is None else kwargs
    args_list, kwargs_dict, _size = encode_arguments(args, kwargs)
    key = item.get("idempotency_key")
    if key is None:
        derived = task.derive_idempotency_key(*args_list, **kwargs_dict)
        key = derived if derived is not None else f"{task.name}:{uuid.uuid4()}"
    key = check_idempotency_key(key)
    if key.startswith("flow:"):
        raise InvalidIdempotencyKeyError(f"idempotency keys starting with 'flow:' are the flows' own, not {key!r}")
    countdown, eta = item.get("countdown"), item.get("eta")
    if countdown is not None and eta is not None:
        raise InvalidArgumentsError("give countdown or eta, not both")
    if eta is not None:
        if not isinstance(eta, datetime):
            raise InvalidArgumentsError(f"eta must be a datetime, not {type(eta).__name__}")
        if timezone.is_naive(eta):
            raise InvalidArgumentsError("eta must be a timezone-aware datetime")
        delay = max(0.0, (eta - now).total_seconds())
    elif countdown is not None:
        if isinstance(countdown, bool) or not isinstance(countdown, (int, float)) or not math.isfinite(countdown):
            raise InvalidArgumentsError(f"countdown must be a finite number of seconds, not {countdown!r}")
        delay = max(0.0, float(countdown))
    else:
        delay = 0.0
    on_broker = delay <= max_countdown
    try:
        start = now + timedelta(seconds=delay) if delay else now
    except OverflowError:
        raise InvalidArgumentsError(f"countdown or eta is beyond the year 9999: {delay} seconds") from None
    spec = NewExecution(
        idempotency_key=key,
        task_name=task.name,
        args=args_list,
        kwargs=kwargs_dict,
        trigger=trigger,
        job=job,
        queue=queue or "",
        priority=priority,
        scheduled_for=start if delay else None,
        due_at=start + republish_after if on_broker else start,
        celery_task_id=new_task_id() if on_broker else "",
        publish_count=1 if on_broker else 0,
    )
    return spec, delay
