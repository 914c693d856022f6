"""The platform's settings: one typed object over the ``TASKPLATFORM_*`` Django settings.

Every key is documented once, here, with its unit and default; the README's configuration
table repeats it. Code reads ``platform_settings()``,
never ``getattr(settings, ...)`` ad hoc.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any, get_type_hints

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

PREFIX = "TASKPLATFORM_"


@dataclass(frozen=True)
class PlatformSettings:
    """Resolved platform settings. Field ``x`` is read from the Django setting ``TASKPLATFORM_X``."""

    #: Largest accepted size of a submission's JSON-encoded args + kwargs, in bytes.
    max_args_bytes: int = 64 * 1024
    #: Largest task result stored in the ledger, in bytes; larger results are not stored.
    max_result_bytes: int = 64 * 1024
    #: Longest accepted idempotency key, in characters (the column holds 255).
    max_key_length: int = 255
    #: Default lease a worker holds on a running execution, in seconds; renewed every third.
    lease_seconds: int = 60
    #: Delays up to this many seconds ride on the broker as a countdown; longer ones are
    #: parked in the ledger and published by the rescuer when due. Keep it well below the
    #: Redis transport's ``visibility_timeout`` (kombu#337).
    max_broker_countdown_seconds: int = 60
    #: A ``PENDING``/``RETRYING`` row not claimed this long after its publication is
    #: published again (then after twice as long, and so on).
    republish_after_seconds: int = 300
    #: Upper bound of the doubling republish interval, in seconds.
    republish_max_seconds: int = 3600
    #: How many rows the rescuer handles per pass and per category.
    rescue_batch_size: int = 500
    #: How often the holder of the maintenance duties runs the rescuer, in seconds; also how
    #: often a process that does not hold them asks for them.
    rescue_interval_seconds: int = 10
    #: Workers are candidates for the maintenance duties (the rescuer, pruning) with the beat
    #: leader: one process in the fleet holds their lease and runs them, whatever scheduler
    #: the project uses. False only when a ``LockedScheduler`` beat always runs.
    worker_maintenance: bool = True
    #: Lock backends by alias, like ``CACHES``: ``{"default": {"BACKEND": "...", "OPTIONS": {...}}}``.
    lock_backends: dict[str, Any] = field(default_factory=dict)
    #: The default lock backend as a URL (used when ``lock_backends`` has no ``default``):
    #: ``db://``, ``redis://h:6379/0``, ``redis-cluster://h:7000``, ``redlock://h1:p1,h2:p2,h3:p3``.
    lock_url: str = "db://"
    #: PostgreSQL (psycopg 3): the ledger's hot statements (claim, success, insert) are
    #: prepared once per connection. False behind a PgBouncer in transaction mode that does
    #: not track prepared statements (before 1.22, or ``max_prepared_statements = 0``);
    #: otherwise the first loss there fails a transaction, then the process stops preparing.
    prepared_statements: bool = True
    #: A finished non-atomic body's success is written while its pool process takes its next
    #: message (``worker/recorder.py``): on PostgreSQL by the next claim's own statement if it
    #: comes within 10 ms, otherwise by a thread of the pool process; one durable commit a task
    #: in a busy process. A pool process killed before that write lands leaves its attempt to
    #: the rescuer, which runs the body again. False: the pool process
    #: writes it before Celery acknowledges the message. Atomic bodies always commit their
    #: success with their writes.
    deferred_success: bool = True
    #: How often a worker process re-reads the fleet-wide limits (``Limit``), in seconds:
    #: an edit in the admin applies within this.
    limits_refresh_seconds: float = 5.0

    # --- the beat (taskplatform.beat.LockedScheduler) ---
    #: Lock backend alias the beat leader's lease is held on.
    beat_lock_alias: str = "default"
    #: Name of the beat leader's lease (one name per group of beats that share a schedule).
    beat_lock_name: str = "taskplatform.beat"
    #: The leader's lease, in seconds. A follower takes over within about this plus one tick
    #: of the leader's death.
    beat_lease_seconds: float = 6.0
    #: Longest sleep between two ticks, in seconds: the leader renews its lease every tick
    #: and followers try to acquire it every tick.
    beat_tick_seconds: float = 1.0
    #: A leader stops publishing when its lease has less than this many seconds left (it
    #: could not renew): the time one tick's publication may take.
    beat_step_down_seconds: float = 2.0
    #: How often the leader re-reads the schedule tables, in seconds (edits, bulk
    #: ``update()`` included, apply within this).
    beat_sync_seconds: float = 5.0
    #: A slot published less than this late is on time (a failover gap); older unpublished
    #: slots were missed and the job's misfire policy decides.
    beat_misfire_grace_seconds: float = 60.0
    #: Default look-back of the ``catch_up`` misfire policy, in seconds.
    beat_catch_up_window_seconds: float = 3600.0
    #: Most slots one publication transaction holds (larger backlogs take several).
    beat_batch_size: int = 500
    #: Terminal executions older than this many days are deleted by the holder of the
    #: maintenance lease (0: keep).
    retention_days: int = 30
    #: How often the holder of the maintenance lease (the beat leader or a worker) prunes the
    #: ledger, in seconds.
    prune_interval_seconds: int = 3600

    #: How often the maintenance holder counts executions per state and job for the console's
    #: landing page and ``/metrics`` (which show how old the counts are), in seconds.
    counts_interval_seconds: int = 10

    # --- the console (the Django admin) ---
    #: Put the console's overview (executions by state, dead letters, the beat) at the top of
    #: the admin's landing page, above what it shows already; False leaves that page alone
    #: (an admin site with an ``index_template`` of its own is never changed).
    admin_overview: bool = True

    # --- logs (taskplatform.observability.logs) ---
    #: The format of log lines where the platform sets it up (the worker's and the beat's
    #: handlers, ``logs.apply_to``): ``"plain"`` or ``"json"`` (one object per line). Left
    #: unset, it replaces only Celery's default format: a host's own formatter, or its
    #: ``CELERY_WORKER_LOG_FORMAT``, is kept (and still gets the execution fields to use).
    log_format: str = "plain"

    # --- tracing (taskplatform.observability.tracing; the ``tracing`` extra) ---
    #: OpenTelemetry tracing: ``"off"``; ``"console"`` (this process prints its spans, for
    #: development); ``"otlp"`` (spans to an OTLP/HTTP collector, configured by the standard
    #: ``OTEL_EXPORTER_OTLP_*`` variables); ``"provided"`` (the project sets up its own tracer
    #: provider; the platform only makes spans and carries the context).
    tracing: str = "off"

    # --- metrics (taskplatform.metrics) ---
    #: Bearer token Prometheus presents to ``/metrics`` (empty: staff sessions only).
    metrics_token: str = ""
    #: Event and lateness metrics count the last this many seconds.
    metrics_window_seconds: int = 300


_FIELD_NAMES = {f.name for f in fields(PlatformSettings)}
_TYPES: dict[str, type] = get_type_hints(PlatformSettings)
#: Numeric settings that must be above 0 (the others may be 0: ``max_broker_countdown_seconds
#: = 0`` parks every delay in the ledger, ``retention_days = 0`` keeps everything, ...).
_POSITIVE = frozenset(
    {
        "max_args_bytes", "max_result_bytes", "max_key_length", "lease_seconds", "republish_after_seconds",
        "republish_max_seconds", "rescue_batch_size", "rescue_interval_seconds", "beat_lease_seconds",
        "beat_tick_seconds", "beat_sync_seconds", "beat_batch_size", "prune_interval_seconds",
        "metrics_window_seconds", "counts_interval_seconds", "limits_refresh_seconds",
    }
)  # fmt: skip


#: Settings an earlier version had, with what became of them: the nearest valid name would
#: mislead (``RESCUE_QUEUE`` is not a misspelt ``RESCUE_BATCH_SIZE``).
REMOVED = {
    PREFIX + "RESCUE_QUEUE": "It was removed: it was never read. The rescuer runs in the process that holds "
    "the maintenance lease (a worker or the LockedScheduler leader), not as a task on a queue; delete it.",
}


def unknown_settings() -> list[tuple[str, str | None]]:
    """Django settings named ``TASKPLATFORM_*`` that are not platform settings, each with the
    nearest valid name (None when nothing is close): a misspelt setting is otherwise ignored.
    A removed setting is not given a nearest name (``REMOVED`` says what became of it)."""
    valid = [PREFIX + name.upper() for name in sorted(_FIELD_NAMES)]
    unknown = []
    for key in dir(settings):
        if key.startswith(PREFIX) and key not in valid:
            close = [] if key in REMOVED else difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            unknown.append((key, close[0] if close else None))
    return unknown


#: Settings whose value is one of a few strings.
_CHOICES = {"log_format": ("plain", "json"), "tracing": ("off", "console", "otlp", "provided")}


def _type_problem(name: str, value: Any) -> str | None:
    expected = _TYPES[name]
    key = PREFIX + name.upper()
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is int:  # 60.0 is 60 (read back as an int by ``platform_settings``)
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, getattr(expected, "__origin__", expected))
    if not ok:
        return f"{key} must be {_TYPE_NAMES.get(expected, 'a dict')}, not {value!r} ({type(value).__name__})"
    if name in _CHOICES and value not in _CHOICES[name]:
        return f"{key} must be one of {', '.join(map(repr, _CHOICES[name]))}, not {value!r}"
    if expected is float and not math.isfinite(value):
        return f"{key} must be a finite number, not {value!r}"
    if expected in (int, float) and (value < 0 or (value == 0 and name in _POSITIVE)):
        bound = "above 0" if name in _POSITIVE else "0 or more"
        return f"{key} must be {bound}, not {value!r}"
    if name in _MAXIMA and value > _MAXIMA[name][0]:
        return f"{key} must be at most {_MAXIMA[name][0]} ({_MAXIMA[name][1]}), not {value!r}"
    return None


#: Upper bounds, with why.
_MAXIMA = {"max_key_length": (255, "the idempotency key column holds 255 characters")}


_TYPE_NAMES = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def settings_problems() -> list[str]:
    """The ``TASKPLATFORM_*`` values of the wrong type or out of range (system check E002)."""
    problems = []
    for name in sorted(_FIELD_NAMES):
        key = PREFIX + name.upper()
        if hasattr(settings, key) and (problem := _type_problem(name, getattr(settings, key))) is not None:
            problems.append(problem)
    return problems


@cache
def platform_settings() -> PlatformSettings:
    """The resolved settings, cached until a ``TASKPLATFORM_*`` setting changes.

    A value of the wrong type or out of range raises ``ImproperlyConfigured`` naming it (the
    worker and the beat refuse to start; ``manage.py check`` reports every such value)."""
    if problems := settings_problems():
        raise ImproperlyConfigured("; ".join(problems))
    values: dict[str, Any] = {}
    for name in _FIELD_NAMES:
        key = PREFIX + name.upper()
        if hasattr(settings, key):
            value = getattr(settings, key)
            values[name] = int(value) if _TYPES[name] is int else value
    return PlatformSettings(**values)


@receiver(setting_changed)
def _reset(setting: str, **kwargs: Any) -> None:
    """``override_settings`` in tests must see fresh values."""
    if setting.startswith(PREFIX):
        platform_settings.cache_clear()


def reference_markdown() -> str:
    """``docs/reference/settings.md``: every setting, its type, default and meaning, from the
    ``#:`` comments above each field of ``PlatformSettings`` (the one place they are written)."""
    docs: dict[str, str] = {}
    sections: dict[str, str] = {}
    comment: list[str] = []
    section = "General"
    for line in inspect.getsource(PlatformSettings).splitlines():
        stripped = line.strip()
        if heading := re.match(r"# --- (.+?) ---", stripped):
            section = heading.group(1)[0].upper() + heading.group(1)[1:]
        elif stripped.startswith("#:"):
            comment.append(stripped[2:].strip())
        elif field_match := re.match(r"(\w+): [^=]+=", stripped):
            docs[field_match.group(1)] = " ".join(comment)
            sections[field_match.group(1)] = section
            comment = []
        else:
            comment = []
    out = [
        "# Settings reference",
        "",
        "Generated from `taskplatform.conf.PlatformSettings` (`.venv/bin/python -m taskplatform.conf > "
        "docs/reference/settings.md`); a test keeps this page equal to the code. Each is a Django setting "
        "named `TASKPLATFORM_<NAME>`. `manage.py check` warns of an unknown `TASKPLATFORM_*` name (W001, with "
        "the nearest valid one) and reports a value of the wrong type or out of range (E002); the worker and the "
        "beat refuse to start with the latter.",
    ]
    current = None
    for f in fields(PlatformSettings):
        if sections[f.name] != current:
            current = sections[f.name]
            out += ["", f"## {current}", "", "| setting | type | default | meaning |", "|---|---|---|---|"]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
        kind = _TYPE_NAMES.get(_TYPES[f.name], "a dict")
        meaning = docs[f.name].replace("``", "`").replace("|", "\\|")
        out.append(f"| `{PREFIX}{f.name.upper()}` | {kind} | `{default!r}` | {meaning} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover - the docs page's generator
    import sys

    sys.stdout.write(reference_markdown())
