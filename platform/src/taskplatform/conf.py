"""The platform's settings: one typed object over the ``TASKPLATFORM_*`` Django settings.

Every key is documented once, here, with its unit and default; the README's configuration
table repeats it. Code reads ``platform_settings()``,
never ``getattr(settings, ...)`` ad hoc.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any

from django.conf import settings
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
    #: How often the beat leader's maintenance thread runs the rescuer, in seconds.
    rescue_interval_seconds: int = 10
    #: Queue the rescuer task is published to when beat drives it (empty: Celery's default).
    rescue_queue: str = ""
    #: Lock backends by alias, like ``CACHES``: ``{"default": {"BACKEND": "...", "OPTIONS": {...}}}``.
    lock_backends: dict[str, Any] = field(default_factory=dict)
    #: The default lock backend as a URL (used when ``lock_backends`` has no ``default``):
    #: ``db://``, ``redis://h:6379/0``, ``redis-cluster://h:7000``, ``redlock://h1:p1,h2:p2,h3:p3``.
    lock_url: str = "db://"
    #: PostgreSQL (psycopg 3): the ledger's hot statements (claim, success, insert) are
    #: prepared once per connection. False behind a PgBouncer in transaction mode that does
    #: not track prepared statements (before 1.21, or ``max_prepared_statements = 0``).
    prepared_statements: bool = True

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
    #: Terminal executions older than this many days are deleted by the beat leader (0: keep).
    retention_days: int = 30
    #: How often the beat leader prunes the ledger, in seconds.
    prune_interval_seconds: int = 3600

    # --- metrics (taskplatform.metrics) ---
    #: Bearer token Prometheus presents to ``/metrics`` (empty: staff sessions only).
    metrics_token: str = ""
    #: Event and lateness metrics count the last this many seconds.
    metrics_window_seconds: int = 300


_FIELD_NAMES = {f.name for f in fields(PlatformSettings)}


@cache
def platform_settings() -> PlatformSettings:
    """The resolved settings, cached until a ``TASKPLATFORM_*`` setting changes."""
    values: dict[str, Any] = {}
    for name in _FIELD_NAMES:
        key = PREFIX + name.upper()
        if hasattr(settings, key):
            values[name] = getattr(settings, key)
    return PlatformSettings(**values)


@receiver(setting_changed)
def _reset(setting: str, **kwargs: Any) -> None:
    """``override_settings`` in tests must see fresh values."""
    if setting.startswith(PREFIX):
        platform_settings.cache_clear()
