"""The transitions table is the single authority over state changes."""

import pytest

from taskplatform.domain.states import (
    TERMINAL_STATES,
    TRANSITIONS,
    Actor,
    State,
    find_transition,
    operator_targets,
)
from taskplatform.exceptions import IllegalTransitionError


def test_every_state_is_documented_and_reachable():
    from taskplatform.domain.states import STATE_DOCS

    assert set(STATE_DOCS) == set(State)
    reachable = {State.PENDING} | {tr.target for tr in TRANSITIONS}
    assert reachable == set(State)


def test_worker_cannot_leave_a_terminal_state():
    for state in TERMINAL_STATES:
        for target in State:
            with pytest.raises(IllegalTransitionError):
                find_transition(state, target, Actor.WORKER)


@pytest.mark.parametrize(
    ("source", "target"),
    [("RUNNING", "PENDING"), ("SUCCEEDED", "PENDING"), ("SUCCEEDED", "FAILED"), ("PENDING", "SUCCEEDED")],
)
def test_operator_cannot_take_illegal_edges(source, target):
    with pytest.raises(IllegalTransitionError, match="not a legal transition"):
        find_transition(source, target, Actor.OPERATOR)


def test_an_edge_reserved_to_workers_names_who_may_take_it():
    with pytest.raises(IllegalTransitionError, match="may only be performed by: worker"):
        find_transition("PENDING", "RUNNING", Actor.OPERATOR)


def test_operator_actions_from_a_dead_letter():
    names = {(tr.target, tr.name) for tr in operator_targets(State.FAILED)}
    assert names == {(State.SUCCEEDED, "mark_succeeded"), (State.PENDING, "retry_now")}


def test_nothing_leaves_succeeded():
    assert [tr for tr in TRANSITIONS if tr.source == State.SUCCEEDED] == []


def test_the_states_reference_document_is_current():
    from pathlib import Path

    from taskplatform.management.commands.taskplatform import states_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "reference" / "states.md"
    assert states_markdown() in doc.read_text(), "regenerate with: python manage.py taskplatform states"


def test_every_state_has_a_console_colour_and_a_django_tasks_status():
    """A new state (``WAITING``) must show in the console and read through django-tasks."""
    from pathlib import Path

    from taskplatform.task_backend import STATUS

    css = (
        Path(__file__).resolve().parents[2] / "platform/src/taskplatform/static/taskplatform/console.css"
    ).read_text()
    for state in State:
        assert f".tp-state-{state.value.lower()} " in css, state
        assert state in STATUS, state
