"""Django's task API on the ledger: a backend for django-tasks (the backport of ``django.tasks``).

    TASKS = {"default": {"BACKEND": "taskplatform.task_backend.LedgerBackend"}}

With it, a function decorated with ``@task`` and enqueued with ``.enqueue()`` goes through the
ledger like any ``submit()``: its row is written in the caller's transaction and published
after the commit, it runs on a Celery worker under ``IdempotentTask`` (claim, run, record;
retries with backoff; the dead letter after the last attempt; the console's actions), and its
result is read back through Django's ``TaskResult`` API (``result.refresh()``,
``my_task.get_result(id)``). The result id is the execution's primary key.

Each decorated function becomes a Celery task named by its module path
(``shop.tasks.send_receipt``), registered when its module is imported. A worker imports an
installed app's ``tasks`` module (Celery's autodiscovery) and the modules in ``CELERY_IMPORTS``;
a function anywhere else is refused when it is decorated (``InvalidTaskError``), since a worker
would never know it and its executions would never run. The decorator takes the platform's
options as well as Django's::

    @task(key=lambda order_id: f"receipt:{order_id}", retry_on=(TimeoutError,), max_retries=5)
    def send_receipt(order_id: int) -> str: ...

``key`` derives the idempotency key from the arguments (a second ``enqueue`` with the same key
and arguments returns the same execution, however the arguments are passed, by position or by
name; other arguments raise ``IdempotencyKeyConflictError``; a key function that returns no
string raises ``InvalidIdempotencyKeyError``); without it every ``enqueue`` is a new execution.
``submit()`` of the task's name, a job definition and ``.delay()`` use the same key. ``atomic``,
``retry_on``, ``max_retries``, ``retry_backoff``, ``retry_backoff_max`` and ``lease_seconds``
mean what they mean on an ``IdempotentTask``. Priorities other than the default are refused
(Celery's brokers do not order by django-tasks' -100..100); ``run_after`` is a countdown, parked
in the ledger when long.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

from django.apps import apps
from django.conf import settings
from django.utils import timezone
from django.utils.module_loading import import_string
from django_tasks import DEFAULT_TASK_QUEUE_NAME
from django_tasks.backends.base import BaseTaskBackend
from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
from django_tasks.signals import task_enqueued

from .api import submit
from .domain.states import State
from .exceptions import InvalidIdempotencyKeyError
from .models import EventKind, Execution
from .tasks import IdempotentTask

__all__ = ["LedgerBackend", "LedgerTask"]

#: The ledger's states as django-tasks statuses: waiting (a first run, a retry, a slot of a
#: fleet-wide limit) is READY.
STATUS = {
    State.PENDING: TaskResultStatus.READY,
    State.RETRYING: TaskResultStatus.READY,
    State.WAITING: TaskResultStatus.READY,
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
        module = task.func.__module__
        if module not in worker_modules():
            raise InvalidTaskError(
                f"{task.module_path}: a worker never imports {module!r}, so its executions would never run. "
                "Define the function in an installed app's tasks module, or add its module to CELERY_IMPORTS."
            )
        _register(task)

    def enqueue(self, task: Task[Any, Any], args: Any, kwargs: Any) -> TaskResult[Any]:
        self.validate_task(task)
        assert isinstance(task, LedgerTask)
        args, kwargs = _normalised(task, args, kwargs)
        key = _key(task, args, kwargs)
        run_after = task.run_after
        if run_after is not None and timezone.is_naive(run_after):  # USE_TZ = False: local time
            run_after = timezone.make_aware(run_after)
        execution = submit(
            task.module_path,
            args,
            kwargs,
            idempotency_key=key,
            eta=run_after,
            queue=None if task.queue_name == DEFAULT_TASK_QUEUE_NAME else task.queue_name,
        )
        result = self._result(task, execution)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[Any]:
        pk = _primary_key(result_id)
        execution = Execution.objects.filter(pk=pk).first() if pk is not None else None
        if execution is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = import_string(execution.task_name)
        except ImportError:
            raise TaskResultDoesNotExist(result_id) from None
        if not isinstance(task, LedgerTask):
            raise TaskResultDoesNotExist(result_id)
        if task.backend != self.alias:  # enqueued through a ``using(backend=...)`` copy
            task = task.using(backend=self.alias)
        return self._result(task, execution)

    def _result(self, task: Task[Any, Any], execution: Execution) -> TaskResult[Any]:
        return result_of(task, execution, self.alias)


#: A dotted exception class path at the start of a recorded error ("module.Class: message").
_CLASS_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")
#: The class named for a failure that is not an exception of the body's: a lease that ran out
#: (the worker died), an operator's decision.
_NOT_RAISED = "taskplatform.exceptions.LeaseLostError"
_BY_OPERATOR = "taskplatform.exceptions.TaskPlatformError"


def result_of(task: Task[Any, Any], execution: Execution, alias: str) -> TaskResult[Any]:
    """The django-tasks view of an execution row and its events, since the last time an
    operator sent it back to ``PENDING`` (which grants a fresh attempt budget: the earlier
    attempts stay in the console's timeline, not in the result)."""
    events = list(execution.events.order_by("at", "pk").values("kind", "to_state", "actor", "at", "data", "reason"))
    requeued = [i for i, e in enumerate(events) if e["kind"] == EventKind.OPERATOR and e["to_state"] == State.PENDING]
    if requeued:
        events = events[requeued[-1] + 1 :]
    errors = []
    failures = [  # in the order they happened
        e
        for e in events
        if e["kind"] in (EventKind.RETRY_SCHEDULED, EventKind.RESCUED, EventKind.TAKEN_OVER, EventKind.DEAD_LETTERED)
        or (e["kind"] == EventKind.OPERATOR and e["to_state"] in (State.FAILED, State.CANCELLED))
    ]
    for event in failures:
        error = str((event["data"] or {}).get("error", "") or event["reason"] or "")
        path = error.split(":", 1)[0]
        if event["kind"] == EventKind.OPERATOR:
            path, error = _BY_OPERATOR, f"{event['to_state'].lower()} by {event['actor']}: {event['reason']}"
        elif event["kind"] == EventKind.RESCUED:
            # The attempt's lease ran out (its worker died or stalled); the event's error is
            # whatever the row held before, an earlier attempt's, so the reason tells it.
            path, error = _NOT_RAISED, str(event["reason"] or "")
        elif event["kind"] == EventKind.TAKEN_OVER:
            # A redelivery found the attempt's owner dead (or its lease over) and claimed the
            # next one: the attempt before it was lost, as a rescued one is.
            owner = (event["data"] or {}).get("previous_owner") or "its worker"
            path, error = _NOT_RAISED, f"attempt lost: {owner} died or stalled; taken over by {event['actor']}"
        elif not _CLASS_PATH.match(path):
            path = _NOT_RAISED
        errors.append(TaskError(exception_class_path=path, traceback=error))
    # The row's traceback is the last raised failure's (a rescue carries it forward; a lost
    # attempt or an operator's decision has none of its own): it goes with that failure.
    raised = [i for i, e in enumerate(errors) if e.exception_class_path not in (_NOT_RAISED, _BY_OPERATOR)]
    if raised and execution.last_traceback:
        errors[raised[-1]] = TaskError(exception_class_path=errors[raised[-1]].exception_class_path,
                                       traceback=execution.last_traceback)  # fmt: skip
    claims = [e for e in events if e["kind"] in (EventKind.CLAIMED, EventKind.TAKEN_OVER)]
    owners = [e["actor"] for e in claims][: execution.attempts]
    owners += [execution.worker] * (execution.attempts - len(owners))
    status = STATUS[State(execution.state)]
    finished = status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
    first_start = claims[0]["at"] if claims else execution.started_at
    result: TaskResult[Any] = TaskResult(
        task=task,
        id=str(execution.pk),
        status=status,
        enqueued_at=execution.created_at,
        started_at=first_start if execution.attempts else None,
        finished_at=execution.finished_at if finished else None,
        last_attempted_at=execution.started_at if execution.attempts else None,
        args=list(execution.args),
        kwargs=dict(execution.kwargs),
        backend=alias,
        errors=errors,
        worker_ids=owners,
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", execution.result)
    return result


#: Functions whose Celery task is registered (``using()`` copies validate again).
_REGISTERED: set[str] = set()


def worker_modules() -> set[str]:
    """The modules a Celery worker of this project imports: each installed app's ``tasks``
    (autodiscovery) and ``CELERY_IMPORTS`` / ``CELERY_INCLUDE``."""
    from celery import current_app

    modules = {f"{config.name}.tasks" for config in apps.get_app_configs()}
    for option in ("imports", "include"):
        modules.update(current_app.conf.get(option) or ())
    modules.update(getattr(settings, "CELERY_IMPORTS", ()) or ())
    return modules


def _normalised(task: LedgerTask, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """The arguments bound to the function's signature, defaults filled in: ``f("A-1", 4200)``,
    ``f(order_id="A-1", amount=4200)`` and, with a default of 4200, ``f("A-1")`` are one call
    (one key, not a conflict); arguments the
    function does not take raise ``TypeError`` before anything is recorded."""
    signature = inspect.signature(task.func)
    if task.takes_context:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()  # ``f("A-1")`` and ``f("A-1", 100)`` with ``amount=100`` are one call too
    return list(bound.args), dict(bound.kwargs)


def _key(task: LedgerTask, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    if task.key is None:
        return None
    key = task.key(*args, **kwargs)
    if not isinstance(key, str) or not key:
        raise InvalidIdempotencyKeyError(
            f"{task.module_path}: its key function returned {key!r}, not a string: every enqueue would be "
            "a new execution (a payment taken twice)"
        )
    return key


def _primary_key(result_id: str) -> int | None:
    try:
        pk = int(result_id)
    except (TypeError, ValueError):
        return None
    return pk if 0 < pk < 2**63 else None


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

    key = task.key

    class FunctionTask(IdempotentTask):
        """``IdempotentTask`` whose key, for ``submit()`` and ``.delay()`` too, is the function's."""

        def derive_idempotency_key(self, *args: Any, **kwargs: Any) -> str | None:
            return _key(task, list(args), dict(kwargs)) if key is not None else None

    shared_task(
        name=name,
        base=FunctionTask,
        bind=True,
        atomic=task.atomic,
        autoretry_for=task.retry_on,
        max_retries=task.max_retries,
        retry_backoff=task.retry_backoff,
        retry_backoff_max=task.retry_backoff_max,
        lease_seconds=task.lease_seconds,
    )(run)
