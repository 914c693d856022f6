"""``taskplatform.beat``: the documented import path of the locked beat scheduler.

``CELERY_BEAT_SCHEDULER = "taskplatform.beat.LockedScheduler"``. The code lives in the
``scheduling`` package.
"""

from __future__ import annotations

from .scheduling.scheduler import LockedScheduler

__all__ = ["LockedScheduler"]
