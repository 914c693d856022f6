"""Local development: the embedded profile that ``make run`` starts."""

from __future__ import annotations

import os

from django.core.management.utils import get_random_secret_key

from .base import *  # noqa: F403
from .base import VAR_DIR


def _local_secret_key() -> str:
    """A per-checkout key kept in ``var/`` (never committed); the environment wins."""
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    path = VAR_DIR / "secret_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(get_random_secret_key())
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _local_secret_key()
DEBUG = True

# Demo jobs so a fresh `make run` shows work flowing through the ledger.
CELERY_BEAT_SCHEDULE.update(  # noqa: F405
    {
        "demo-ping": {"task": "taskplatform.trigger_job", "schedule": 15.0, "args": ["demo-ping"]},
        "demo-flaky-sync": {"task": "taskplatform.trigger_job", "schedule": 30.0, "args": ["demo-flaky-sync"]},
    }
)
