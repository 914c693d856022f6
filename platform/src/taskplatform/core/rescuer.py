"""The rescuer: the periodic duty that keeps guarantee G1 (no lost trigger) and G6.

One pass does two things, each bounded by ``TASKPLATFORM_RESCUE_BATCH_SIZE``:

1. ``RUNNING`` rows whose lease expired (worker killed, OOM, machine lost, process paused)
   are re-queued as a new attempt, or dead-lettered when attempts are exhausted.
2. ``PENDING``/``RETRYING``/``WAITING`` rows whose ``due_at`` passed are published: parked retries and
   long countdowns that are now due, and rows whose message was lost (process died between
   commit and publish, broker flushed or restarted without persistence). Re-publication
   backs off (``republish_after_seconds``, doubling) so a long queue is not multiplied, and
   a claim absorbs any extra copy.
3. Flow runs whose ``check_at`` passed are moved on (``flows.advance``): the backstop for a
   worker that died between a step's outcome and the flow's next move.

The holder of the maintenance lease runs it (``scheduling.maintenance``: the leading beat or a
worker); ``python manage.py taskplatform rescue``
and the ``taskplatform.rescue`` Celery task run the same function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from .. import tracing
from ..conf import platform_settings
from ..domain.policies import UNBOUNDED_ATTEMPTS_CAP
from ..models import Execution
from . import flows, ledger
from .validation import is_idempotent, registered_task

log = logging.getLogger("taskplatform.rescuer")

#: On MariaDB, how often a rescuer looks for waiting rows that name no limit (an earlier
#: release's, ``ledger.recall_unnamed_waiters``); elsewhere a partial index makes it every pass.
UNNAMED_RECALL_SECONDS = 600.0
_next_unnamed_recall = 0.0


@dataclass
class RescueReport:
    """What one rescuer pass did."""

    rescued: int = 0
    dead_lettered: int = 0
    published: int = 0
    flows_advanced: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _max_attempts(execution: Execution) -> int:
    """The attempts budget of ``execution``: its task's retry policy with the job's overrides."""
    task = registered_task(execution.task_name)
    if is_idempotent(task):
        return int(task.retry_policy(execution.job).max_attempts)  # type: ignore[union-attr]
    if execution.job is not None and execution.job.max_attempts:
        return execution.job.max_attempts
    return UNBOUNDED_ATTEMPTS_CAP


def _traced(execution: Execution, why: str) -> Any:
    """A ``taskplatform.rescue`` span in ``execution``'s trace (nothing when tracing is off)."""
    if not tracing.ACTIVE or not execution.trace_context:
        return nullcontext()
    return _rescue_span(execution, why)


@contextmanager
def _rescue_span(execution: Execution, why: str) -> Iterator[None]:
    attributes = {
        "taskplatform.execution_id": execution.pk,
        "taskplatform.idempotency_key": execution.idempotency_key,
        "taskplatform.attempt": execution.attempts,
        "taskplatform.rescue": why,
    }
    with tracing.under(execution.trace_context), tracing.span("taskplatform.rescue", attributes):
        yield


def _always() -> bool:
    return True


def run_rescuer(now: datetime | None = None, *, keep_going: Callable[[], bool] = _always) -> RescueReport:
    """One rescuer pass; safe to run concurrently with workers and with itself.

    Which rows are due is the database's clock's decision (``UtcNow()`` in the selection and
    again in each compare-and-set): a rescuer host whose clock is off neither acts early nor
    late. ``now`` only stamps the events it writes.

    ``keep_going`` is asked before each row: the maintenance thread passes its lease's
    ``holds()``, which renews the lease on the way (a pass longer than the lease kept it only
    until the lease ran out, and another process ran a second rescuer beside it) and ends the
    pass once the lease is someone else's.
    """
    now = now or timezone.now()
    batch = platform_settings().rescue_batch_size
    report = RescueReport()

    def stopped() -> bool:
        if keep_going():
            return False
        log.warning("rescuer pass stopped: this process no longer holds the maintenance duties", extra=report.as_dict())
        return True

    expired = Execution.objects.lease_expired().select_related("job").order_by("lease_expires_at")[:batch]
    for execution in expired:
        if stopped():
            return report
        with _traced(execution, "expired lease"):
            outcome = ledger.rescue_expired(execution, max_attempts=_max_attempts(execution), now=now)
            tracing.annotate({"taskplatform.outcome": outcome})
        if outcome == "rescued":
            report.rescued += 1
        elif outcome == "dead_lettered":
            report.dead_lettered += 1
            if execution.flow_id is not None:
                flows.advance_quietly(execution.flow_id)  # a flow's step or compensation: its next move now

    global _next_unnamed_recall
    if time.monotonic() >= _next_unnamed_recall:  # parked by an earlier release: due now, published below
        recalled = ledger.recall_unnamed_waiters(batch=batch)
        # MariaDB has no partial index: the look reads every waiting row, so not every pass
        # once there are none left (a full batch: the next pass goes on with the rest).
        if recalled < batch and connection.vendor == "mysql":
            _next_unnamed_recall = time.monotonic() + UNNAMED_RECALL_SECONDS
    due = Execution.objects.overdue().select_related("job").order_by("due_at")[:batch]
    for execution in due:
        if stopped():
            return report
        with _traced(execution, f"due {execution.state.lower()}"):
            published = ledger.republish_due(execution, now=now)
            tracing.annotate({"taskplatform.outcome": "published" if published else "not published"})
        if published:
            report.published += 1

    report.flows_advanced = flows.advance_due(batch=batch, keep_going=keep_going)

    if report.rescued or report.dead_lettered or report.published or report.flows_advanced:
        log.info("rescuer pass", extra=report.as_dict())
    return report
