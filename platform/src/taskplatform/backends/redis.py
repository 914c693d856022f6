"""Lock backend on one Redis server: ``SET NX PX`` plus Lua compare-and-set renew/release.

The lock key and its fencing counter share a hash tag (``tp:lock:{name}`` and
``tp:lock:{name}:fence``), so the same scripts run unchanged on Redis Cluster. The counter
never expires: tokens keep growing across owners. A lock on a single Redis server is only
as durable as that server: run it with persistence (AOF) if a restart must not forget a
lease (see ``docs/locks.md``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..exceptions import LockError, MissingDependencyError
from .base import Lease, LockBackend, LockInfo, new_owner

ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return false end
local token = redis.call('incr', KEYS[2])
redis.call('set', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return token
"""

RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""

RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

#: ``acquire`` over several names at once (KEYS: lock, fence, lock, fence, ...): the first
#: free one is taken; returns its index (1-based) and token, or false.
ACQUIRE_ANY = """
for i = 1, #KEYS, 2 do
  if redis.call('exists', KEYS[i]) == 0 then
    local token = redis.call('incr', KEYS[i + 1])
    redis.call('set', KEYS[i], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
    return {(i + 1) / 2, token}
  end
end
return false
"""

SCRIPTS = {"acquire": ACQUIRE, "acquire_any": ACQUIRE_ANY, "renew": RENEW, "release": RELEASE}


def import_redis() -> Any:
    """The redis-py module, or an error that names the extra to install."""
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - redis is a dependency of the reference deployment
        raise MissingDependencyError(
            "the Redis lock backends need redis-py: pip install 'taskplatform[redis]'"
        ) from exc
    return redis


@contextmanager
def wrapped(backend: str, action: str) -> Iterator[None]:
    """Translate client errors into ``LockError`` at the backend boundary."""
    redis = import_redis()
    try:
        yield
    except redis.RedisError as exc:
        raise LockError(f"{backend} lock backend: {action} failed: {exc}") from exc


class RedisLockBackend(LockBackend):
    """``OPTIONS``: ``url`` (default ``redis://127.0.0.1:6379/0``), ``prefix`` (``tp:lock:``),
    ``socket_timeout`` (seconds, default 2)."""

    label = "redis"

    def __init__(self, alias: str, options: dict[str, Any]) -> None:
        super().__init__(alias, options)
        self.redis = import_redis()
        self.url = str(options.get("url", "redis://127.0.0.1:6379/0"))
        self.prefix = str(options.get("prefix", "tp:lock:"))
        self.socket_timeout = float(options.get("socket_timeout", 2.0))
        self._connected: Any = None

    @property
    def client(self) -> Any:
        """The Redis client, made on first use (a cluster client connects when made)."""
        if self._connected is None:
            self._connected = self._client()
            self._scripts = {name: self._connected.register_script(src) for name, src in SCRIPTS.items()}
        return self._connected

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        self.client  # noqa: B018 - made here so that connection errors are translated too
        return self._scripts[script](keys=keys, args=args)

    def _client(self) -> Any:
        return self.redis.Redis.from_url(
            self.url, socket_timeout=self.socket_timeout, socket_connect_timeout=self.socket_timeout
        )

    def key(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}"

    def fence_key(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}:fence"

    def _replicated(self, name: str) -> None:
        """Hook: make a write durable beyond this node (Redis Cluster waits for a replica)."""

    def acquire(self, name: str, ttl_seconds: float, identity: str | None = None) -> Lease | None:
        ttl_ms = self._ttl_ms(ttl_seconds)
        owner = new_owner(identity).replace("|", "/")
        start = time.monotonic()
        with wrapped(self.label, "acquire"):
            token = self._run("acquire", [self.key(name), self.fence_key(name)], [owner, ttl_ms])
            if token is None:
                return None
            self._replicated(name)
        return Lease(name, owner, int(token), ttl_seconds, start)

    def acquire_any(self, names: Sequence[str], ttl_seconds: float, identity: str | None = None) -> Lease | None:
        """Every name tested in one script, so a full semaphore costs one round trip."""
        if not names:
            return None
        ttl_ms = self._ttl_ms(ttl_seconds)
        owner = new_owner(identity).replace("|", "/")
        start = time.monotonic()
        keys = [key for name in names for key in (self.key(name), self.fence_key(name))]
        with wrapped(self.label, "acquire"):
            taken = self._run("acquire_any", keys, [owner, ttl_ms])
            if not taken:
                return None
            name = names[int(taken[0]) - 1]
            self._replicated(name)
        return Lease(name, owner, int(taken[1]), ttl_seconds, start)

    def renew(self, lease: Lease, ttl_seconds: float | None = None) -> Lease | None:
        ttl = ttl_seconds or lease.ttl_seconds
        start = time.monotonic()
        with wrapped(self.label, "renew"):
            ok = self._run("renew", [self.key(lease.name)], [f"{lease.owner}|{lease.token}", self._ttl_ms(ttl)])
        return lease.renewed(ttl, start) if ok == 1 else None

    def release(self, lease: Lease) -> bool:
        with wrapped(self.label, "release"):
            return bool(self._run("release", [self.key(lease.name)], [f"{lease.owner}|{lease.token}"]))

    def force_release(self, name: str) -> bool:
        with wrapped(self.label, "force_release"):
            return bool(self.client.delete(self.key(name)))

    def inspect(self, name: str) -> LockInfo | None:
        with wrapped(self.label, "inspect"):
            value = self.client.get(self.key(name))
            pttl = self.client.pttl(self.key(name))
            fence = self.client.get(self.fence_key(name))
        if value is None and fence is None:
            return None
        owner = value.decode().rpartition("|")[0] if value is not None else None
        return LockInfo(
            name=name,
            owner=owner,
            token=int(fence or 0),
            ttl_remaining_seconds=pttl / 1000 if value is not None and pttl and pttl > 0 else None,
        )

    def locks(self) -> list[LockInfo]:
        names: set[str] = set()
        with wrapped(self.label, "list"):
            for raw in self.client.scan_iter(match=f"{self.prefix}{{*}}:fence", count=500):
                key = raw.decode()
                names.add(key[len(self.prefix) + 1 : -len("}:fence")])
        return [info for name in sorted(names) if (info := self.inspect(name)) is not None]

    def check(self) -> list[str]:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            return [f"OPTIONS['url']={self.url!r} is not a redis://, rediss:// or unix:// URL"]
        return []

    def close(self) -> None:
        if self._connected is not None:
            self._connected.close()
            self._connected = None
