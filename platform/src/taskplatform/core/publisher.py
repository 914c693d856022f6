"""Publishing ledger rows to the broker: the outbox's second half.

A row is always committed before its message is published (``publish_on_commit``), so a
crash in between leaves a row the rescuer re-publishes, never a message without a row.
A failed publication is logged and left to the rescuer: the caller's request succeeds.

A publication never waits for a result backend: see ``message_options``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from django.db import transaction

from .validation import registered_task

if TYPE_CHECKING:
    from ..models import Execution

log = logging.getLogger("taskplatform.publisher")

#: Message headers that point a worker at its ledger row.
HEADER_EXECUTION = "tp_execution"
HEADER_KEY = "tp_key"


def new_task_id() -> str:
    """A fresh Celery task id for one publication."""
    return str(uuid.uuid4())


def message_options(execution: Execution, *, task_id: str, countdown: float | None) -> dict[str, Any]:
    """``send_task`` options for one publication of ``execution``.

    ``ignore_result`` is the task's own setting (True for every ``IdempotentTask`` unless it
    opts out: the ledger stores results), as ``Task.apply_async`` passes it. ``send_task`` by
    name does not: without it, it first subscribes to the task's result on the result backend
    (Celery's Redis backend does, for an ``AsyncResult`` nobody here holds), and with that
    backend down it retried for about 20 s and then failed the publication, and every later
    one of the process (scenario 12 of the fault catalogue). The worker reads the same value
    from the task, so nothing changes there.
    """
    options: dict[str, Any] = {
        "task_id": task_id,
        "headers": {HEADER_EXECUTION: execution.pk, HEADER_KEY: execution.idempotency_key},
    }
    task = registered_task(execution.task_name)
    if task is not None and task.ignore_result:
        options["ignore_result"] = True
    if execution.queue:
        options["queue"] = execution.queue
    if execution.priority is not None:
        options["priority"] = execution.priority
    if countdown:
        options["countdown"] = countdown
    job = execution.job
    if job is not None:
        if job.soft_time_limit_seconds:
            options["soft_time_limit"] = job.soft_time_limit_seconds
        if job.time_limit_seconds:
            options["time_limit"] = job.time_limit_seconds
    return options


def publish(execution: Execution, *, task_id: str, countdown: float | None = None) -> bool:
    """Send the message for ``execution`` now; False (logged) if the broker refused it."""
    from celery import current_app

    try:
        current_app.send_task(
            execution.task_name,
            args=execution.args,
            kwargs=execution.kwargs,
            **message_options(execution, task_id=task_id, countdown=countdown),
        )
    except Exception:  # the row is safe in the ledger; the rescuer publishes it again
        log.warning(
            "publication failed; the rescuer will publish it again",
            exc_info=True,
            extra={
                "execution_id": execution.pk,
                "idempotency_key": execution.idempotency_key,
                "celery_task_id": task_id,
            },
        )
        return False
    return True


def publish_on_commit(execution: Execution, *, task_id: str, countdown: float | None) -> None:
    """Publish once the current transaction commits (at once outside a transaction)."""
    transaction.on_commit(lambda: publish(execution, task_id=task_id, countdown=countdown), robust=True)


#: Broker operations a batch buffers before it sends them (kombu's ``Producer.batch``).
PUBLISH_BATCH_SIZE = 1000


def publish_many(entries: Sequence[tuple[Execution, str, float | None]]) -> bool:
    """Send the messages for many ``(execution, task id, countdown)`` now, through one producer.

    On a transport that can batch (kombu's ``Producer.batch``: the Redis transport buffers
    the ``LPUSH`` commands in a pipeline and sends up to ``PUBLISH_BATCH_SIZE`` in one round
    trip) the batch costs a round trip per thousand messages; elsewhere (RabbitMQ, or Redis
    with client-side retries, which kombu will not batch because a replayed pipeline could
    duplicate writes) each message is sent at once on the same producer. Each message is
    built by Celery's ``send_task`` exactly as ``publish`` builds it, signals and
    ``task-sent`` events included.

    A failure is logged and left to the rescuer, like ``publish``'s: the rows are committed
    with a due time, so any message the broker did not take is published again, and any
    copy it did take twice is absorbed by the claim. Returns False on a failure.
    """
    if not entries:
        return True
    from celery import current_app

    sent = 0
    try:
        with current_app.producer_or_acquire() as producer:
            batch = getattr(producer, "batch", None)  # kombu >= 5.7
            with batch(max_size=PUBLISH_BATCH_SIZE) if batch is not None else nullcontext():
                for execution, task_id, countdown in entries:
                    current_app.send_task(
                        execution.task_name,
                        args=execution.args,
                        kwargs=execution.kwargs,
                        producer=producer,
                        **message_options(execution, task_id=task_id, countdown=countdown),
                    )
                    sent += 1
    except Exception:  # the rows are safe in the ledger; the rescuer publishes them again
        log.warning(
            "batch publication failed; the rescuer will publish its rows again",
            exc_info=True,
            extra={
                "executions": len(entries),
                "built": sent,
                "first_execution_id": entries[0][0].pk,
                "last_execution_id": entries[-1][0].pk,
            },
        )
        return False
    return True


def publish_many_on_commit(entries: Sequence[tuple[Execution, str, float | None]]) -> None:
    """``publish_many`` once the current transaction commits (at once outside a transaction)."""
    if entries:
        transaction.on_commit(lambda: publish_many(entries), robust=True)
