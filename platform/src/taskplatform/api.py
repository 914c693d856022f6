"""``submit()``: how views and services start work, with the ledger row written first."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from . import ledger
from .conf import platform_settings
from .exceptions import IdempotencyKeyConflictError, InvalidArgumentsError
from .models import JobDefinition, Trigger
from .publisher import new_task_id, publish, publish_on_commit
from .validation import check_idempotency_key, encode_arguments, resolve_task

if TYPE_CHECKING:
    from celery import Task
    from django_celery_beat.models import PeriodicTask

    from .models import Execution


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
    spec = ledger.NewExecution(
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


def schedule_job(
    job: JobDefinition,
    *,
    cron: str | None = None,
    timezone_name: str = "UTC",
    every_seconds: int | None = None,
    start: datetime | None = None,
    at: datetime | None = None,
) -> PeriodicTask:
    """Give ``job`` a schedule (exactly one of ``cron``, ``every_seconds``, ``at``).

    The schedule lives in django-celery-beat's tables (a ``PeriodicTask`` named after the
    job that triggers ``taskplatform.trigger_job(slug)``, so plain beat works too) and is
    linked to the job. ``cron`` is five fields, ``"minute hour day-of-month month
    day-of-week"``, read in ``timezone_name`` (an IANA name). ``every_seconds`` counts from
    ``start`` (else the Unix epoch); ``at`` is a one-off time. A malformed expression or
    an unknown time zone raises ``ConfigurationError`` and saves nothing.
    """
    from django.db import transaction
    from django_celery_beat.models import ClockedSchedule, CrontabSchedule, IntervalSchedule, PeriodicTask

    from .exceptions import ConfigurationError
    from .slots import parse_cron

    if sum(x is not None for x in (cron, every_seconds, at)) != 1:
        raise ConfigurationError("give exactly one of cron, every_seconds and at")
    fields: dict[str, Any] = {"interval": None, "crontab": None, "clocked": None, "solar": None, "one_off": False}
    with transaction.atomic():
        if cron is not None:
            spec = parse_cron(cron, timezone_name)  # raises ConfigurationError on bad input
            minute, hour, dom, month, dow = (
                spec.minute,
                spec.hour,
                spec.day_of_month,
                spec.month_of_year,
                spec.day_of_week,
            )
            fields["crontab"], _ = CrontabSchedule.objects.get_or_create(
                minute=minute, hour=hour, day_of_month=dom, month_of_year=month, day_of_week=dow,
                timezone=timezone_name,
            )  # fmt: skip
        elif every_seconds is not None:
            if every_seconds <= 0:
                raise ConfigurationError(f"every_seconds must be positive, not {every_seconds!r}")
            fields["interval"], _ = IntervalSchedule.objects.get_or_create(
                every=every_seconds, period=IntervalSchedule.SECONDS
            )
        else:
            assert at is not None
            if timezone.is_naive(at):
                raise ConfigurationError("at must be a timezone-aware datetime")
            fields["clocked"], _ = ClockedSchedule.objects.get_or_create(clocked_time=at)
            fields["one_off"] = True
        periodic, _ = PeriodicTask.objects.update_or_create(
            name=f"job:{job.slug}",
            defaults={
                **fields,
                "task": "taskplatform.trigger_job",
                "args": f'["{job.slug}"]',
                "kwargs": "{}",
                "start_time": start,
                "enabled": True,
                "description": f"Schedule of job {job.slug} (taskplatform).",
            },
        )
        if job.periodic_task_id != periodic.pk:
            job.periodic_task = periodic
            job.save(update_fields=["periodic_task", "updated_at"])
    return periodic
