"""Django system checks: a bad configuration is refused at start-up, not found at 3 a.m."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.core.exceptions import ImproperlyConfigured

from .backends import backend_config, build_backend
from .conf import REMOVED, platform_settings, settings_problems, unknown_settings
from .exceptions import TaskPlatformError
from .scheduling.config import configuration_problems

#: Every check this module reports, by id, with what it means (``docs/reference/checks.md`` is
#: written from this; a test finds any id used below and missing here).
CHECKS: dict[str, str] = {
    "taskplatform.W001": "a `TASKPLATFORM_*` setting that does not exist (a misspelling is otherwise ignored), "
    "with the nearest valid name",
    "taskplatform.E002": "a `TASKPLATFORM_*` value of the wrong type, out of range or not one of its choices",
    "taskplatform.E003": "`TASKPLATFORM_LEASE_SECONDS` under 3 s: too short to renew reliably",
    "taskplatform.E010": "Celery would accept pickled messages (`CELERY_ACCEPT_CONTENT`): JSON only",
    "taskplatform.E011": "a Celery serializer (task or result) is pickle",
    "taskplatform.W012": "`CELERY_TASK_ACKS_LATE` is off: tasks other than `IdempotentTask` lose work when a "
    "worker dies",
    "taskplatform.E013": "`TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS` not below half the Redis "
    "`visibility_timeout` (kombu#337)",
    "taskplatform.W014": "`TASKPLATFORM_LEASE_SECONDS` above half the Redis `visibility_timeout`",
    "taskplatform.W015": "`CELERY_DB_REUSE_MAX` unset: a new database connection per task",
    "taskplatform.W016": "the ledger on SQLite (one writer at a time): development only",
    "taskplatform.W017": "nothing runs the rescuer: worker maintenance off and no `LockedScheduler`",
    "taskplatform.E020": "a lock backend does not import or cannot be built",
    "taskplatform.E021": "a lock backend refuses its options",
    "taskplatform.E030": "the beat's lease, tick, step-down and sync timings do not fit together",
    "taskplatform.W031": "beat failover (lease + tick) above the 10 s target",
    "taskplatform.E032": "the beat lease is longer than the beat lock backend's `max_ttl_seconds`: no beat "
    "would lead",
    "taskplatform.E050": "`TASKPLATFORM_TRACING` is on but the tracing extra (OpenTelemetry's SDK and Celery "
    "instrumentation) is not installed",
    "taskplatform.E040": "(`check --deploy`) a broker, result backend or lock server on another host without "
    "credentials",
}  # fmt: skip


def _celery_conf() -> Any:
    from celery import current_app

    return current_app.conf


@register("taskplatform")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``TASKPLATFORM_*`` settings: unknown names (a misspelling is otherwise ignored), values of
    the wrong type or out of range, and values that make the guarantees impossible."""
    errors: list[CheckMessage] = []
    for name, nearest in unknown_settings():  # a warning: a host may name settings of its own so
        errors.append(
            Warning(
                f"{name} is not a taskplatform setting (it is ignored)",
                hint=REMOVED.get(name)
                or (f"Did you mean {nearest}?" if nearest else "See docs/reference/settings.md for the settings."),
                id="taskplatform.W001",
            )
        )
    problems = settings_problems()
    errors += [Error(problem, hint=_SETTINGS_DOC, id="taskplatform.E002") for problem in problems]
    if problems:
        return errors  # the other checks read these values: they wait for a valid configuration
    conf = platform_settings()
    if conf.lease_seconds < 3:
        errors.append(
            Error(
                f"TASKPLATFORM_LEASE_SECONDS={conf.lease_seconds} is too short to renew reliably",
                hint="Use 3 seconds or more (renewal happens every third of the lease).",
                id="taskplatform.E003",
            )
        )
    return errors


_SETTINGS_DOC = "See docs/reference/settings.md for each setting's type and range."


def _valid_settings() -> bool:
    """Whether the other checks may read the platform's settings (``check_settings`` reports
    them otherwise, instead of a traceback from a check doing arithmetic on a string)."""
    try:
        platform_settings()
    except ImproperlyConfigured:
        return False
    return True


