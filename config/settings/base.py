"""Settings shared by every profile. Everything deployment-specific comes from the environment.

| variable | default | meaning |
|---|---|---|
| ``DATABASE_URL`` | embedded SQLite (WAL) in ``var/`` | e.g. ``postgres://user@host:5432/db`` |
| ``CELERY_BROKER_URL`` | filesystem transport in ``var/`` | ``redis://host:6379/0``, ``amqp://u:p@host//`` |
| ``DJANGO_SECRET_KEY`` | generated per checkout (local/test only) | required in production |
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import dj_database_url

from taskplatform.observability.logs import PLAIN_FORMAT as PLAIN_LOG_FORMAT

BASE_DIR = Path(__file__).resolve().parent.parent.parent
VAR_DIR = Path(os.environ.get("TASKPLATFORM_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value is None or value == "" else float(value)


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


# --- Django ------------------------------------------------------------------------------------

DEBUG = False
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "django_tasks",
    "taskplatform",
    "tasks",
]

# Django's task API (django-tasks, the backport of django.tasks) on the ledger: a function
# decorated with @task and enqueued with .enqueue() is an execution like any submit().
TASKS = {"default": {"BACKEND": "taskplatform.task_backend.LedgerBackend"}}

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


#: libpq connection parameters that bound how long a dead connection can go unnoticed (seconds,
#: tcp_user_timeout in milliseconds): about 10 s whether the connection is idle or busy.
POSTGRES_LIVENESS: dict[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


def database_from_env(default_sqlite: Path) -> dict[str, Any]:
    """``DATABASE_URL`` if set, else the embedded SQLite database in WAL mode."""
    url = os.environ.get("DATABASE_URL")
    if url:
        config: dict[str, Any] = dict(dj_database_url.parse(url, conn_max_age=600, conn_health_checks=True))
        engine = config["ENGINE"]
        if engine.endswith("sqlite3"):
            config["OPTIONS"] = sqlite_options()
        elif engine.endswith("mysql"):
            config.setdefault("OPTIONS", {}).setdefault("charset", "utf8mb4")
        elif engine.endswith("postgresql"):
            # A silently cut connection (a partition, a dead peer) must fail, not hang: TCP
            # keepalives notice an idle one, tcp_user_timeout one with unacknowledged data, and
            # connect_timeout a connection attempt. A hung statement would hold a worker's lease
            # renewals or a beat's leadership check for as long as the cut lasts.
            options = config.setdefault("OPTIONS", {})
            for name, value in POSTGRES_LIVENESS.items():
                options.setdefault(name, value)
        return config
    default_sqlite.parent.mkdir(parents=True, exist_ok=True)
    private_sqlite_file(default_sqlite)
    return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(default_sqlite), "OPTIONS": sqlite_options()}


def private_sqlite_file(path: Path) -> None:
    """Create the embedded database owner-only (0600), and tighten one made before.

    It holds password and API-token hashes and every job's arguments, like the other
    secrets in ``var/``. SQLite gives its ``-wal`` and ``-shm`` files the database file's
    mode, so creating the (empty) file first, whatever the umask, covers them too; files
    left by an older checkout are tightened here. Another user's file is left alone.
    """
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        for name in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
            if name.exists() and stat.S_IMODE(name.stat().st_mode) & 0o077:
                name.chmod(0o600)
    except OSError:  # a read-only checkout or someone else's file: SQLite will say what is wrong
        pass


def sqlite_options() -> dict[str, Any]:
    """WAL so readers never block the writer; IMMEDIATE so writers queue instead of failing."""
    return {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
    }


DATABASES = {"default": database_from_env(VAR_DIR / "db.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

#: ``plain`` (one readable line) or ``json`` (one object per line; production's default).
#: Either way every line carries the execution id, idempotency key and fencing token.
TASKPLATFORM_LOG_FORMAT = os.environ.get("TASKPLATFORM_LOG_FORMAT", "plain")
# OpenTelemetry: "off", "console" (spans as JSON lines on stdout), "otlp" (OTEL_EXPORTER_OTLP_*), "provided".
TASKPLATFORM_TRACING = os.environ.get("TASKPLATFORM_TRACING", "off")
_LOG_LEVEL = os.environ.get("TASKPLATFORM_LOG_LEVEL", "INFO")
LOGGING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"execution": {"()": "taskplatform.observability.logs.ExecutionContextFilter"}},
    "formatters": {
        "plain": {"format": PLAIN_LOG_FORMAT},
        "json": {"()": "taskplatform.observability.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": TASKPLATFORM_LOG_FORMAT, "filters": ["execution"]}
    },
    # One handler, on the root logger: in Celery processes Celery replaces it with its own
    # (config/celery_app.py gives that one the same filter and format), so no line is doubled.
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"taskplatform": {"level": _LOG_LEVEL}, "tasks": {"level": _LOG_LEVEL}},
}

# --- Celery (read by config/celery_app.py with namespace="CELERY") -----------------------------


def broker_from_env() -> tuple[str, dict[str, Any]]:
    """``CELERY_BROKER_URL`` if set, else kombu's filesystem transport under ``var/``."""
    url = os.environ.get("CELERY_BROKER_URL")
    if url:
        options: dict[str, Any] = {}
        if url.startswith(("redis", "rediss")):
            options["visibility_timeout"] = env_int("CELERY_VISIBILITY_TIMEOUT", 3600)
            # kombu sweeps for messages past the visibility timeout only every interval x
            # throttle seconds (10 x 10 by default): with a short timeout, sweep as often.
            if os.environ.get("CELERY_UNACKED_RESTORE_INTERVAL"):
                options["unacked_restore_interval"] = env_int("CELERY_UNACKED_RESTORE_INTERVAL", 10)
                options["unacked_restore_throttle"] = 1
        if url.startswith(("amqp", "pyamqp")):
            # Publisher confirms: a publication returns once RabbitMQ has the message, so a
            # broker crash right after cannot lose it silently (measured: without confirms a
            # SIGKILL of the node lost all 9 recent persistent messages; with them, none).
            options["confirm_publish"] = True
        return url, options
    folder = VAR_DIR / "broker"
    (folder / "processed").mkdir(parents=True, exist_ok=True)
    return "filesystem://", {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "processed_folder": str(folder / "processed"),
        "store_processed": False,
    }


