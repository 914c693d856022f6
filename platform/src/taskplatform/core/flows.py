"""Flows: ordered steps with compensations (a saga), on the ledger.

A flow is declared once, in code that workers import (a ``tasks.py``)::

    order = Flow("order", [
        Step("reserve", reserve_stock, compensate=release_stock),
        Step("capture", capture_payment, compensate=refund_payment,
             kwargs=lambda input, results: {"order": input["order"], "cents": input["cents"]}),
        Step("coupon", issue_coupon),
    ])
    run = submit_flow(order, key=f"order:{number}", input={"order": number, "cents": 1999})

Each step is an ``IdempotentTask`` execution keyed ``flow:<run id>:<index>:<step>``; its
compensation is keyed ``…:undo``. A step's result (``execution.result``) is kept on the run
and handed to the ``kwargs`` builders of the later steps and of the compensations.

The run moves on in ``advance``, which reads its executions and does the one next thing:
submit the next step, or, once a step has dead-lettered (or was cancelled), submit the
compensation of the last succeeded step not yet undone, in reverse order. Every submission is
keyed, and the run's row is locked while it decides, so calling ``advance`` twice, from two
processes, or after a crash, submits nothing twice. It is called by the worker when a flow
execution's attempt ends, by the console after an operator's action on one, and by the
rescuer for any run whose ``check_at`` passed (the backstop for a worker killed between a
step's outcome and its ``advance``).

States (``FlowState``): ``RUNNING`` → ``SUCCEEDED``; ``RUNNING`` → ``COMPENSATING`` →
``COMPENSATED``; ``COMPENSATING`` → ``FAILED_TO_COMPENSATE`` when a compensation
dead-letters, and back to ``COMPENSATING`` once an operator retries it or marks it done.
A step that fails for good is not compensated itself: a step must leave no effect when it
fails (an atomic step rolls back; a non-atomic one must undo its own partial work).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from ..domain.flows import Flow, Step
from ..domain.flows import registered as _declared
from ..domain.states import State
from ..exceptions import IdempotencyKeyConflictError, InvalidArgumentsError
from ..models import Execution, FlowRun, FlowState, Trigger, UtcNow
from . import submission
from .validation import check_idempotency_key, encode_arguments

log = logging.getLogger("taskplatform.flows")

#: How long after a move a running flow is looked at by the rescuer if nothing moved it on.
CHECK_SECONDS = 60
#: The same for a flow waiting on an operator (a dead-lettered compensation).
STUCK_CHECK_SECONDS = 3600

TERMINAL = frozenset({FlowState.SUCCEEDED, FlowState.COMPENSATED})


def step_key(run: FlowRun, index: int, step: Step) -> str:
    return f"flow:{run.pk}:{index}:{step.name}"


def undo_key(run: FlowRun, index: int, step: Step) -> str:
    return f"flow:{run.pk}:{index}:{step.name}:undo"


def registered(name: str) -> Flow | None:
    """The flow declared under ``name``, importing the project's task modules first if this
    process has not (a web process, a beat): flows are declared beside their tasks."""
    flow = _declared(name)
    if flow is None:
        from celery import current_app

        current_app.loader.import_default_modules()
        flow = _declared(name)
    return flow


def flow_keys(run: FlowRun) -> list[str]:
    """The keys of every step and compensation ``run`` may have (its flow declared)."""
    flow = registered(run.flow)
    if flow is None:
        return []
    return [k for i, s in enumerate(flow.steps) for k in (step_key(run, i, s), undo_key(run, i, s))]


def submit_flow(
    flow: Flow | str, *, key: str, input: Mapping[str, Any] | None = None, on_commit: bool = True
) -> FlowRun:
    """Start ``flow`` under ``key`` (its first step is submitted in the same transaction), or
    return the run that key already names. The same key with another flow or other input is
    refused (``IdempotencyKeyConflictError``); input must be a JSON object."""
    return submit_flow_or_get(flow, key=key, input=input, on_commit=on_commit)[0]


def submit_flow_or_get(
    flow: Flow | str, *, key: str, input: Mapping[str, Any] | None = None, on_commit: bool = True
) -> tuple[FlowRun, bool]:
    """``submit_flow``, also saying whether this call started the run (False: the key existed)."""
    declared = registered(flow) if isinstance(flow, str) else flow
    if declared is None:
        raise InvalidArgumentsError(f"no flow named {flow!r} is declared (is its module imported?)")
    checked = check_idempotency_key(key)
    if input is not None and not isinstance(input, Mapping):
        raise InvalidArgumentsError("a flow's input is a JSON object of keyword arguments")
    _args, data, _size = encode_arguments([], dict(input or {}))
    with transaction.atomic():
        run, created = FlowRun.objects.get_or_create(
            key=checked, defaults={"flow": declared.name, "input": data, "check_at": _later(CHECK_SECONDS)}
        )
        if not created:
            if run.flow != declared.name or run.input != data:
                raise IdempotencyKeyConflictError(
                    f"flow key {checked!r} already names run {run.pk} of flow {run.flow!r} with other input",
                    flow_run=run.pk,
                )
            return run, False
        _decide(run, declared, on_commit=on_commit)
        run.save()
    log.info("flow started", extra={"flow": declared.name, "flow_run": run.pk, "flow_key": checked})
    return run, True


def advance(run_id: int | None, *, on_commit: bool = True) -> FlowRun | None:
    """Do the next thing for flow run ``run_id`` (see the module docstring); safe to call any
    number of times from anywhere."""
    if run_id is None:
        return None
    with transaction.atomic():
        run = FlowRun.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.state in TERMINAL:
            return run
        flow = registered(run.flow)
        if flow is None:
            log.error("flow run of an undeclared flow: not advanced", extra={"flow": run.flow, "flow_run": run.pk})
            run.error = f"no flow named {run.flow!r} is declared in the project's task modules: not advanced"
            run.check_at = _later(STUCK_CHECK_SECONDS)
        else:
            _decide(run, flow, on_commit=on_commit)
        run.save()
    return run


def advance_quietly(run_id: int | None) -> None:
    """``advance`` for a caller whose own work is done (a worker after an attempt, the rescuer):
    an error is logged and written on the run, whose next look is put off (doubling, up to an
    hour), so a run that cannot move (a kwargs builder that raises, a task renamed) neither
    hides its reason nor keeps the rescuer's batch from the other runs."""
    if run_id is None:
        return
    try:
        advance(run_id)
    except Exception as exc:
        log.warning("could not advance the flow; it is looked at again later", exc_info=True,
                    extra={"flow_run": run_id})  # fmt: skip
        try:
            run = FlowRun.objects.filter(pk=run_id).first()
            if run is not None:
                FlowRun.objects.filter(pk=run_id).update(
                    error=f"the flow could not move on: {type(exc).__name__}: {exc}"[:2000],
                    check_at=_later(_pause(run)),
                )
        except Exception:
            log.warning("could not record why the flow is stuck", exc_info=True, extra={"flow_run": run_id})


