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


def race(n: int, fn: Callable[[int, Callable[[], None]], Any], *, timeout: float = 60) -> list[Any]:
    """Run ``fn(i, start)`` in ``n`` threads; each calls ``start()`` to wait for all the others.

    Returns the results (in completion order) and re-raises the first error. Each thread
    closes its own database connection, so the racers really are separate sessions.
    """
    import threading

    from django.db import connection

    barrier = threading.Barrier(n)
    results: list[Any] = []
    errors: list[BaseException] = []

    def runner(i: int) -> None:
        try:
            results.append(fn(i, lambda: barrier.wait(timeout=timeout)))
        except BaseException as exc:  # re-raised below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if errors:
        raise errors[0]
    assert len(results) == n, f"{n - len(results)} racers did not finish within {timeout} s"
    return results
