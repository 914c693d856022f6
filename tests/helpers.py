"""Helpers shared by tests: bounded polling and ledger observations."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], *, timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def state_of(pk: int) -> str:
    from taskplatform.models import Execution

    return str(Execution.objects.values_list("state", flat=True).get(pk=pk))


def event_kinds(pk: int) -> list[str]:
    from taskplatform.models import ExecutionEvent

    return list(ExecutionEvent.objects.filter(execution_id=pk).order_by("id").values_list("kind", flat=True))