def advance_due(*, batch: int = 200, keep_going: Callable[[], bool] = lambda: True) -> int:
    """The rescuer's backstop: advance every unfinished run whose ``check_at`` has passed
    (asking ``keep_going`` before each, as ``run_rescuer`` does)."""
    due = list(
        FlowRun.objects.filter(
            state__in=(FlowState.RUNNING, FlowState.COMPENSATING, FlowState.FAILED_TO_COMPENSATE),
            check_at__lte=timezone.now(),
        )
        .order_by("check_at")
        .values_list("pk", flat=True)[:batch]
    )
    advanced = 0
    for pk in due:
        if not keep_going():
            break
        advance_quietly(pk)
        advanced += 1
    return advanced


def _later(seconds: int) -> Any:
    return timezone.now() + timedelta(seconds=seconds)


def _pause(run: FlowRun) -> int:
    """How long a run that could not move waits for its next look: twice as long as it has
    been stuck, from ``CHECK_SECONDS`` up to ``STUCK_CHECK_SECONDS``."""
    waited = (timezone.now() - run.updated_at).total_seconds()
    return int(min(STUCK_CHECK_SECONDS, max(CHECK_SECONDS, 2 * waited)))


def _decide(run: FlowRun, flow: Flow, *, on_commit: bool) -> None:
    """The one next move of ``run`` (locked by the caller), from its executions' states."""
    # Only this run's own rows count as its steps: a foreign execution under a flow key (the
    # prefix is refused to submit(), but rows may come from elsewhere) must not pass for one.
    found = {e.idempotency_key: e for e in Execution.objects.filter(idempotency_key__in=flow_keys(run), flow_id=run.pk)}
    results = dict(run.results or {})
    if run.state == FlowState.RUNNING:
        for i, step in enumerate(flow.steps):
            execution = found.get(step_key(run, i, step))
            run.step = i
            if execution is None:
                kwargs = step.kwargs(copy.deepcopy(run.input), copy.deepcopy(results))  # a builder may change them
                _submit(run, step.task_name, kwargs, step_key(run, i, step), on_commit)
                run.check_at = _later(CHECK_SECONDS)
                return
            if execution.state == State.SUCCEEDED:
                results[step.name] = execution.result
                run.results = results
                continue
            if execution.state in (State.FAILED, State.CANCELLED):
                fence = _open_fence(execution)
                if fence is not None:
                    # Stopped while it ran (an operator's cancel or "mark failed"): its body may
                    # still be running until its last lease ends. Nothing is undone beside it.
                    run.error = f"step {step.name} was stopped while running; compensating once its lease ends"
                    run.check_at = fence + timedelta(seconds=1)
                    return
                run.state = FlowState.COMPENSATING
                run.failed_step = step.name
                run.error = execution.last_error or f"step {step.name} was {execution.state.lower()}"
                log.warning("flow step failed for good; compensating", extra={"flow_run": run.pk, "step": step.name})
                break
            run.check_at = _later(CHECK_SECONDS)  # the step is still on its way
            return
        else:
            run.state = FlowState.SUCCEEDED
            run.finished_at = timezone.now()
            run.check_at = None
            return
    failed_at = flow.index(run.failed_step) if run.failed_step else len(flow.steps)
    first = failed_at - 1
    unundone = ""  # a failed step that may have done its work and has no compensation
    if failed_at < len(flow.steps):
        failed = found.get(step_key(run, failed_at, flow.steps[failed_at]))
        if failed is not None and _in_doubt(failed):
            first = failed_at  # it may have done its work before it was stopped: undo it too
            if flow.steps[failed_at].compensate_name is None:
                unundone = flow.steps[failed_at].name
    for j in range(first, -1, -1):
        step = flow.steps[j]
        if step.compensate_name is None:
            continue
        run.step = j
        execution = found.get(undo_key(run, j, step))
        if execution is None:
            run.state = FlowState.COMPENSATING
            try:
                # A step in doubt has no result in ``results``: its builder must not need one.
                kwargs = step.compensate_kwargs(copy.deepcopy(run.input), copy.deepcopy(results))
            except Exception as exc:
                # The move to compensating is kept (so no forward step can be retried any more)
                # and the reason is on the run; it is looked at again later, backing off.
                log.warning("a compensation's arguments could not be built", exc_info=True,
                            extra={"flow_run": run.pk, "step": step.name})  # fmt: skip
                problem = f"the compensation of {step.name} could not be built: {type(exc).__name__}: {exc}"
                run.error = f"{_without_problem(run.error)}{_PROBLEM}{problem}"[:2000]
                run.check_at = _later(_pause(run))
                return
            run.error = _without_problem(run.error)
            _submit(run, step.compensate_name, kwargs, undo_key(run, j, step), on_commit)
            run.check_at = _later(CHECK_SECONDS)
            return
        if execution.state == State.SUCCEEDED:
            continue
        if execution.state in (State.FAILED, State.CANCELLED):
            if run.state != FlowState.FAILED_TO_COMPENSATE:
                log.error("a compensation failed for good", extra={"flow_run": run.pk, "step": step.name})
            run.state = FlowState.FAILED_TO_COMPENSATE
            run.error = execution.last_error or f"compensation of {step.name} was {execution.state.lower()}"
            run.check_at = _later(STUCK_CHECK_SECONDS)
            return
        run.state = FlowState.COMPENSATING  # on its way (perhaps retried by an operator)
        run.check_at = _later(CHECK_SECONDS)
        return
    run.state = FlowState.COMPENSATED
    run.finished_at = timezone.now()
    run.check_at = None
    if unundone:
        run.error = (
            f"step {unundone} was stopped or lost while it ran and may have done its work, "
            "but it has no compensation: check it by hand"
        )


