"""In-process lock backend: for unit tests of pure logic only (one process, no network)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .base import Lease, LockBackend, LockInfo, new_owner


@dataclass
class _Entry:
    owner: str = ""
    token: int = 0
    expires: float = 0.0  # monotonic


class LocMemLockBackend(LockBackend):
    """Leases in a dict guarded by a mutex. Never use it across processes."""

    _lock = threading.Lock()

    def __init__(self, alias: str, options: dict[str, object]) -> None:
        super().__init__(alias, options)
        self._entries: dict[str, _Entry] = {}

    def acquire(self, name: str, ttl_seconds: float, identity: str | None = None) -> Lease | None:
        self._ttl_ms(ttl_seconds)
        start = time.monotonic()
        with self._lock:
            entry = self._entries.setdefault(name, _Entry())
            if entry.owner and entry.expires > start:
                return None
            entry.owner, entry.token, entry.expires = new_owner(identity), entry.token + 1, start + ttl_seconds
            return Lease(name, entry.owner, entry.token, ttl_seconds, start)

    def renew(self, lease: Lease, ttl_seconds: float | None = None) -> Lease | None:
        ttl = ttl_seconds or lease.ttl_seconds
        start = time.monotonic()
        with self._lock:
            entry = self._entries.get(lease.name)
            if entry is None or entry.owner != lease.owner or entry.token != lease.token or entry.expires <= start:
                return None
            entry.expires = start + ttl
            return lease.renewed(ttl, start)

    def release(self, lease: Lease) -> bool:
        with self._lock:
            entry = self._entries.get(lease.name)
            if entry is None or entry.owner != lease.owner or entry.token != lease.token:
                return False
            entry.owner, entry.expires = "", 0.0
            return True

    def force_release(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            held = bool(entry and entry.owner and entry.expires > time.monotonic())
            if entry:
                entry.owner, entry.expires = "", 0.0
            return held

    def inspect(self, name: str) -> LockInfo | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            remaining = entry.expires - time.monotonic()
            held = bool(entry.owner) and remaining > 0
            return LockInfo(name, entry.owner if held else None, entry.token, ttl_remaining_seconds=max(0.0, remaining))

    def locks(self) -> list[LockInfo]:
        return [info for name in list(self._entries) if (info := self.inspect(name)) is not None]
