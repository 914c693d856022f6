"""Benchmark settings: the reference deployment's Celery settings, a PostgreSQL bench database."""

from __future__ import annotations

import os

# The bench database when DATABASE_URL is not set; bench/run.py creates whichever is named.
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/taskplatform_bench")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/13")

from django.core.management.utils import get_random_secret_key

from config.settings.base import *  # noqa: F403
from config.settings.base import INSTALLED_APPS

SECRET_KEY = get_random_secret_key()
INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_results", "procrastinate.contrib.django", "bench.benchapp"]
CELERY_RESULT_BACKEND = "django-db"  # used only by the bench.dcr_* tasks (the others ignore results)
CELERY_TASK_DEFAULT_QUEUE = "bench"
CELERY_BEAT_SCHEDULE = {}
# Monitoring events cost every variant the same; off, so figures compare with earlier runs.
CELERY_WORKER_SEND_TASK_EVENTS = False
CELERY_TASK_SEND_SENT_EVENT = False
BENCH_ONCE_REDIS_URL = os.environ.get("BENCH_ONCE_REDIS_URL", "redis://127.0.0.1:6379/12")
if os.environ.get("BENCH_DB_REUSE_MAX") == "unset":  # Celery's out-of-the-box behaviour
    del CELERY_DB_REUSE_MAX  # noqa: F821
# BENCH_DEFERRED_SUCCESS=0: the success written in the pool process (worker/recorder.py off), for an A/B.
TASKPLATFORM_DEFERRED_SUCCESS = os.environ.get("BENCH_DEFERRED_SUCCESS", "1") != "0"
# Procrastinate (the PostgreSQL-queue peer) imports only the benchmark's jobs, not every
# app's ``tasks`` module (its default), so its worker does not load the Celery tasks.
PROCRASTINATE_AUTODISCOVER_MODULE_NAME = ""
PROCRASTINATE_IMPORT_PATHS = ["bench.benchapp.jobs"]
LOGGING = {"version": 1, "disable_existing_loggers": False}
# celery-redbeat (bench/beat.py): its own Redis database; lock timings from the environment
# so the same settings serve its defaults and a tuned run.
CELERY_REDBEAT_REDIS_URL = os.environ.get("BENCH_REDBEAT_REDIS_URL", "redis://127.0.0.1:6379/11")
if os.environ.get("BENCH_REDBEAT_LOCK_TIMEOUT"):
    CELERY_REDBEAT_LOCK_TIMEOUT = int(os.environ["BENCH_REDBEAT_LOCK_TIMEOUT"])
if os.environ.get("BENCH_BEAT_MAX_LOOP_INTERVAL"):
    CELERY_BEAT_MAX_LOOP_INTERVAL = int(os.environ["BENCH_BEAT_MAX_LOOP_INTERVAL"])