#: Between the reason a run compensates and a problem that holds it up (``_decide``).
_PROBLEM = " | held up: "


def _without_problem(error: str) -> str:
    return error.split(_PROBLEM, 1)[0]


def _open_fence(execution: Execution) -> datetime | None:
    """The end of the last lease of a step stopped while it ran (an operator's cancel or
    "mark failed" keeps it on the row as a fence), while it is still ahead by the database's
    clock (the one claims compare it with); else None."""
    fence = execution.lease_expires_at
    if fence is None or not Execution.objects.filter(pk=execution.pk, lease_expires_at__gt=UtcNow()).exists():
        return None
    return fence


def _in_doubt(execution: Execution) -> bool:
    """Whether a failed step may have done its work. A step that fails by raising in its own
    attempt leaves no effect (the steps' contract); but if any attempt of its history did not
    end that way, it may have: an attempt whose worker was lost (re-queued by the rescuer,
    taken over by a redelivery, dead-lettered as lost), one whose lease renewal was refused,
    or one an operator stopped while it ran. Its compensation then runs too (compensations
    must be safe to run for a step that did nothing)."""
    from ..models import EventKind, ExecutionEvent

    history = ExecutionEvent.objects.filter(execution_id=execution.pk)
    lost = Q(kind__in=(EventKind.RESCUED, EventKind.TAKEN_OVER, EventKind.LEASE_LOST))
    stopped = Q(kind=EventKind.OPERATOR, from_state=State.RUNNING)
    dead_as_lost = Q(kind=EventKind.DEAD_LETTERED, from_state=State.RUNNING) & (
        Q(actor="rescuer") | Q(data__attempt_lost=True) | Q(data__error__icontains="was lost")
    )
    return history.filter(lost | stopped | dead_as_lost).exists()


