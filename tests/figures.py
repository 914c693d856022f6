"""Figures of the fault catalogue: what each scenario's test measured in its last run.

A catalogue test is marked ``@pytest.mark.scenario(n, ...)`` with the numbers of the scenarios
it checks (``tests/catalogue.py``; that marker implies ``chaos``). It asks for the ``figures``
fixture and records what it observed, never what it expects::

    figures.record(executions=1, body_starts=2, effects=1, lost=0, duplicates=0, recovery_s=4.2)

With ``--figures PATH`` (``make chaos`` passes ``var/chaos/figures.jsonl``) each catalogue
test appends one JSON line: its node id, scenarios, outcome, duration and figures.
``bin/catalogue`` turns that file into the table in ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: The standard columns, in the table's order; anything else goes in "other".
COLUMNS = ("executions", "body_starts", "effects", "lost", "duplicates", "recovery_s")


@dataclass
class Figures:
    """What one catalogue test measured. ``record`` may be called several times (it merges)."""

    nodeid: str
    scenarios: tuple[int, ...]
    values: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def record(self, **values: Any) -> None:
        for name, value in values.items():
            if isinstance(value, float):
                value = round(value, 2)
            self.values[name] = value

    def since_start(self) -> float:
        """Seconds since the test began: a default for a recovery time measured from the fault."""
        return round(time.monotonic() - self.started, 2)


def scenarios_of(item: pytest.Item) -> tuple[int, ...]:
    numbers: list[int] = []
    for marker in item.iter_markers("scenario"):
        numbers += [int(n) for n in marker.args]
    return tuple(sorted(set(numbers)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--figures",
        default="",
        help="append each catalogue test's figures and outcome to this JSON-lines file",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if scenarios_of(item):
            item.add_marker(pytest.mark.chaos)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    """The figures of this catalogue test; written out with its outcome when it ends."""
    scenarios = scenarios_of(request.node)
    if not scenarios:
        raise pytest.UsageError(f"{request.node.nodeid} asks for figures but has no scenario marker")
    recorded = Figures(nodeid=request.node.nodeid, scenarios=scenarios)
    request.node.stash[_FIGURES] = recorded
    yield recorded


_FIGURES = pytest.StashKey[Figures]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    path = item.config.getoption("--figures")
    scenarios = scenarios_of(item)
    if not path or not scenarios:
        return
    # One line per test: its call phase, or the phase that failed or skipped it first.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        recorded = item.stash.get(_FIGURES, None)
        line = {
            "nodeid": item.nodeid,
            "scenarios": list(scenarios),
            "outcome": report.outcome,
            "seconds": round(report.duration, 1),
            "figures": recorded.values if recorded else {},
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a") as out:
            out.write(json.dumps(line) + "\n")
