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
