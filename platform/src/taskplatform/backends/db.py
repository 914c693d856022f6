"""Lock backend on the Django database: one lease row per name, compare-and-set updates.

Works on PostgreSQL, MariaDB and SQLite. Expiry is judged with the database server's clock
(``UtcNow``), never the callers', so hosts with skewed clocks agree. The row is never
deleted: its ``fencing_token`` keeps growing across owners and releases.

The server's clock is read in UTC on every database: MariaDB/MySQL's ``NOW()`` (what
Django's ``Now()`` renders there) is the *session* time zone's wall time, which jumps at
daylight-saving changes and differs between sessions configured differently. A lease
written at a fall-back's summer time would look valid for an extra hour to a successor;
one written in winter time would look expired to a session an hour ahead, letting two
owners hold it. ``UTC_TIMESTAMP(6)`` has neither hole, and is what Django stores there
(naive UTC datetimes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.db import DatabaseError
from django.db.models import BooleanField, Case, DateTimeField, ExpressionWrapper, F, Q, Value, When

from ..exceptions import LockError
from ..models import LockLease, UtcNow
from .base import Lease, LockBackend, LockInfo, new_owner


def _now_plus(seconds: float) -> ExpressionWrapper:
    return ExpressionWrapper(UtcNow() + Value(timedelta(seconds=seconds)), output_field=DateTimeField())


@contextmanager
def _wrapped(action: str) -> Iterator[None]:
    try:
        yield
    except DatabaseError as exc:
        raise LockError(f"database lock backend: {action} failed: {exc}") from exc


class DatabaseLockBackend(LockBackend):
    """``OPTIONS``: ``using`` (database alias, default ``"default"``)."""

    def __init__(self, alias: str, options: dict[str, Any]) -> None:
        super().__init__(alias, options)
        self.using = str(options.get("using", "default"))

    def _rows(self) -> Any:
        return LockLease.objects.using(self.using)

    def acquire(self, name: str, ttl_seconds: float, identity: str | None = None) -> Lease | None:
        self._ttl_ms(ttl_seconds)
        owner = new_owner(identity)
        start = time.monotonic()

        def take() -> int:
            return int(
                self._rows()
                .filter(name=name)
                .filter(Q(owner="") | Q(expires_at__lte=UtcNow()))
                .update(
                    owner=owner,
                    fencing_token=F("fencing_token") + 1,
                    acquired_at=UtcNow(),
                    renewed_at=UtcNow(),
                    expires_at=_now_plus(ttl_seconds),
                )
            )

        with _wrapped("acquire"):
            taken = take()
            if not taken and not self._rows().filter(name=name).exists():
                self._rows().bulk_create([LockLease(name=name)], ignore_conflicts=True)
                taken = take()
            if not taken:
                return None
            token = self._rows().filter(name=name, owner=owner).values_list("fencing_token", flat=True).first()
        if token is None:  # lost again already (a TTL shorter than a round trip)
            return None
        return Lease(name, owner, int(token), ttl_seconds, start)

    def acquire_any(self, names: Sequence[str], ttl_seconds: float, identity: str | None = None) -> Lease | None:
        """One read picks the names that look free (a missing row is free), then each is
        taken by the usual compare-and-set until one succeeds: a full semaphore costs one
        query, not one ``UPDATE`` per slot."""
        with _wrapped("acquire"):
            held = set(
                self._rows()
                .filter(name__in=list(names), expires_at__gt=UtcNow())
                .exclude(owner="")
                .values_list("name", flat=True)
            )
        return super().acquire_any([n for n in names if n not in held], ttl_seconds, identity)

    def renew(self, lease: Lease, ttl_seconds: float | None = None) -> Lease | None:
        ttl = ttl_seconds or lease.ttl_seconds
        self._ttl_ms(ttl)
        start = time.monotonic()
        with _wrapped("renew"):
            rows = (
                self._rows()
                .filter(name=lease.name, owner=lease.owner, fencing_token=lease.token, expires_at__gt=UtcNow())
                .update(renewed_at=UtcNow(), expires_at=_now_plus(ttl))
            )
        return lease.renewed(ttl, start) if rows == 1 else None

    def release(self, lease: Lease) -> bool:
        with _wrapped("release"):
            rows = (
                self._rows()
                .filter(name=lease.name, owner=lease.owner, fencing_token=lease.token)
                .update(owner="", expires_at=UtcNow())
            )
        return rows == 1

    def force_release(self, name: str) -> bool:
        with _wrapped("force_release"):
            held = self._rows().filter(name=name, expires_at__gt=UtcNow()).exclude(owner="").exists()
            self._rows().filter(name=name).exclude(owner="").update(owner="", expires_at=UtcNow())
        return held

    def _infos(self, **filters: Any) -> list[LockInfo]:
        with _wrapped("inspect"):
            rows = (
                self._rows()
                .filter(**filters)
                .annotate(
                    live=Case(
                        When(expires_at__gt=UtcNow(), then=Value(True)),
                        default=Value(False),
                        output_field=BooleanField(),
                    )
                )
            )
            return [
                LockInfo(
                    name=row.name,
                    owner=row.owner if row.owner and row.live else None,
                    token=row.fencing_token,
                    expires_at=row.expires_at,
                    acquired_at=row.acquired_at,
                    renewed_at=row.renewed_at,
                )
                for row in rows
            ]

    def inspect(self, name: str) -> LockInfo | None:
        found = self._infos(name=name)
        return found[0] if found else None

    def locks(self) -> list[LockInfo]:
        return self._infos()

    def check(self) -> list[str]:
        from django.conf import settings

        if self.using not in settings.DATABASES:
            return [f"OPTIONS['using']={self.using!r} is not a configured database alias"]
        return []
