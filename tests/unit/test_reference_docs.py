"""The generated reference pages stay equal to the code (``taskplatform.reference``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from taskplatform.checks import CHECKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", ["api", "checks"])
def test_the_reference_page_is_the_code(page: str) -> None:
    from taskplatform.reference import api_markdown, checks_markdown

    written = {"api": api_markdown, "checks": checks_markdown}[page]()
    doc = ROOT / "docs" / "reference" / f"{page}.md"
    assert doc.read_text() == written, f"regenerate: .venv/bin/python -m taskplatform.reference {page} > {doc}"


def test_every_check_the_code_reports_is_in_the_reference() -> None:
    source = (ROOT / "platform" / "src" / "taskplatform" / "checks.py").read_text()
    used = set(re.findall(r'id="(taskplatform\.[EW]\d{3})"', source))
    assert used == set(CHECKS), (
        f"reported but not listed: {used - set(CHECKS)}; listed but never reported: {set(CHECKS) - used}"
    )
