"""Hostile review (review/h) of Redlock's restart quarantine (``backends/redlock.py``)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from tests.helpers import wait_for
from tests.locks.conftest import redlock_backend

pytestmark = [pytest.mark.chaos, pytest.mark.fault]


@pytest.mark.scenario(26)
@pytest.mark.timeout(120)
def test_a_redlock_node_restored_from_an_older_snapshot_can_grant_a_second_holder(redlock_servers, lock_name, figures):
    """The documented limit of the restart quarantine (``docs/locks.md``; found in review): the
    born key only notices a node that lost *all* its data. A node that restarts from an RDB
    snapshot (Redis's default persistence), an ``appendfsync everysec`` AOF or a lagging
    replica keeps its born key but forgets the leases granted since: it is not quarantined,
    and with the node A never had it makes a majority for B while A holds its lease. Hence
    Redlock nodes must run ``appendonly yes`` + ``appendfsync always``; the beat's database
    fence still refuses the second holder's rival publications (scenario 24)."""
    ttl = 5.0
    nodes = redlock_servers(3)
    a_nodes, other = nodes[:2], nodes[2]
    a = redlock_backend(nodes, cut=(other,), max_ttl_seconds=ttl)
    b = redlock_backend(nodes, prefix=a.prefix, max_ttl_seconds=ttl)  # ages every node's born key
    victim = a_nodes[-1]
    snap = redis.Redis(port=victim.port)
    snap.save()  # the node's last snapshot: born key in it, no lease yet
    snap.close()
    try:
        lease_a = a.acquire(lock_name, ttl, identity="a")
        assert lease_a is not None
        assert victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=10)
        victim.start()  # loads dump.rdb: the born key is back, A's lease is not
        restored = redis.Redis(port=victim.port)
        assert restored.exists(a.born_key()) and not restored.exists(a.key(lock_name))
        restored.close()

        lease_b = b.acquire(lock_name, ttl, identity="b")
        holders = 1 + (lease_b is not None and lease_a.remaining() > 0)
        figures.record(snapshot_restore_holders_at_once=holders)
        assert lease_a.remaining() > 0, "too slow: A's lease ran out before B tried"
        assert holders == 2, "the limit no longer holds: update docs/locks.md (and this test)"
    finally:
        for client in (a, b):
            client.close()


@pytest.mark.timeout(60)
def test_a_redlock_nodes_quarantine_is_bounded_after_its_clock_is_set_back(redlock_servers, lock_name):
    """G4 (failover). The quarantine runs on the node's wall clock from its born key: a node
    whose clock was ahead when it first served this prefix (a wrong clock, later corrected by
    NTP) has a born time in its future and stays out for as long as the error was, a day here,
    with nothing but a log line once. Two such nodes of three: no leader for that long."""
    nodes = redlock_servers(3)
    backend = redlock_backend(nodes, max_ttl_seconds=2)  # quarantine 2 s
    for node in backend.nodes[:2]:
        seconds, micros = node.time()
        node.set(backend.born_key(), seconds * 1000 + micros // 1000 + 86_400_000)  # born "tomorrow"
    try:
        started = time.monotonic()
        lease = wait_for(
            lambda: backend.acquire(lock_name, 2, identity="leader"),
            timeout=backend.restart_quarantine_seconds + 10,
            interval=0.5,
            what="a lease once the longest quarantine (2 s) is over",
        )
        assert lease is not None and time.monotonic() - started < backend.restart_quarantine_seconds + 10
    finally:
        backend.close()


@pytest.mark.timeout(60)
def test_a_beat_lease_longer_than_redlocks_max_ttl_is_refused_by_the_system_checks(redlock_servers, settings):
    """G4 (a leader within lease + tick). Redlock now raises ``ValueError`` for any lease longer
    than ``max_ttl_seconds`` (60 s by default). ``Leadership.step`` takes that for an unreachable
    lock server and stays a follower: with ``TASKPLATFORM_BEAT_LEASE_SECONDS=90`` (accepted
    before this change) no beat ever leads and every slot is lost, while ``manage.py check``
    says nothing about it."""
    from django.core.checks import ERROR

    from taskplatform.checks import check_beat, check_lock_backends
    from taskplatform.conf import platform_settings
    from taskplatform.scheduling.leadership import Leadership

    nodes = redlock_servers(3)
    settings.TASKPLATFORM_LOCK_BACKENDS = {
        "default": {
            "BACKEND": "taskplatform.backends.redlock.RedlockLockBackend",
            "OPTIONS": {"urls": [n.url for n in nodes], "prefix": "tp:review-h:"},
        }
    }
    settings.TASKPLATFORM_BEAT_LEASE_SECONDS = 90
    settings.TASKPLATFORM_BEAT_TICK_SECONDS = 5
    settings.TASKPLATFORM_BEAT_MISFIRE_GRACE_SECONDS = 120
    backend = redlock_backend(nodes, prefix="tp:review-h:")  # nodes aged: no quarantine in the way
    try:
        leadership = Leadership(backend, "beat", "beat-1", platform_settings())
        leading = [leadership.step()[0] for _ in range(3)]
        errors = [m for m in check_lock_backends() + check_beat() if m.level >= ERROR]
        assert any(leading) or errors, (
            "the beat never leads (every acquire raises ValueError: lease longer than max_ttl_seconds) "
            "and no system check reports it"
        )
    finally:
        backend.close()
