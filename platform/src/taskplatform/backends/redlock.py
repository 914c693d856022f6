"""Redlock: a lease granted by a majority of N independent Redis servers, with a fencing token.

Acquire takes the lock on each node with ``SET NX PX`` and reads that node's fencing counter
in the same script. With a majority, and validity left after the time it took
(``ttl - elapsed - drift``), the token is one more than the largest counter read; it is
then written (``max``) to the nodes that granted. Any two majorities share a node, so the
next holder reads a counter at least as large: tokens strictly increase — Redlock alone
has no token (Kleppmann 2016); this is what adds one.

Safety assumptions, as for any Redlock: bounded clock drift between nodes, and nodes that
do not forget. A node restarted without persistence forgets both its leases and its
counters; run nodes with ``appendonly yes`` and ``appendfsync always``, or keep a crashed
node down for longer than the largest TTL before it rejoins (antirez's "delayed restart").
"""

from __future__ import annotations

import time
from typing import Any

from ..exceptions import LockError
from .base import CLOCK_DRIFT_FACTOR, Lease, LockBackend, LockInfo, new_owner
from .redis import RELEASE, import_redis

ACQUIRE_READ = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return tonumber(redis.call('get', KEYS[2]) or '0')
end
return false
"""

RAISE_FENCE = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
local current = tonumber(redis.call('get', KEYS[2]) or '0')
if current < tonumber(ARGV[2]) then redis.call('set', KEYS[2], ARGV[2]) end
return 1
"""

RENEW_OWNER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""


class RedlockLockBackend(LockBackend):
    """``OPTIONS``: ``urls`` (list of ``redis://host:port/db``, an odd number, 3 or 5),
    ``prefix`` (``tp:lock:``), ``socket_timeout`` (seconds, default 0.2: a slow node must
    not eat the lease)."""

    def __init__(self, alias: str, options: dict[str, Any]) -> None:
        super().__init__(alias, options)
        self.redis = import_redis()
        self.urls = [str(u) for u in options.get("urls", [])]
        self.prefix = str(options.get("prefix", "tp:lock:"))
        timeout = float(options.get("socket_timeout", 0.2))
        self.nodes = [
            self.redis.Redis.from_url(u, socket_timeout=timeout, socket_connect_timeout=timeout) for u in self.urls
        ]
        self.quorum = len(self.nodes) // 2 + 1
        self._scripts = [
            {
                "acquire": n.register_script(ACQUIRE_READ),
                "fence": n.register_script(RAISE_FENCE),
                "renew": n.register_script(RENEW_OWNER),
                "release": n.register_script(RELEASE),
            }
            for n in self.nodes
        ]

    def key(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}"

    def fence_key(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}:fence"

    def _each(self, script: str, keys: list[str], args: list[Any], nodes: list[int] | None = None) -> dict[int, Any]:
        """Run a script on each node (or the given ones); unreachable nodes are left out."""
        replies: dict[int, Any] = {}
        for i in nodes if nodes is not None else range(len(self.nodes)):
            try:
                replies[i] = self._scripts[i][script](keys=keys, args=args)
            except self.redis.RedisError:
                continue
        return replies

    def _drift(self, ttl_seconds: float) -> float:
        return ttl_seconds * CLOCK_DRIFT_FACTOR + 0.002

    def acquire(self, name: str, ttl_seconds: float, identity: str | None = None) -> Lease | None:
        ttl_ms = self._ttl_ms(ttl_seconds)
        owner = new_owner(identity)
        keys = [self.key(name), self.fence_key(name)]
        start = time.monotonic()
        replies = self._each("acquire", keys, [owner, ttl_ms])
        granted = {i: int(c) for i, c in replies.items() if c is not None}
        validity = ttl_seconds - (time.monotonic() - start) - self._drift(ttl_seconds)
        if len(granted) >= self.quorum and validity > 0:
            token = max(granted.values()) + 1
            confirmed = self._each("fence", keys, [owner, token], nodes=list(granted))
            if sum(1 for v in confirmed.values() if v == 1) >= self.quorum:
                return Lease(name, owner, token, ttl_seconds, start)
        self._each("release", [self.key(name)], [owner])  # undo partial grants
        if not replies:
            raise LockError(f"redlock: no node reachable of {len(self.nodes)}")
        return None

    def renew(self, lease: Lease, ttl_seconds: float | None = None) -> Lease | None:
        ttl = ttl_seconds or lease.ttl_seconds
        start = time.monotonic()
        replies = self._each("renew", [self.key(lease.name)], [lease.owner, self._ttl_ms(ttl)])
        extended = sum(1 for v in replies.values() if v == 1)
        if extended >= self.quorum and time.monotonic() - start < ttl - self._drift(ttl):
            return lease.renewed(ttl, start)
        return None

    def release(self, lease: Lease) -> bool:
        replies = self._each("release", [self.key(lease.name)], [lease.owner])
        return any(v == 1 for v in replies.values())

    def force_release(self, name: str) -> bool:
        deleted = 0
        for node in self.nodes:
            try:
                deleted += int(node.delete(self.key(name)))
            except self.redis.RedisError:
                continue
        return deleted > 0

    def inspect(self, name: str) -> LockInfo | None:
        owners: dict[str, int] = {}
        token = 0
        remaining: list[float] = []
        reachable = 0
        for node in self.nodes:
            try:
                value, pttl, fence = node.get(self.key(name)), node.pttl(self.key(name)), node.get(self.fence_key(name))
            except self.redis.RedisError:
                continue
            reachable += 1
            token = max(token, int(fence or 0))
            if value is not None:
                owners[value.decode()] = owners.get(value.decode(), 0) + 1
                if pttl and pttl > 0:
                    remaining.append(pttl / 1000)
        if not reachable:
            raise LockError(f"redlock: no node reachable of {len(self.nodes)}")
        holder = next((o for o, n in owners.items() if n >= self.quorum), None)
        if holder is None and token == 0:
            return None
        return LockInfo(name, holder, token, ttl_remaining_seconds=min(remaining) if holder and remaining else None)

    def locks(self) -> list[LockInfo]:
        names: set[str] = set()
        for node in self.nodes:
            try:
                for raw in node.scan_iter(match=f"{self.prefix}{{*}}:fence", count=500):
                    names.add(raw.decode()[len(self.prefix) + 1 : -len("}:fence")])
            except self.redis.RedisError:
                continue
        return [info for name in sorted(names) if (info := self.inspect(name)) is not None]

    def check(self) -> list[str]:
        problems = []
        if len(self.urls) < 3:
            problems.append(f"Redlock needs at least 3 independent nodes, {len(self.urls)} configured")
        if len(self.urls) % 2 == 0:
            problems.append(f"Redlock needs an odd number of nodes, {len(self.urls)} configured")
        return problems

    def close(self) -> None:
        for node in self.nodes:
            node.close()