CELERY_BROKER_URL, CELERY_BROKER_TRANSPORT_OPTIONS = broker_from_env()
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_BACKEND = None  # the ledger is the record of outcomes
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
# Without this, Celery's Django fix-up closes the DB connection before and after every task.
CELERY_DB_REUSE_MAX = 1000
CELERY_TIMEZONE = "UTC"
# Task events for Flower (bin/flower): workers report task state, publishers report "sent".
CELERY_WORKER_SEND_TASK_EVENTS = env_bool("CELERY_WORKER_SEND_TASK_EVENTS", True)
CELERY_TASK_SEND_SENT_EVENT = env_bool("CELERY_TASK_SEND_SENT_EVENT", True)
# Several beats may run: one leads (lease on the lock backend), the others stand by. The
# leader also runs the rescuer and ledger pruning, so no beat entry is needed for them.
CELERY_BEAT_SCHEDULER = "taskplatform.beat.LockedScheduler"
CELERY_BEAT_SCHEDULE: dict[str, Any] = {}

# --- the reference deployment -----------------------------------------------------------------

#: The warehouse service the inventory-sync job pushes stock levels to (empty: the job is paused).
INVENTORY_SERVICE_URL = os.environ.get("INVENTORY_SERVICE_URL", "")

# --- taskplatform (see platform/src/taskplatform/conf.py for every key) ------------------------

TASKPLATFORM_LEASE_SECONDS = env_int("TASKPLATFORM_LEASE_SECONDS", 60)
TASKPLATFORM_RESCUE_INTERVAL_SECONDS = env_int("TASKPLATFORM_RESCUE_INTERVAL_SECONDS", 10)
TASKPLATFORM_LOCK_URL = os.environ.get("TASKPLATFORM_LOCK_URL", "db://")
TASKPLATFORM_RETENTION_DAYS = env_int("TASKPLATFORM_RETENTION_DAYS", 30)
TASKPLATFORM_METRICS_TOKEN = os.environ.get("TASKPLATFORM_METRICS_TOKEN", "")
TASKPLATFORM_METRICS_WINDOW_SECONDS = env_int("TASKPLATFORM_METRICS_WINDOW_SECONDS", 300)
# The beat's timing (seconds); LockedScheduler refuses to start on values that cannot work.
TASKPLATFORM_BEAT_LEASE_SECONDS = env_float("TASKPLATFORM_BEAT_LEASE_SECONDS", 6.0)
TASKPLATFORM_BEAT_TICK_SECONDS = env_float("TASKPLATFORM_BEAT_TICK_SECONDS", 1.0)
TASKPLATFORM_BEAT_STEP_DOWN_SECONDS = env_float("TASKPLATFORM_BEAT_STEP_DOWN_SECONDS", 2.0)
TASKPLATFORM_BEAT_SYNC_SECONDS = env_float("TASKPLATFORM_BEAT_SYNC_SECONDS", 5.0)
TASKPLATFORM_BEAT_MISFIRE_GRACE_SECONDS = env_float("TASKPLATFORM_BEAT_MISFIRE_GRACE_SECONDS", 60.0)
TASKPLATFORM_BEAT_CATCH_UP_WINDOW_SECONDS = env_float("TASKPLATFORM_BEAT_CATCH_UP_WINDOW_SECONDS", 3600.0)