def _submit(run: FlowRun, task_name: str, kwargs: Mapping[str, Any], key: str, on_commit: bool) -> None:
    submission._submit_or_get(
        task_name, [], dict(kwargs), idempotency_key=key, countdown=None, eta=None, queue=None, priority=None,
        on_commit=on_commit, trigger=Trigger.FLOW, slot=None, flow_id=run.pk,
    )  # fmt: skip


def timeline(run: FlowRun) -> list[dict[str, Any]]:
    """Every event of the run's executions, steps and compensations, on one timeline."""
    from ..models import ExecutionEvent

    executions = {e.pk: e for e in Execution.objects.filter(flow_id=run.pk, idempotency_key__in=flow_keys(run))}
    events = ExecutionEvent.objects.filter(execution_id__in=list(executions)).order_by("at", "id")
    rows = []
    for event in events:
        execution = executions[event.execution_id]
        part = execution.idempotency_key.split(":", 3)[3]
        rows.append({"event": event, "execution": execution, "part": part.replace(":undo", " (compensation)")})
    return rows


def parts(run: FlowRun) -> list[dict[str, Any]]:
    """The run's steps and compensations as the console lists them: each with its execution
    (None until submitted)."""
    flow = registered(run.flow)
    if flow is None:
        return []
    found = {e.idempotency_key: e for e in Execution.objects.filter(idempotency_key__in=flow_keys(run))}
    rows = []
    for i, step in enumerate(flow.steps):
        rows.append({"name": step.name, "kind": "step", "task": step.task_name,
                     "execution": found.get(step_key(run, i, step))})  # fmt: skip
    for i, step in reversed(list(enumerate(flow.steps))):
        if step.compensate_name is not None:
            rows.append({"name": step.name, "kind": "compensation", "task": step.compensate_name,
                         "execution": found.get(undo_key(run, i, step))})  # fmt: skip
    return rows


@contextmanager
def operator_acting(execution: Execution | None, target: str) -> Iterator[str | None]:
    """Around an operator's transition of ``execution``: why it is refused (or None), with the
    execution's flow run locked until the block ends, so the run cannot move on between the
    check and the transition (``advance`` takes the same lock)."""
    if execution is None or execution.flow_id is None:
        yield None
        return
    with transaction.atomic():
        run = FlowRun.objects.select_for_update().filter(pk=execution.flow_id).first()
        yield operator_may(execution, target, run)


def operator_may(execution: Execution, target: str, run: FlowRun | None = None) -> str | None:
    """Why an operator may not move ``execution`` (a flow's step or compensation) to
    ``target``, or None. A forward step is retried, or marked succeeded, only while its run
    still runs forward: once the run compensates, or has ended, a retried step's effect would
    never be undone, and a step marked succeeded would neither be undone nor let the run on
    (review of the flows). Stopping one (cancel, mark failed) is always allowed."""
    if execution.flow_id is None or target not in (State.PENDING, State.SUCCEEDED):
        return None
    if run is None:
        run = FlowRun.objects.filter(pk=execution.flow_id).first()
    if run is None:
        return None
    if target == State.SUCCEEDED:
        fence = (
            Execution.objects.filter(
                pk=execution.pk, state__in=(State.FAILED, State.CANCELLED), lease_expires_at__gt=UtcNow()
            )
            .values_list("lease_expires_at", flat=True)
            .first()
        )
        if fence is not None:
            # Stopped while it ran: its body may still be running until then. Marked succeeded
            # now, the run would move on (the next compensation, or the next step) beside it.
            return (
                f"its stopped attempt may still be running until {fence:%Y-%m-%d %H:%M:%S %Z}: "
                "mark it succeeded after that"
            )
    compensation = execution.idempotency_key.endswith(":undo")
    if compensation and run.state in (FlowState.COMPENSATING, FlowState.FAILED_TO_COMPENSATE):
        return None
    if not compensation and run.state == FlowState.RUNNING:
        return None
    what = "compensation" if compensation else "step"
    if target == State.SUCCEEDED:
        return (
            f"this {what} belongs to flow run {run.pk}, which is {run.get_state_display()}: "
            "marking it succeeded now would never be undone"
        )
    return (
        f"this {what} belongs to flow run {run.pk}, which is {run.get_state_display()}: "
        "running it again now would not be undone"
    )