@register("taskplatform")
def check_celery(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Celery options the platform depends on: JSON only, late acks, bounded countdowns."""
    if not _valid_settings():
        return []
    errors: list[CheckMessage] = []
    conf = _celery_conf()
    accept = set(conf.accept_content or [])
    if "pickle" in accept or "application/x-python-serialize" in accept:
        errors.append(
            Error(
                "Celery would accept pickled messages (CELERY_ACCEPT_CONTENT)",
                hint="A pickled broker message can run code: accept JSON only, CELERY_ACCEPT_CONTENT = ['json'].",
                id="taskplatform.E010",
            )
        )
    for name in ("task_serializer", "result_serializer"):
        if conf.get(name) == "pickle":
            errors.append(Error(f"Celery {name} is pickle; use json", id="taskplatform.E011"))
    if not conf.task_acks_late:
        errors.append(
            Warning(
                "CELERY_TASK_ACKS_LATE is off",
                hint="IdempotentTask sets acks_late itself; other tasks lose work when a worker dies. If that "
                "is intended, add 'taskplatform.W012' to SILENCED_SYSTEM_CHECKS.",
                id="taskplatform.W012",
            )
        )
    transport = str(conf.broker_url or "").split(":", 1)[0]
    if transport.startswith("redis") or transport.startswith("rediss"):
        options = conf.broker_transport_options or {}
        visibility = float(options.get("visibility_timeout", 3600))
        bound = platform_settings().max_broker_countdown_seconds
        if bound * 2 > visibility:
            errors.append(
                Error(
                    f"TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS={bound} is not below half the Redis "
                    f"visibility_timeout ({visibility:g} s)",
                    hint="Countdowns longer than the visibility timeout are re-delivered (kombu#337): "
                    "lower the countdown bound or raise broker_transport_options['visibility_timeout'].",
                    id="taskplatform.E013",
                )
            )
        lease = platform_settings().lease_seconds
        if lease * 2 > visibility:
            errors.append(
                Warning(
                    f"TASKPLATFORM_LEASE_SECONDS={lease} is above half the Redis visibility_timeout",
                    hint="Crashed work is rescued after the lease; keep it well below the visibility timeout.",
                    id="taskplatform.W014",
                )
            )
    if not getattr(settings, "CELERY_DB_REUSE_MAX", None) and not conf.get("db_reuse_max"):
        errors.append(
            Warning(
                "CELERY_DB_REUSE_MAX is not set",
                hint="Celery's Django fix-up then closes the database connection around every task "
                "(a new connection per task). Add CELERY_DB_REUSE_MAX = 1000 to your settings (or, if "
                "intended, 'taskplatform.W015' to SILENCED_SYSTEM_CHECKS).",
                id="taskplatform.W015",
            )
        )
    return errors


@register("taskplatform")
def check_lock_backends(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every configured lock backend imports, builds and accepts its options."""
    if not _valid_settings():
        return []
    # The beat's alias too: it also holds the maintenance lease (the rescuer), in workers as well.
    aliases = set(platform_settings().lock_backends or {}) | {"default", platform_settings().beat_lock_alias}
    errors: list[CheckMessage] = []
    for alias in sorted(aliases):
        try:
            backend = build_backend(alias, backend_config(alias))
        except TaskPlatformError as exc:
            errors.append(Error(str(exc), id="taskplatform.E020"))
            continue
        except Exception as exc:
            errors.append(Error(f"lock backend {alias!r} could not be built: {exc}", id="taskplatform.E020"))
            continue
        for problem in backend.check():
            errors.append(Error(f"lock backend {alias!r}: {problem}", id="taskplatform.E021"))
        backend.close()
    return errors


@register("taskplatform")
def check_beat(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The beat's lease, tick, step-down and sync timings fit together (LockedScheduler refuses them too)."""
    if not _valid_settings():
        return []
    errors: list[CheckMessage] = [Error(p, id="taskplatform.E030") for p in configuration_problems(platform_settings())]
    conf = platform_settings()
    try:
        backend = build_backend(conf.beat_lock_alias, backend_config(conf.beat_lock_alias))
    except Exception:  # reported by check_lock_backends
        backend = None
    longest = getattr(backend, "max_ttl_seconds", None)
    if longest is not None and conf.beat_lease_seconds > longest:
        errors.append(
            Error(
                f"TASKPLATFORM_BEAT_LEASE_SECONDS={conf.beat_lease_seconds:g} is longer than the beat lock "
                f"backend's max_ttl_seconds ({longest:g}): it refuses such a lease, and no beat would lead",
                hint="Lower the beat lease, or raise the backend's max_ttl_seconds (and its restart quarantine).",
                id="taskplatform.E032",
            )
        )
    if backend is not None:
        backend.close()
    failover = conf.beat_lease_seconds + conf.beat_tick_seconds
    if not errors and failover > 10:
        errors.append(
            Warning(
                f"beat failover can take up to {failover:g} s (lease + tick), above the 10 s target",
                hint="Lower TASKPLATFORM_BEAT_LEASE_SECONDS (keep it at least 3 ticks).",
                id="taskplatform.W031",
            )
        )
    return errors


@register("taskplatform")
def check_maintenance(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Something can run the maintenance duties (the rescuer, pruning): without them a lost
    message is never republished, a parked retry never published, an expired lease never
    rescued (guarantees G1, G5 and G6)."""
    if not _valid_settings():
        return []
    if platform_settings().worker_maintenance:
        return []
    scheduler = str(getattr(settings, "CELERY_BEAT_SCHEDULER", "") or _celery_conf().beat_scheduler or "")
    if scheduler.replace(":", ".").endswith("LockedScheduler"):
        return []
    return [
        Warning(
            "nothing runs the rescuer: TASKPLATFORM_WORKER_MAINTENANCE is False and the beat "
            f"scheduler is not taskplatform's LockedScheduler ({scheduler or 'Celery default'})",
            hint="Lost messages would never be republished and parked retries never published. Leave "
            "TASKPLATFORM_WORKER_MAINTENANCE on, or run celery beat with taskplatform.beat.LockedScheduler, "
            "or run 'manage.py taskplatform rescue' every few seconds yourself and silence taskplatform.W017.",
            id="taskplatform.W017",
        )
    ]


@register("taskplatform", "database")
def check_database(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The ledger on SQLite holds one writer at a time: fine for development, not for G2."""
    from django.db import connections

    if connections["default"].vendor != "sqlite":
        return []
    return [
        Warning(
            "the ledger is on SQLite, which lets one connection write at a time",
            hint="An atomic body holds the write lock until it commits, so other attempts' lease renewals "
            "wait behind it; one longer than another running attempt's lease can get that attempt rescued "
            "while it still runs (a second body). Use PostgreSQL or MariaDB in production (DATABASE_URL); "
            "the embedded profile is for development.",
            id="taskplatform.W016",
        )
    ]


#: Hosts a service may listen on without credentials: only this machine reaches them.
LOOPBACK = {"localhost", "127.0.0.1", "::1", ""}


def _exposed(url: str) -> str:
    """Why ``url`` (a broker, result backend or lock server) is open to anyone who can reach it, or ''."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:
        return ""
    if host in LOOPBACK or host.startswith("127.") or parts.scheme.startswith(("memory", "db", "sqla", "file")):
        return ""
    if parts.scheme in {"redis", "rediss", "redis+socket"} and not parts.password:
        return f"{parts.scheme}://{host}:{parts.port or 6379} is used without a password"
    if parts.scheme in {"amqp", "amqps", "pyamqp"} and (parts.username or "guest") == "guest":
        return f"{parts.scheme}://{host} is used as RabbitMQ's default user guest"
    return ""


@register("taskplatform", deploy=True)
def check_exposed_services(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``manage.py check --deploy``: no broker, result backend or lock server on another host
    without credentials (a Redis anyone on the network can write to runs anyone's tasks)."""
    if not _valid_settings():
        return []
    conf = _celery_conf()
    urls = {"the broker (CELERY_BROKER_URL)": str(conf.broker_url or "")}
    if conf.result_backend:
        urls["the result backend"] = str(conf.result_backend)
    for alias in sorted(set(platform_settings().lock_backends or {}) | {"default"}):
        try:
            options = backend_config(alias).get("OPTIONS", {})
        except TaskPlatformError:
            continue  # reported by check_lock_backends
        for n, url in enumerate([options.get("url", ""), *options.get("urls", [])]):
            if url:
                urls[f"lock backend {alias!r} ({n})"] = str(url)
    errors: list[CheckMessage] = []
    for what, url in urls.items():
        problem = _exposed(url)
        if problem:
            errors.append(
                Error(
                    f"{what}: {problem}",
                    hint="Give the service a password (Redis requirepass or an ACL user; a RabbitMQ user "
                    "other than guest) and put it in the URL, or keep it on the loopback interface.",
                    id="taskplatform.E040",
                )
            )
    return errors


@register("taskplatform")
def check_tracing(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Tracing asked for, and the packages it needs installed."""
    import importlib.util

    if not _valid_settings() or platform_settings().tracing == "off":
        return []
    needed = ["opentelemetry.sdk", "opentelemetry.instrumentation.celery"]
    if platform_settings().tracing == "otlp":
        needed.append("opentelemetry.exporter.otlp.proto.http")
    missing = [name for name in needed if _find_spec(importlib.util, name) is None]
    if not missing:
        return []
    return [
        Error(
            f"TASKPLATFORM_TRACING = {platform_settings().tracing!r} needs {', '.join(missing)}",
            hint="pip install 'taskplatform[tracing]', or set TASKPLATFORM_TRACING = 'off'.",
            id="taskplatform.E050",
        )
    ]


def _find_spec(util: Any, name: str) -> Any:
    try:
        return util.find_spec(name)
    except ModuleNotFoundError:  # a parent package is missing
        return None
