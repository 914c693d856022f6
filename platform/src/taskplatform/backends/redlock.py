"""Redlock: a lease granted by a majority of N independent Redis servers, with a fencing token.

Acquire takes the lock on each node with ``SET NX PX`` and reads that node's fencing counter
in the same script. With a majority, and validity left after the time it took
(``ttl - elapsed - drift``), the token is one more than the largest counter read; it is
then written (``max``) to the nodes that granted. Any two majorities share a node, so the
next holder reads a counter at least as large: tokens strictly increase — Redlock alone
has no token (Kleppmann 2016); this is what adds one.

Safety assumptions, as for any Redlock: bounded clock drift between nodes, and nodes that
do not forget. A node restarted without persistence forgets its leases: if the holder had
a bare majority that included it, the restarted node and the nodes the holder never had
make a majority for someone else — two holders (scenario 26 of the fault catalogue).
antirez's answer is the "delayed restart": keep a crashed node out for longer than the
largest TTL. This backend enforces it instead of trusting operations to:

* Each node keeps a **born key** (``<prefix>born``, no expiry): the node's own time
  (``TIME``, in ms) of the first acquire it served for this prefix. The acquire script
  writes it with ``SET NX``, so a node that lost its data (restart without persistence,
  ``FLUSHALL``/``FLUSHDB``, eviction) gets a new one at the first acquire after the loss.
* Until ``restart_quarantine_seconds`` have passed since its born time, by its own clock,
  a node takes no lock and its reply does not count toward the quorum. Every lease it
  granted before it forgot was granted before that born time, with a TTL of at most
  ``max_ttl_seconds`` (acquire and renew refuse longer TTLs), so by the end of a
  quarantine at least that long all of them have expired, wherever their holders are.
* The check is inside the acquire script, on the node's clock: no extra round trip, and
  no client clock involved. Renew, release and the fence write need no check: they act only
  on a key the node holds, and a node that forgot holds none until it grants again, which it
  does only after its quarantine.
* A node that persists its data (``appendonly yes``, ``appendfsync always``) keeps its born
  key across restarts and is not quarantined again. A node that came back without data is
  quarantined even if the operator kept it down long enough: it cannot know that.
* The quarantine runs on the node's wall clock, like its TTLs: a step back lengthens it
  (safe), a step forward shortens it — the bounded-clock assumption above.

The cost: on a first deployment (or after every node lost its data) every node is fresh,
and nobody can acquire a lock for the quarantine (60 s by default; a beat leader is then
elected that much later). That is the price of safety: a full restart leaves holders that
still trust their leases, and a new deployment cannot be told apart from one. A deployment
that only holds the beat lease (``beat_lease_seconds``, 6 s) can set ``max_ttl_seconds`` to
6 and wait 6 s. Detecting restarts by ``INFO``'s ``run_id`` instead would cost a round trip
per node and acquire, miss a flush, and quarantine persistent nodes after every restart.

What the quarantine does not restore is the fencing counter a node forgot: tokens stay
strictly increasing while, for each earlier grant, a node that remembers its token is among
the next grant's majority. After a restart, a grant made while every node that remembers
the last token is unreachable can repeat that token (the beat's fence follows the lock when
the lease is demonstrably live, ``scheduling.leadership.take_over_fence``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..exceptions import LockError
from .base import CLOCK_DRIFT_FACTOR, Lease, LockBackend, LockInfo, new_owner
from .redis import RELEASE, import_redis

log = logging.getLogger("taskplatform.backends")

#: KEYS: lock, fence, born. ARGV: owner, ttl ms, quarantine ms. Replies: the node's fencing
#: counter (granted), nil (held by someone else), or {'quarantined', ms left}.
ACQUIRE_READ = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('set', KEYS[3], string.format('%.0f', now), 'NX')
local born = tonumber(redis.call('get', KEYS[3]))
if born > now then
  -- born in the node's future: its clock was set back since. Restart the quarantine from now,
  -- so it stays as long as a quarantine and no longer.
  redis.call('set', KEYS[3], string.format('%.0f', now))
  born = now
end
local left = born + tonumber(ARGV[3]) - now
if left > 0 then return {'quarantined', left} end
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
    not eat the lease), ``max_ttl_seconds`` (60: the longest lease acquire or renew grants),
    ``restart_quarantine_seconds`` (default ``max_ttl_seconds``, never less: how long a node
    that lost its data does not count)."""

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
        self.max_ttl_seconds = float(options.get("max_ttl_seconds", 60.0))
        self.restart_quarantine_seconds = float(options.get("restart_quarantine_seconds", self.max_ttl_seconds))
        self._quarantined: set[int] = set()  # nodes last seen in quarantine (logged once)
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

    def born_key(self) -> str:
        """When each node first served this prefix (its own clock, ms); see the module doc."""
        return f"{self.prefix}born"

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

    def _checked_ttl_ms(self, ttl_seconds: float) -> int:
        if ttl_seconds > self.max_ttl_seconds:
            raise ValueError(
                f"ttl_seconds {ttl_seconds!r} is longer than this Redlock backend's max_ttl_seconds "
                f"({self.max_ttl_seconds:g}): a node restarted without its data would count again "
                "before such a lease expires; raise max_ttl_seconds (the restart quarantine grows with it)"
            )
        return self._ttl_ms(ttl_seconds)

    def _note_quarantine(self, replies: dict[int, Any]) -> None:
        """Log once per stay when a node does not count because it lost its data (or is new)."""
        for i, reply in replies.items():
            if isinstance(reply, list):
                if i not in self._quarantined:
                    self._quarantined.add(i)
                    log.warning(
                        "redlock node %s is new or restarted without its data: it does not count toward "
                        "a quorum for another %.1f s (restart_quarantine_seconds=%g)",
                        self.urls[i],
                        int(reply[1]) / 1000,
                        self.restart_quarantine_seconds,
                    )
            else:
                self._quarantined.discard(i)

    def acquire(self, name: str, ttl_seconds: float, identity: str | None = None) -> Lease | None:
        ttl_ms = self._checked_ttl_ms(ttl_seconds)
        owner = new_owner(identity)
        keys = [self.key(name), self.fence_key(name), self.born_key()]
        quarantine_ms = int(self.restart_quarantine_seconds * 1000)
        start = time.monotonic()
        replies = self._each("acquire", keys, [owner, ttl_ms, quarantine_ms])
        # Quarantined nodes (a list reply) took no lock and do not count.
        granted = {i: int(c) for i, c in replies.items() if c is not None and not isinstance(c, list)}
        self._note_quarantine(replies)
        validity = ttl_seconds - (time.monotonic() - start) - self._drift(ttl_seconds)
        if len(granted) >= self.quorum and validity > 0:
            token = max(granted.values()) + 1
            confirmed = self._each("fence", keys[:2], [owner, token], nodes=list(granted))
            if sum(1 for v in confirmed.values() if v == 1) >= self.quorum:
                return Lease(name, owner, token, ttl_seconds, start)
        self._each("release", [self.key(name)], [owner])  # undo partial grants
        if not replies:
            raise LockError(f"redlock: no node reachable of {len(self.nodes)}")
        return None

    def renew(self, lease: Lease, ttl_seconds: float | None = None) -> Lease | None:
        ttl = ttl_seconds or lease.ttl_seconds
        ttl_ms = self._checked_ttl_ms(ttl)
        start = time.monotonic()
        replies = self._each("renew", [self.key(lease.name)], [lease.owner, ttl_ms])
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
        if self.restart_quarantine_seconds < self.max_ttl_seconds:
            problems.append(
                f"Redlock's restart_quarantine_seconds ({self.restart_quarantine_seconds:g}) is shorter than "
                f"max_ttl_seconds ({self.max_ttl_seconds:g}): a node restarted without its data would count "
                "again while a lease it forgot is still held"
            )
        return problems

    def close(self) -> None:
        for node in self.nodes:
            node.close()
