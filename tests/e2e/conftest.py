"""A real browser for the console tests: Playwright driving Debian's chromium (bin/system-deps)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI, ROOT

# The flags that work on this machine's closed network (see the env page): no sandbox as
# root, no GPU, no background connections to Google's services.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]  # fmt: skip
#: Where the README's screenshots live; refreshed when TASKPLATFORM_UPDATE_SCREENSHOTS=1.
SCREENSHOTS = ROOT / "docs" / "img"


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "chromium is not installed (bin/system-deps installs Debian's package)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture
def page(chromium_path: str, tmp_path: Path) -> Iterator[Any]:
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.set_default_timeout(20_000)
        try:
            yield page
        finally:
            context.close()
            browser.close()


@pytest.fixture
def screenshot(tmp_path: Path) -> Any:
    """``screenshot(page, "name")``: saved with the test's files, and into docs/img on request."""

    def take(page: Any, name: str, selector: str | None = None) -> Path:
        target = tmp_path / f"{name}.png"
        if selector:
            page.locator(selector).screenshot(path=str(target))
        else:
            page.screenshot(path=str(target), full_page=True)
        if os.environ.get("TASKPLATFORM_UPDATE_SCREENSHOTS") == "1":
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(target, SCREENSHOTS / f"{name}.png")
        return target

    return take
