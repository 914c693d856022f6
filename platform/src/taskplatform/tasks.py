"""``taskplatform.tasks``: the documented import path of the task base class.

Celery's autodiscovery imports ``<app>.tasks`` for every installed app, which registers the
platform's own tasks (``taskplatform.rescue``, ``taskplatform.trigger_job``). The code lives
in the ``worker`` package.
"""

from __future__ import annotations

from .worker.builtins import rescue, trigger_job
from .worker.task import UNBOUNDED_ATTEMPTS_CAP, IdempotentTask, PlatformRetry

__all__ = ["UNBOUNDED_ATTEMPTS_CAP", "IdempotentTask", "PlatformRetry", "rescue", "trigger_job"]
