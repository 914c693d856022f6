"""Local development: the embedded profile that ``make run`` starts."""

from __future__ import annotations

import os
from pathlib import Path

from django.core.management.utils import get_random_secret_key

# A shell or a management command in another terminal, beside `make run`, publishes to the
# run's private redis-server (bin/run-embedded exports its socket to the processes it starts
# only): without this its messages went to the filesystem transport nobody reads, and waited
# for the rescuer's republication minutes later.
_RUN_SOCKET = Path(os.environ.get("TASKPLATFORM_VAR_DIR", Path(__file__).resolve().parents[2] / "var")) / "redis.sock"
if not os.environ.get("CELERY_BROKER_URL") and _RUN_SOCKET.is_socket():
    os.environ["CELERY_BROKER_URL"] = f"redis+socket://{_RUN_SOCKET}"

from .base import *  # noqa: E402, F403
from .base import VAR_DIR  # noqa: E402


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
