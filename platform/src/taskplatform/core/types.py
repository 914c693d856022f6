"""The values the ledger trades in: what to create, what a worker received, what a claim gave.

Plain dataclasses with no behaviour beyond building a model instance, so the ledger, its
PostgreSQL statements and the worker can share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ..domain.states import State
from ..models import Execution, JobDefinition, Trigger

ClaimOutcome = Literal["claimed", "duplicate", "early", "superseded", "finished", "exhausted", "foreign"]


@dataclass
class Claim:
    """The result of a claim attempt. ``execution`` reflects the row after the claim."""

    outcome: ClaimOutcome
    execution: Execution
    lease_seconds: int = 0

    @property
    def token(self) -> int:
        return self.execution.fencing_token


@dataclass(eq=False)
class FinishedAttempt:
    """A finished attempt's success, not written yet, that the pool process's next claim
    carries in its own statement (``worker/recorder.py``: one commit a task instead of two).

    ``result`` is the stored (JSON-ready) value; ``written`` is set by the statement that
    carried it: True if its compare-and-set matched, False if the token was stale. It stays
    None when nothing carried it (another database, the statement failed, or another
    transaction held the row): the recorder writes it then, as any other success.
    """

    execution_id: int
    token: int
    result: Any
    worker: str
    data: dict[str, Any]
    finished_at: datetime
    written: bool | None = None


@dataclass(frozen=True)
class Delivery:
    """One message as a worker received it: which execution, by whom, with what arguments."""

    execution_id: int
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    worker: str  # the owner identity of this attempt (see worker.owner)
    celery_task_id: str


@dataclass(frozen=True)
class NewExecution:
    """What ``create`` records for a new execution."""

    idempotency_key: str
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    trigger: str = Trigger.API
    job: JobDefinition | None = None
    queue: str = ""
    priority: int | None = None
    scheduled_for: datetime | None = None
    due_at: datetime | None = None
    celery_task_id: str = ""
    publish_count: int = 0
    trace_context: str = ""
    flow_id: int | None = None

    def columns(self) -> dict[str, Any]:
        """The new row's values by field name, as ``build`` sets them (a fresh dict)."""
        values = dict(vars(self))
        values["state"] = State.PENDING
        return values

    def build(self) -> Execution:
        return Execution(
            idempotency_key=self.idempotency_key,
            task_name=self.task_name,
            args=self.args,
            kwargs=self.kwargs,
            trigger=self.trigger,
            job=self.job,
            queue=self.queue,
            priority=self.priority,
            scheduled_for=self.scheduled_for,
            due_at=self.due_at,
            celery_task_id=self.celery_task_id,
            publish_count=self.publish_count,
            trace_context=self.trace_context,
            flow_id=self.flow_id,
            state=State.PENDING,
        )
