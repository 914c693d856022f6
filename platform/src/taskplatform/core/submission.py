"""``submit()``: how views, services and the beat start work, with the ledger row written first."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from ..conf import platform_settings
from ..exceptions import IdempotencyKeyConflictError, InvalidArgumentsError
from ..models import Execution, JobDefinition, Trigger
from . import ledger
from .publisher import new_task_id, publish, publish_on_commit
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
    if countdown is not None and eta is not None:
        raise InvalidArgumentsError("give countdown or eta, not both")
    if eta is not None and timezone.is_naive(eta):
        raise InvalidArgumentsError("eta must be a timezone-aware datetime")

    now = timezone.now()
    delay = max(0.0, (eta - now).total_seconds()) if eta is not None else max(0.0, float(countdown or 0))
    scheduled_for = now + timedelta(seconds=delay) if delay else slot
    on_broker = delay <= platform_settings().max_broker_countdown_seconds
    task_id = new_task_id() if on_broker else ""
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
        scheduled_for=scheduled_for,
        due_at=start + ledger.republish_interval(1) if on_broker else start,
        celery_task_id=task_id,
        publish_count=1 if on_broker else 0,
    )
    execution, created = ledger.create(spec)
    if not created:
        if execution.task_name != task.name or execution.args != args_list or execution.kwargs != kwargs_dict:
            raise IdempotencyKeyConflictError(
                f"idempotency key {key!r} already names execution {execution.pk} of task "
                f"{execution.task_name!r} with other arguments; use a new key for new work",
                execution_id=execution.pk,
            )
        return execution, False
    if on_broker:
        if on_commit:
            publish_on_commit(execution, task_id=task_id, countdown=delay or None)
        else:
            publish(execution, task_id=task_id, countdown=delay or None)
    return execution, True
