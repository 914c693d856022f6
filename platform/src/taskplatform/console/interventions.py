"""The operator console's interventions on executions and locks, independent of the admin.

Every action checks legality against the transitions table (``domain.states``), needs a reason,
and leaves an audit record: an ``ExecutionEvent`` of kind ``operator`` for an execution, an
``OperatorAction`` row for anything else. An action on an execution names the state the
operator saw (``expected_state``): if the row moved since, nothing changes, so the same form
submitted twice acts once. Illegal requests raise ``IllegalTransitionError`` and change
nothing. Job definitions (pause, resume, duplicate, edit) are changed through the ``jobs``
service.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.db import transaction

from ..backends import get_lock_backend
from ..core import flows, ledger
from ..core.audit import audit
from ..core.submission import submit_or_get
from ..domain.states import State
from ..exceptions import IllegalTransitionError, LedgerError
from ..models import Execution, JobDefinition, Trigger

log = logging.getLogger("taskplatform.console")


@dataclass(frozen=True)
class Action:
    """One operator action on executions: which transition, which permission."""

    name: str
    label: str
    target: State
    permission: str  # codename in the taskplatform app


ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        Action("retry_now", "Retry now", State.PENDING, "retry_execution"),
        Action("cancel", "Cancel", State.CANCELLED, "cancel_execution"),
        Action("mark_failed", "Mark failed", State.FAILED, "mark_failed_execution"),
        Action("mark_succeeded", "Mark succeeded (fixed by hand)", State.SUCCEEDED, "mark_succeeded_execution"),
    )
}


@dataclass
class Outcome:
    """What a bulk action did: executions changed, and the refusals with their reasons."""

    changed: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)


def apply(action_name: str, expected: dict[int, str], *, user: str, reason: str, revoke: bool = True) -> Outcome:
    """Apply ``action_name`` to each execution ``id`` seen as ``expected[id]``.

    ``expected[id]`` is ``"STATE"`` or ``"STATE:fencing_token"``; with the token, a row that
    went through another attempt and came back to the same state (a retried dead letter that
    failed again) is not acted on twice.
    """
    action = ACTIONS[action_name]
    if not reason or not reason.strip():
        raise LedgerError("a reason is required for an operator action")
    outcome = Outcome()
    for execution_id, seen_as in expected.items():
        seen, _, token = seen_as.partition(":")
        row = Execution.objects.filter(pk=execution_id).only("pk", "flow_id", "idempotency_key").first()
        try:
            # A flow's step: the check and the transition under the run's lock (``advance``
            # cannot move the run on between them).
            with flows.operator_acting(row, action.target) as refusal:
                if refusal is not None:
                    outcome.refused[execution_id] = refusal
                    continue
                execution = ledger.operator_transition(
                    execution_id, action.target, user=user, reason=reason.strip(), expected_state=seen,
                    expected_token=int(token) if token.isdigit() else None,
                )  # fmt: skip
        except (IllegalTransitionError, LedgerError) as exc:
            outcome.refused[execution_id] = str(exc)
            continue
        outcome.changed.append(execution_id)
        stops_work = action.target == State.CANCELLED or (action.target == State.FAILED and seen == State.RUNNING)
        if stops_work and revoke and execution.celery_task_id:
            # A body still running after "mark failed" could run beside a retry: stop it.
            _revoke(execution, running=seen == State.RUNNING)
        if execution.flow_id is not None:
            # A step or compensation of a flow: a retried compensation puts the flow back to
            # compensating, one marked done lets it go on (``core/flows.py``).
            flows.advance_quietly(execution.flow_id)
    return outcome


def _revoke(execution: Execution, *, running: bool) -> None:
    """Tell the workers: drop the queued message, or stop the running body.

    Best effort: the ledger already says CANCELLED, so a body that still finishes has its
    write-back refused and a message that still arrives is absorbed.
    """
    from celery import current_app

    try:
        current_app.control.revoke(execution.celery_task_id, terminate=running, signal="SIGTERM")
    except Exception as exc:  # the broker being down must not undo a cancellation
        log.warning("revoke of %s failed: %s", execution.celery_task_id, exc, extra={"execution_id": execution.pk})


def run_job_now(job: JobDefinition, *, user: str, request_token: str, reason: str = "") -> tuple[Execution, bool]:
    """Submit ``job`` now, keyed by the confirmation form's token: a double click runs it once."""
    key = f"{job.slug}@admin:{request_token}"
    with transaction.atomic():
        execution, created = submit_or_get(job, idempotency_key=key, trigger=Trigger.ADMIN)
        if created:
            audit(user, "run_job_now", f"job:{job.slug}", reason, execution_id=execution.pk)
    return execution, created


def force_release_lock(alias: str, name: str, *, user: str, reason: str, expected_owner: str | None = None) -> bool:
    """Free a lock whoever holds it (a stuck beat lease, say); audited. True if it was held.

    ``expected_owner``: the holder the operator saw; if another process holds the lock by
    now, nothing is released (a resubmitted form must not free a healthy new holder).
    """
    if not reason or not reason.strip():
        raise LedgerError("a reason is required to force-release a lock")
    backend = get_lock_backend(alias)
    before = backend.inspect(name)
    if expected_owner is not None and (before is None or before.owner != expected_owner):
        holder = before.owner if before and before.owner else "nobody"
        raise LedgerError(f"lock {name} is held by {holder} now, not {expected_owner}: nothing released")
    released = backend.force_release(name)
    audit(
        user,
        "force_release_lock",
        f"lock:{alias}:{name}",
        reason.strip(),
        released=released,
        holder=before.owner if before else None,
        fencing_token=before.token if before else None,
    )
    return released
