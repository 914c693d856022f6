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

# The demo jobs' schedules are created by `manage.py bootstrap_demo` (see tasks/).
