"""Flow declarations: a name and ordered steps, each a task with an optional compensation.

Pure data, importable before Django is set up (a flow is declared beside its tasks, in a
module workers import). ``core/flows.py`` runs them on the ledger; ``taskplatform.submit_flow``
starts one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..exceptions import InvalidArgumentsError

KwargsBuilder = Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, Any]]


def _input_as_kwargs(input: Mapping[str, Any], results: Mapping[str, Any]) -> Mapping[str, Any]:
    return dict(input)


@dataclass(frozen=True)
class Step:
    """One step: a task, an optional compensating task, and how each gets its arguments
    (``kwargs(input, results)``; by default the flow's input as keyword arguments)."""

    name: str
    task: Any  # an IdempotentTask or its registered name
    compensate: Any = None
    kwargs: KwargsBuilder = _input_as_kwargs
    compensate_kwargs: KwargsBuilder = _input_as_kwargs

    @property
    def task_name(self) -> str:
        return self.task if isinstance(self.task, str) else str(self.task.name)

    @property
    def compensate_name(self) -> str | None:
        if self.compensate is None:
            return None
        return self.compensate if isinstance(self.compensate, str) else str(self.compensate.name)


_REGISTRY: dict[str, Flow] = {}


class Flow:
    """A declared flow: a name and its ordered steps. Declaring registers it by name."""

    def __init__(self, name: str, steps: Sequence[Step]) -> None:
        if not steps:
            raise InvalidArgumentsError(f"flow {name!r} has no steps")
        names = [s.name for s in steps]
        for step_name in names:
            # A step's name is part of its executions' keys (``flow:<run>:<i>:<name>[:undo]``):
            # a colon would let a step pass for a compensation (``…:undo``).
            if not step_name or ":" in step_name or len(step_name) > 100:
                raise InvalidArgumentsError(
                    f"flow {name!r}: a step's name has 1 to 100 characters and no ':', not {step_name!r}"
                )
        if len(set(names)) != len(names):
            raise InvalidArgumentsError(f"flow {name!r}: step names must differ, not {names}")
        if not name or len(name) > 100:
            raise InvalidArgumentsError("a flow's name must have 1 to 100 characters")
        self.name = name
        self.steps = tuple(steps)
        _REGISTRY[name] = self

    def __repr__(self) -> str:
        return f"Flow({self.name!r}, steps={[s.name for s in self.steps]})"

    def index(self, step_name: str) -> int:
        return next(i for i, s in enumerate(self.steps) if s.name == step_name)


def registered(name: str) -> Flow | None:
    """The flow declared under ``name`` in this process, if any."""
    return _REGISTRY.get(name)
