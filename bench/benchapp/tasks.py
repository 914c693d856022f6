"""The benchmark's Celery tasks: each body of ``bodies.py`` four ways (plain Celery, with
django-celery-results, with celery-once, as an ``IdempotentTask``).

Task names are ``bench.<variant>_<body>`` (``bench.plain_noop``, ``bench.ledger_write``, ...);
the ``*_noop`` module attributes are kept for ``bench/submit_many.py`` and ``bench/beat.py``.
"""

from __future__ import annotations

from typing import Any

from celery import Task, current_app, shared_task
from celery_once import QueueOnce
from django.conf import settings

from bench.benchapp.bodies import ATOMIC_BODIES, BODIES, insert_row, set_state, two_commits
from taskplatform.tasks import IdempotentTask

# celery-once reads its configuration from the app (not the CELERY_ namespace).
current_app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": settings.BENCH_ONCE_REDIS_URL, "default_timeout": 3600},
}


def _register(body_name: str) -> dict[str, Task]:
    """One task per variant running ``body_name``; keys are the variants' task families."""
    body = BODIES[body_name]

    def run(i: int) -> int:
        return body(i)

    def run_bound(self: Any, i: int) -> int:
        return body(i)

    def run_floor(i: int) -> int:
        result = body(i)
        two_commits(i)
        return result

    def run_floor_submit(i: int, row_id: int) -> int:
        set_state(row_id, "RUNNING")
        result = body(i)
        set_state(row_id, "SUCCEEDED")
        return result

    def run_floor_one(i: int) -> int:
        result = body(i)
        insert_row(i, "SUCCEEDED")
        return result

    def run_floor_submit_one(i: int, row_id: int) -> int:
        result = body(i)
        set_state(row_id, "SUCCEEDED")
        return result

    return {
        "plain": shared_task(name=f"bench.plain_{body_name}", ignore_result=True)(run),
        "dcr": shared_task(name=f"bench.dcr_{body_name}", ignore_result=False)(run),
        "once": shared_task(
            name=f"bench.once_{body_name}", base=QueueOnce, once={"graceful": True}, ignore_result=True
        )(run),
        "floor": shared_task(name=f"bench.floor_{body_name}", ignore_result=True)(run_floor),
        "floor_submit": shared_task(name=f"bench.floor_submit_{body_name}", ignore_result=True)(run_floor_submit),
        "floor_one": shared_task(name=f"bench.floor_one_{body_name}", ignore_result=True)(run_floor_one),
        "floor_submit_one": shared_task(name=f"bench.floor_submit_one_{body_name}", ignore_result=True)(
            run_floor_submit_one
        ),
        "ledger": shared_task(
            name=f"bench.ledger_{body_name}", base=IdempotentTask, bind=True, atomic=body_name in ATOMIC_BODIES
        )(run_bound),
    }


#: TASKS[body][family]: the Celery task running ``body`` for that family of variants.
TASKS: dict[str, dict[str, Task]] = {name: _register(name) for name in BODIES}

plain_noop = TASKS["noop"]["plain"]
dcr_noop = TASKS["noop"]["dcr"]
once_noop = TASKS["noop"]["once"]
ledger_noop = TASKS["noop"]["ledger"]
