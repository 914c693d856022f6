"""Helpers shared by tests: bounded polling and ledger observations."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
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


def tally(executions: Any, *, starts: Callable[[str], int] | None = None) -> dict[str, int]:
    """The catalogue's figures for these executions, observed in the ledger and the effect tables.

    ``body_starts`` counts ``EffectRaw`` "started" rows unless ``starts(key)`` is given (atomic
    bodies log their starts outside their transaction); ``effects`` counts committed ``Effect``
    rows (no unique key); ``duplicates`` is the effects beyond one per execution; ``lost`` is the
    executions that never reached a final state (or whose row is gone).
    """
    from taskplatform.models import Execution
    from tests.testapp.models import Effect, EffectRaw

    executions = list(executions)
    keys = [e.idempotency_key for e in executions]
    count_starts = starts or (lambda key: EffectRaw.objects.filter(key=key, phase="started").count())
    effects = {key: Effect.objects.filter(key=key).count() for key in keys}
    final = Execution.objects.filter(
        pk__in=[e.pk for e in executions], state__in=["SUCCEEDED", "FAILED", "CANCELLED"]
    ).count()
    return {
        "executions": len(keys),
        "body_starts": sum(count_starts(key) for key in keys),
        "effects": sum(effects.values()),
        "lost": len(keys) - final,
        "duplicates": sum(max(0, n - 1) for n in effects.values()),
    }


@contextlib.contextmanager
def result_backend_at(url: str) -> Iterator[None]:
    """This process's Celery app (the publishing side) uses the result backend at ``url``."""
    from celery import current_app

    previous_env = os.environ.get("CELERY_RESULT_BACKEND")
    previous = current_app.conf.result_backend
    os.environ["CELERY_RESULT_BACKEND"] = url  # Celery's Settings prefer the environment
    current_app.conf.result_backend = url
    _forget_backend(current_app)
    try:
        yield
    finally:
        if previous_env is None:
            os.environ.pop("CELERY_RESULT_BACKEND", None)
        else:
            os.environ["CELERY_RESULT_BACKEND"] = previous_env
        current_app.conf.result_backend = previous
        _forget_backend(current_app)


def _forget_backend(app: Any) -> None:
    """Make ``app.backend`` be built again from the configuration (Celery caches it per app,
    or per thread for a backend that is not thread-safe)."""
    app._backend_cache = None
    app._local.__dict__.pop("backend", None)
