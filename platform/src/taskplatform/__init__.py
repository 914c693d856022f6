"""taskplatform: a reliable job platform for Django on Celery.

Public entry points (imported lazily so that importing the package never loads Django
models before the app registry is ready):

* ``taskplatform.submit`` / ``submit_or_get`` — record an execution and publish it after commit;
* ``taskplatform.submit_many`` — the same for a batch: one multi-row insert, one batched publication;
* ``taskplatform.schedule_job`` — give a job definition its schedule (the ``jobs`` service);
* ``taskplatform.define_limit`` — a fleet-wide concurrency or rate limit for a task or a job;
* ``taskplatform.Flow``, ``Step``, ``submit_flow`` — ordered steps with compensations (a saga);
* ``taskplatform.tasks.IdempotentTask`` — the task base class;
* ``taskplatform.beat.LockedScheduler`` — the value for ``CELERY_BEAT_SCHEDULER``;
* ``taskplatform.backends.get_lock_backend`` — the plug-in lock backends;
* ``taskplatform.exceptions`` — the error hierarchy.

The package is layered; ``docs/architecture.md`` draws the layers and says where new code
goes, and ``make test`` checks the import rules with import-linter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Flow",
    "Step",
    "define_limit",
    "schedule_job",
    "submit",
    "submit_flow",
    "submit_flow_or_get",
    "submit_many",
    "submit_or_get",
]

if TYPE_CHECKING:
    from .api import (
        Flow,
        Step,
        define_limit,
        schedule_job,
        submit,
        submit_flow,
        submit_flow_or_get,
        submit_many,
        submit_or_get,
    )


def __getattr__(name: str) -> Any:
    if name in ("Flow", "Step"):  # pure declarations: importable before django.setup()
        from .domain import flows

        return getattr(flows, name)
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'taskplatform' has no attribute {name!r}")
