"""The lock backend contract: leases with owner tokens and strictly increasing fencing tokens.

A lease is a lock with a time limit. Whoever holds it must renew it before it runs out, and
must stop acting as holder once it cannot (``Lease.remaining()`` measures that locally,
conservatively, from *before* the request that granted it). Every grant carries a fencing
token that is larger than any earlier grant's for the same name, across owners and
restarts, so the thing the lock protects can refuse a late writer (Kleppmann 2016).

Implementations by technology: ``locmem`` (tests only), ``db``, ``redis``,
``redis_cluster``, ``redlock``. Each runs the same contract test suite against a real
server (``tests/locks/``).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

#: Fraction of the TTL assumed lost to clock drift between client and server(s).
CLOCK_DRIFT_FACTOR = 0.01


@dataclass(frozen=True)
class Lease:
    """A granted lock: who holds it, its fencing token, and until when (locally) it is valid."""

    name: str
    owner: str
    token: int
    ttl_seconds: float
    #: ``time.monotonic()`` taken before the granting request was sent.
    granted_at: float

    @property
    def valid_until(self) -> float:
        """Local monotonic deadline, less an allowance for clock drift."""
        return self.granted_at + self.ttl_seconds * (1 - CLOCK_DRIFT_FACTOR)

    def remaining(self) -> float:
        """Seconds this lease can still be trusted, as seen from this process (≤ 0: expired)."""
        return self.valid_until - time.monotonic()

    def renewed(self, ttl_seconds: float, granted_at: float) -> Lease:
        return replace(self, ttl_seconds=ttl_seconds, granted_at=granted_at)


@dataclass(frozen=True)
class LockInfo:
    """What a backend knows about a lock, for inspection (admin, ``taskplatform status``)."""

    name: str
    owner: str | None  # None: free
    token: int  # the last fencing token granted for this name
    expires_at: datetime | None = None
    acquired_at: datetime | None = None
    renewed_at: datetime | None = None
    ttl_remaining_seconds: float | None = None


def new_owner(identity: str | None = None) -> str:
    """A unique owner token: ``<identity>#<random>`` (identity defaults to ``host:pid``)."""
    identity = identity or f"{socket.gethostname()}:{os.getpid()}"
    return f"{identity}#{uuid.uuid4().hex[:12]}"


class LockBackend(ABC):
    """A place to hold named leases. Configured like Django's ``CACHES``."""

    def __init__(self, alias: str, options: dict[str, Any]) -> None:
        self.alias = alias
        self.options = dict(options)

    @abstractmethod
    def acquire(self, name: str, ttl_seconds: float, identity: str | None = None) -> Lease | None:
        """Take the lock if it is free or expired; None if someone else holds it."""

    def acquire_any(self, names: Sequence[str], ttl_seconds: float, identity: str | None = None) -> Lease | None:
        """Take the first free lock among ``names``, tried in the order given; None if every
        one is held. ``names`` are the slots of a semaphore (``worker/limits.py``): each grant is
        an ordinary lease, renewed and released as such, and freed by its TTL if the holder
        dies. Backends that can test several names in one round trip override this."""
        for name in names:
            lease = self.acquire(name, ttl_seconds, identity)
            if lease is not None:
                return lease
        return None

    @abstractmethod
    def renew(self, lease: Lease, ttl_seconds: float | None = None) -> Lease | None:
        """Extend a lease still held by its owner; None if it was lost (expired or taken)."""

    @abstractmethod
    def release(self, lease: Lease) -> bool:
        """Free the lock if ``lease`` still holds it; False otherwise (nothing changes)."""

    @abstractmethod
    def force_release(self, name: str) -> bool:
        """Free the lock whoever holds it (an operator's action); True if it was held."""

    @abstractmethod
    def inspect(self, name: str) -> LockInfo | None:
        """The lock's holder and last token; None if the name was never locked."""

    def locks(self) -> list[LockInfo]:
        """Every lock the backend knows (for the console); may be empty if it cannot list."""
        return []

    def check(self) -> list[str]:
        """Configuration problems, as messages (run by a Django system check at start-up)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release client resources."""

    @staticmethod
    def _ttl_ms(ttl_seconds: float) -> int:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, not {ttl_seconds!r}")
        return max(1, int(ttl_seconds * 1000))
