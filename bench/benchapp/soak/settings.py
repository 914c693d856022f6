"""Settings of the soak's processes (``bench/soak.py`` sets the environment before starting them).

The reference deployment's settings, the soak app, a second connection to the same database
(``oracle``: body starts are committed outside the ledger's transaction), and short timings so
that faults are recovered from in seconds: a 10 s execution lease, the rescuer every 3 s, a
lost message re-published after 20 s, and retries longer than 3 s parked in the ledger.
"""

from __future__ import annotations

import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/taskplatform_soak")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6390/0")
os.environ.setdefault("TASKPLATFORM_LEASE_SECONDS", "10")
os.environ.setdefault("TASKPLATFORM_RESCUE_INTERVAL_SECONDS", "3")
os.environ.setdefault("TASKPLATFORM_REPUBLISH_AFTER_SECONDS", "20")
os.environ.setdefault("TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS", "3")
os.environ.setdefault("TASKPLATFORM_LOG_LEVEL", "WARNING")

from django.core.management.utils import get_random_secret_key

from config.settings.base import *  # noqa: F403
from config.settings.base import DATABASES, INSTALLED_APPS

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or get_random_secret_key()
INSTALLED_APPS = [*INSTALLED_APPS, "bench.benchapp.soak"]
DATABASES["oracle"] = {**DATABASES["default"]}
TASKPLATFORM_LEASE_SECONDS = int(os.environ["TASKPLATFORM_LEASE_SECONDS"])
TASKPLATFORM_RESCUE_INTERVAL_SECONDS = int(os.environ["TASKPLATFORM_RESCUE_INTERVAL_SECONDS"])
TASKPLATFORM_REPUBLISH_AFTER_SECONDS = int(os.environ["TASKPLATFORM_REPUBLISH_AFTER_SECONDS"])
TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS = int(os.environ["TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS"])
CELERY_BEAT_SCHEDULE = {}
# Monitoring events are not what the soak measures; off, as in the other benchmarks.
CELERY_WORKER_SEND_TASK_EVENTS = False
CELERY_TASK_SEND_SENT_EVENT = False
