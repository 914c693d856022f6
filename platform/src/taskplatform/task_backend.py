"""Django's task API on the ledger: a backend for django-tasks (the backport of ``django.tasks``).

    TASKS = {"default": {"BACKEND": "taskplatform.task_backend.LedgerBackend"}}

With it, a function decorated with ``@task`` and enqueued with ``.enqueue()`` goes through the
ledger like any ``submit()``: its row is written in the caller's transaction and published
after the commit, it runs on a Celery worker under ``IdempotentTask`` (claim, run, record;
retries with backoff; the dead letter after the last attempt; the console's actions), and its
result is read back through Django's ``TaskResult`` API (``result.refresh()``,
``my_task.get_result(id)``). The result id is the execution's primary key.

Each decorated function becomes a Celery task named by its module path
(``shop.tasks.send_receipt``), registered when its module is imported: define tasks in an
installed app's ``tasks.py`` (Celery's autodiscovery imports it in the worker) or list their
module in ``CELERY_IMPORTS``. The decorator takes the platform's options as well as Django's::

    @task(key=lambda order_id: f"receipt:{order_id}", retry_on=(TimeoutError,), max_retries=5)
    def send_receipt(order_id: int) -> str: ...

``key`` derives the idempotency key from the arguments (a second ``enqueue`` with the same key
and arguments returns the same execution; other arguments raise
``IdempotencyKeyConflictError``); without it every ``enqueue`` is a new execution. ``atomic``,
``retry_on``, ``max_retries``, ``retry_backoff``, ``retry_backoff_max`` and ``lease_seconds``
mean what they mean on an ``IdempotentTask``. Priorities other than the default are refused
(Celery's brokers do not order by django-tasks' -100..100); ``run_after`` is a countdown, parked
in the ledger when long.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from django.utils.module_loading import import_string
from django_tasks import DEFAULT_TASK_QUEUE_NAME
from django_tasks.backends.base import BaseTaskBackend
from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
from django_tasks.signals import task_enqueued

from .api import submit
from .domain.states import State
from .models import EventKind, Execution
from .tasks import IdempotentTask

__all__ = ["LedgerBackend", "LedgerTask"]

#: The ledger's states as django-tasks statuses: waiting (a first run or a retry) is READY.
STATUS = {
    State.PENDING: TaskResultStatus.READY,
    State.RETRYING: TaskResultStatus.READY,
    State.RUNNING: TaskResultStatus.RUNNING,
    State.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    State.FAILED: TaskResultStatus.FAILED,
    State.CANCELLED: TaskResultStatus.FAILED,
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LedgerTask(Task[Any, Any]):
    """A django-tasks ``Task`` with the ledger's options (see the module's docstring)."""

    key: Callable[..., str] | None = None
    atomic: bool = False
    retry_on: tuple[type[BaseException], ...] = ()
    max_retries: int | None = 3
    retry_backoff: int | bool = True
    retry_backoff_max: int = 600
    lease_seconds: int | None = None


class LedgerBackend(BaseTaskBackend):
    """django-tasks backend: every enqueued task is an execution in the ledger, run by Celery."""

    task_class = LedgerTask
    supports_defer = True
    supports_get_result = True
    supports_async_task = False
    supports_priority = False

    def validate_task(self, task: Task[Any, Any]) -> None:
        super().validate_task(task)
        if not isinstance(task, LedgerTask):
            raise InvalidTaskError(f"{self.alias!r} runs LedgerTask tasks (decorate with django_tasks.task)")
        _register(task)

    def enqueue(self, task: Task[Any, Any], args: Any, kwargs: Any) -> TaskResult[Any]:
        self.validate_task(task)
        assert isinstance(task, LedgerTask)
        args, kwargs = list(args), dict(kwargs)
        key = task.key(*args, **kwargs) if task.key is not None else None
        execution = submit(
            task.module_path,
            args,
            kwargs,
            idempotency_key=key,
            eta=task.run_after,
            queue=None if task.queue_name == DEFAULT_TASK_QUEUE_NAME else task.queue_name,
        )
        result = self._result(task, execution)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[Any]:
        try:
            execution = Execution.objects.get(pk=int(result_id))
        except (ValueError, Execution.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        try:
            task = import_string(execution.task_name)
        except ImportError:
            raise TaskResultDoesNotExist(result_id) from None
        if not isinstance(task, LedgerTask) or task.backend != self.alias:
            raise TaskResultDoesNotExist(result_id)
        return self._result(task, execution)

    def _result(self, task: Task[Any, Any], execution: Execution) -> TaskResult[Any]:
        return result_of(task, execution, self.alias)


def result_of(task: Task[Any, Any], execution: Execution, alias: str) -> TaskResult[Any]:
    """The django-tasks view of an execution row (and its failure events)."""
    failures = list(
        execution.events.filter(kind__in=(EventKind.RETRY_SCHEDULED, EventKind.DEAD_LETTERED))
        .order_by("at", "pk")
        .values_list("data", flat=True)
    )
    errors = []
    for n, data in enumerate(failures, start=1):
        error = str((data or {}).get("error", ""))
        last = n == len(failures)
        trace = execution.last_traceback if last and execution.last_traceback else error
        errors.append(TaskError(exception_class_path=error.split(":", 1)[0], traceback=trace))
    owners = list(
        execution.events.filter(kind__in=(EventKind.CLAIMED, EventKind.TAKEN_OVER))
        .order_by("at", "pk")
        .values_list("actor", flat=True)
    )
    owners += [execution.worker] * (execution.attempts - len(owners))
    status = STATUS[State(execution.state)]
    finished = status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
    result: TaskResult[Any] = TaskResult(
        task=task,
        id=str(execution.pk),
        status=status,
        enqueued_at=execution.created_at,
        started_at=execution.started_at,
        finished_at=execution.finished_at if finished else None,
        last_attempted_at=execution.started_at,
        args=list(execution.args),
        kwargs=dict(execution.kwargs),
        backend=alias,
        errors=errors,
        worker_ids=owners[: execution.attempts],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", execution.result)
    return result


#: Functions whose Celery task is registered (``using()`` copies validate again).
_REGISTERED: set[str] = set()


def _register(task: LedgerTask) -> None:
    """The Celery task that runs ``task``'s function in a worker, named by its module path."""
    from celery import shared_task

    name = task.module_path
    if name in _REGISTERED:
        return
    _REGISTERED.add(name)

    def run(self: IdempotentTask, *args: Any, **kwargs: Any) -> Any:
        target = import_string(name)  # the module's current definition
        if target.takes_context:
            execution = self.execution
            assert execution is not None
            context = TaskContext(task_result=result_of(target, execution, target.backend))
            return target.call(context, *args, **kwargs)
        return target.call(*args, **kwargs)

    shared_task(
        name=name,
        base=IdempotentTask,
        bind=True,
        atomic=task.atomic,
        autoretry_for=task.retry_on,
        max_retries=task.max_retries,
        retry_backoff=task.retry_backoff,
        retry_backoff_max=task.retry_backoff_max,
        lease_seconds=task.lease_seconds,
    )(run)
