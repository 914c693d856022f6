"""The canonical execution states and every legal transition, with who may perform it.

This module is the single source of truth: the ledger enforces it, the admin reads it to
decide which actions to offer, and ``docs/reference/states.md`` is generated from the same
table (``python manage.py taskplatform states``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from django.db import models

from ..exceptions import IllegalTransitionError


class State(models.TextChoices):
    """Where an execution is in its life."""

    PENDING = "PENDING", "pending"  # recorded; a message is (or will be) on the broker
    RUNNING = "RUNNING", "running"  # claimed by a worker that holds a lease
    RETRYING = "RETRYING", "retrying"  # an attempt failed; the next one is due at ``due_at``
    WAITING = "WAITING", "waiting for a limit"  # a fleet-wide limit was full; published when a slot frees
    SUCCEEDED = "SUCCEEDED", "succeeded"  # terminal: the body completed and was recorded
    FAILED = "FAILED", "failed (dead letter)"  # terminal until an operator retries it
    CANCELLED = "CANCELLED", "cancelled"  # terminal until an operator requeues it


STATE_DOCS: dict[str, str] = {
    State.PENDING: "Recorded in the ledger; a message is on the broker or will be published by the rescuer.",
    State.RUNNING: "Claimed by one worker holding a lease; the fencing token identifies the attempt.",
    State.RETRYING: "The last attempt failed with a retryable error; the next attempt is due at `due_at`.",
    State.WAITING: (
        "A fleet-wide concurrency or rate limit was full when a worker claimed it: the claim was given back"
        " (no attempt counted) and it is published again when a slot frees, or at `due_at`."
    ),
    State.SUCCEEDED: "The body completed and its result is stored. No further run happens for this key.",
    State.FAILED: "Dead letter: a fatal error, or the last allowed attempt failed. Traceback kept.",
    State.CANCELLED: "Cancelled before it could finish; a late worker's write-back is refused.",
}

TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED})
CLAIMABLE_STATES = frozenset({State.PENDING, State.RETRYING, State.WAITING})


class Actor(enum.StrEnum):
    """Who performs a transition."""

    WORKER = "worker"  # IdempotentTask running on a Celery worker
    RESCUER = "rescuer"  # the periodic maintenance duty (the holder of the maintenance lease)
    OPERATOR = "operator"  # a person, through the admin or a management command


@dataclass(frozen=True)
class Transition:
    """One legal edge of the state machine."""

    source: State
    target: State
    name: str
    actors: frozenset[Actor]
    doc: str


def _t(source: State, target: State, name: str, actors: set[Actor], doc: str) -> Transition:
    return Transition(source, target, name, frozenset(actors), doc)


W, R, OP = Actor.WORKER, Actor.RESCUER, Actor.OPERATOR

TRANSITIONS: tuple[Transition, ...] = (
    _t(State.PENDING, State.RUNNING, "claim", {W}, "A worker claims the execution (compare-and-set)."),
    _t(State.RETRYING, State.RUNNING, "claim", {W}, "A worker claims the next attempt."),
    _t(State.WAITING, State.RUNNING, "claim", {W}, "A worker claims it once a slot of its limit is free."),
    _t(
        State.RUNNING,
        State.RUNNING,
        "takeover",
        {W},
        "A worker claims an attempt whose owner is known dead or whose lease expired.",
    ),
    _t(State.RUNNING, State.SUCCEEDED, "succeed", {W}, "The body returned; the result is stored."),
    _t(State.RUNNING, State.RETRYING, "retry", {W}, "A retryable error; the next attempt is scheduled."),
    _t(State.RUNNING, State.RETRYING, "rescue", {R}, "The lease expired; the execution is re-queued."),
    _t(
        State.RUNNING,
        State.WAITING,
        "wait_for_limit",
        {W},
        "A fleet-wide limit is full: the claim is given back, uncounted, and the execution waits for a slot.",
    ),
    _t(State.RUNNING, State.FAILED, "dead_letter", {W, R}, "Fatal error, or attempts exhausted."),
    _t(State.PENDING, State.FAILED, "dead_letter", {W}, "Attempts already exhausted when claimed."),
    _t(State.RETRYING, State.FAILED, "dead_letter", {W}, "Attempts already exhausted when claimed."),
    _t(State.WAITING, State.FAILED, "dead_letter", {W}, "Attempts already exhausted when claimed."),
    _t(State.RUNNING, State.FAILED, "mark_failed", {OP}, "An operator declares a running attempt failed."),
    _t(State.FAILED, State.SUCCEEDED, "mark_succeeded", {OP}, "An operator records work done by hand."),
    _t(State.FAILED, State.PENDING, "retry_now", {OP}, "An operator requeues a dead letter."),
    _t(State.CANCELLED, State.PENDING, "retry_now", {OP}, "An operator requeues a cancelled execution."),
    _t(State.RETRYING, State.PENDING, "retry_now", {OP}, "An operator runs a waiting retry now."),
    _t(State.PENDING, State.CANCELLED, "cancel", {OP}, "Cancelled before any worker claimed it."),
    _t(State.RETRYING, State.CANCELLED, "cancel", {OP}, "Cancelled while waiting for a retry."),
    _t(State.WAITING, State.CANCELLED, "cancel", {OP}, "Cancelled while waiting for a slot of its limit."),
    _t(State.RUNNING, State.CANCELLED, "cancel", {OP}, "Cancelled while running; the late write-back is refused."),
)

_BY_EDGE: dict[tuple[State, State], list[Transition]] = {}
for _tr in TRANSITIONS:
    _BY_EDGE.setdefault((_tr.source, _tr.target), []).append(_tr)


def find_transition(source: str, target: str, actor: Actor) -> Transition:
    """Return the transition ``source → target`` that ``actor`` may perform, or raise.

    >>> find_transition("PENDING", "RUNNING", Actor.WORKER).name
    'claim'
    >>> find_transition("RUNNING", "PENDING", Actor.OPERATOR)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    taskplatform.exceptions.IllegalTransitionError: RUNNING → PENDING is not a legal transition (legal ...
    """
    candidates = _BY_EDGE.get((State(source), State(target)), [])
    for tr in candidates:
        if actor in tr.actors:
            return tr
    if candidates:
        who = ", ".join(sorted({a.value for tr in candidates for a in tr.actors}))
        raise IllegalTransitionError(
            f"{source} → {target} may only be performed by: {who} (not {actor.value})",
            source=source,
            target=target,
            actor=actor.value,
        )
    legal = ", ".join(dict.fromkeys(tr.target.value for tr in TRANSITIONS if tr.source == source))
    raise IllegalTransitionError(
        f"{source} → {target} is not a legal transition (legal from {source}: {legal or 'none'})",
        source=source,
        target=target,
        actor=actor.value,
    )


def operator_targets(source: str) -> list[Transition]:
    """The transitions an operator may take from ``source`` (for the console's actions)."""
    return [tr for tr in TRANSITIONS if tr.source == source and Actor.OPERATOR in tr.actors]


def sources_for(name: str, actor: Actor) -> frozenset[State]:
    """Every state from which the named transition is legal for ``actor``."""
    return frozenset(tr.source for tr in TRANSITIONS if tr.name == name and actor in tr.actors)
