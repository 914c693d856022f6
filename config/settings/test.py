"""Test settings: real services on this machine (PostgreSQL, Redis) unless overridden.

``DATABASE_URL`` selects the database the suite runs against (the ledger's portable tests
also run on SQLite and MariaDB); ``CELERY_BROKER_URL`` the broker used by worker
subprocesses.
"""

from __future__ import annotations

import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/taskplatform")
# Under pytest-xdist (``make test`` runs the PostgreSQL suite in two processes) each process has
# its own test database (pytest-django adds the worker's suffix) and its own broker database,
# so one process's flushes and Celery control broadcasts never reach the other's workers. The
# default is replaced, not an explicit URL: xdist's processes inherit the controller's
# environment (the default for process 0), and a worker subprocess gets its test's broker.
# Databases 11-13 are the benchmarks' (bench/settings.py), 11 also the Redis lock tests'.
os.environ["CELERY_BROKER_URL"] = (
    f"redis://127.0.0.1:6379/{(14, 15, 10, 9)[int(os.environ.get('PYTEST_XDIST_WORKER', 'gw0')[2:] or 0)]}"
    if os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/14") == "redis://127.0.0.1:6379/14"
    else os.environ["CELERY_BROKER_URL"]
)

from django.core.management.utils import get_random_secret_key

from .base import *  # noqa: F403
from .base import DATABASES, INSTALLED_APPS, VAR_DIR

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or get_random_secret_key()
INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not :memory:, so that threads and worker subprocesses share the database.
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES["default"]["TEST"] = {"NAME": os.environ.get("TEST_SQLITE_NAME", str(VAR_DIR / "test.sqlite3"))}

# Short leases so rescue paths are exercised in seconds; tests override per case.
TASKPLATFORM_LEASE_SECONDS = int(os.environ.get("TASKPLATFORM_LEASE_SECONDS", "6"))
TASKPLATFORM_REPUBLISH_AFTER_SECONDS = int(os.environ.get("TASKPLATFORM_REPUBLISH_AFTER_SECONDS", "300"))
TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS = int(os.environ.get("TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS", "60"))
CELERY_BEAT_SCHEDULE = {}
# Tests run the rescuer themselves (``run_rescuer()``) at the moments they choose; the workers'
# share of the maintenance duties has its own tests, which turn it on.
TASKPLATFORM_WORKER_MAINTENANCE = os.environ.get("TASKPLATFORM_WORKER_MAINTENANCE", "0") == "1"
