"""The fault catalogue is complete: every scenario of tests/catalogue.py has a test marked for it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.catalogue import SCENARIOS

TESTS = Path(__file__).resolve().parent.parent


def marked_scenarios() -> dict[int, list[str]]:
    """Scenario numbers named in ``pytest.mark.scenario(...)`` anywhere under tests/, by file."""
    found: dict[int, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "scenario"
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "mark"
            ):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
                        found.setdefault(arg.value, []).append(path.name)
    return found


def test_the_catalogue_numbers_its_39_scenarios_once_each() -> None:
    assert [s.number for s in SCENARIOS] == list(range(1, 40))


def test_every_scenario_has_a_test_marked_for_it() -> None:
    found = marked_scenarios()
    missing = [s.number for s in SCENARIOS if s.number not in found]
    assert not missing, f"scenarios without a test marked @pytest.mark.scenario(n): {missing}"
    unknown = sorted(set(found) - {s.number for s in SCENARIOS})
    assert not unknown, f"tests marked for scenarios the catalogue does not have: {unknown}"


def _marks(decorators: list[ast.expr]) -> tuple[set[int], bool]:
    """The scenario numbers and whether ``slow`` is among ``decorators`` (``pytest.mark.…``)."""
    scenarios: set[int] = set()
    slow = False
    for node in decorators:
        call = node if isinstance(node, ast.Call) else None
        target = call.func if call is not None else node
        if (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Attribute)
            and target.value.attr == "mark"
        ):
            if target.attr == "slow":
                slow = True
            elif target.attr == "scenario" and call is not None:
                scenarios |= {a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, int)}
    return scenarios, slow


def scenarios_run_by_ci() -> set[int]:
    """Scenarios with at least one test `make test` runs (not marked slow, nor in a slow module)."""
    found: set[int] = set()
    for path in TESTS.rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        module_slow = any(
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            and "slow" in ast.unparse(node.value)
            for node in tree.body
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                scenarios, slow = _marks(node.decorator_list)
                if not (slow or module_slow):
                    found |= scenarios
    return found


#: Scenarios whose every test takes minutes (a visibility timeout, a soft limit, a long outage)
#: and runs in `make chaos` only, as of 2026-12-01. This set may shrink, never grow.
CHAOS_ONLY = {3, 4, 6, 8, 10, 18, 19, 25, 28, 30}


def test_no_scenario_loses_its_tests_in_ci() -> None:
    """Found in review: marking a scenario's only CI test slow (to save CI time) left its fault
    checked by `make chaos` alone. A scenario with a test in `make test` keeps one there."""
    chaos_only = {s.number for s in SCENARIOS} - scenarios_run_by_ci()
    assert chaos_only <= CHAOS_ONLY, f"scenarios that lost their last CI test: {sorted(chaos_only - CHAOS_ONLY)}"
