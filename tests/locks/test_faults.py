"""Lock servers failing under a held lease: failover, node restart, server gone."""

from __future__ import annotations

import os
import signal
import time

import pytest

from taskplatform.exceptions import LockError
from tests.conftest import RedisServer
from tests.helpers import wait_for
from tests.locks.conftest import make_backend, redlock_backend

pytestmark = [pytest.mark.chaos, pytest.mark.fault]


@pytest.mark.scenario(25)
@pytest.mark.timeout(120)
@pytest.mark.slow  # in make chaos: CI time
def test_redis_cluster_master_failover_keeps_the_lease_and_tokens_increasing(
    request, redis_cluster, lock_name, figures
):
    backend = make_backend("redis_cluster", request)
    lease = backend.acquire(lock_name, 30, identity="leader")
    assert lease is not None
    token_before = lease.token
    master = backend.client.get_node_from_key(backend.key(lock_name))
    victim = redis_cluster.by_port(int(master.port))
    os.kill(victim.proc.pid, signal.SIGKILL)  # the master holding the lock's slot
    killed = time.monotonic()
    victim.proc.wait(timeout=10)
    try:
        # The replica is promoted after the node timeout (2 s); the grant was replicated (WAIT).
        def renewed():
            try:
                return backend.renew(lease, 30)
            except LockError:
                return None  # the client is still finding the new master

        lease = wait_for(renewed, timeout=30, interval=0.2, what="renewal through the promoted replica")
        failover_s = time.monotonic() - killed
        usurper = backend.acquire(lock_name, 30, identity="usurper")
        figures.record(failover_s=failover_s, holders_at_once=1 + (usurper is not None))
        assert usurper is None
        assert backend.release(lease)
        successor = backend.acquire(lock_name, 30, identity="next")
        assert successor is not None
        figures.record(token_before=token_before, token_after=successor.token)
        assert successor.token > lease.token
    finally:
        victim.start()  # rejoins as a replica of the promoted node
        wait_for(redis_cluster.healthy, timeout=30, interval=0.2, what="cluster healthy again")
        backend.close()


def test_a_redlock_node_restart_without_persistence_keeps_the_quorum_and_the_token_order(
    request, redlock_nodes, lock_name
):
    backend = make_backend("redlock", request)
    lease = backend.acquire(lock_name, 30, identity="leader")
    assert lease is not None
    node = redlock_nodes[0]
    node.stop()
    assert backend.acquire(lock_name, 30, identity="usurper") is None  # 0 of 2 reachable grant
    node.start()  # back, empty: it forgot the lease and the counter
    assert backend.acquire(lock_name, 30, identity="usurper") is None  # 1 of 3 is not a majority
    lease = backend.renew(lease, 30)
    assert lease is not None  # 2 of 3 still hold it
    assert backend.release(lease)
    successor = backend.acquire(lock_name, 30, identity="next")
    assert successor is not None and successor.token > lease.token
    backend.close()


def _crash_and_restart(node: RedisServer) -> None:
    """SIGKILL a node of this test's own and start it again at once: empty (no persistence)."""
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait(timeout=10)
    node.start()


@pytest.mark.scenario(26)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 5])
def test_a_redlock_node_restarted_empty_does_not_count_until_its_quarantine_is_over(
    redlock_servers, lock_name, figures, n
):
    """A holds a bare majority; one of its nodes crashes and restarts empty at once.

    Without a delayed restart the restarted node grants B the lock, and with the nodes A
    never had B has a majority while A still holds its lease: two holders. The restarted
    node must not count until a quarantine of the largest TTL is over.
    """
    ttl = 5.0
    nodes = redlock_servers(n)
    quorum = n // 2 + 1
    a_nodes, others = nodes[:quorum], nodes[quorum:]
    # A is partitioned from the others: it gets exactly the bare majority a_nodes. The
    # quarantine defaults to the largest TTL.
    a = redlock_backend(nodes, cut=tuple(others), max_ttl_seconds=ttl)
    b = redlock_backend(nodes, prefix=a.prefix, max_ttl_seconds=ttl)
    # A client partitioned from A's surviving nodes: only the restarted node and the others.
    c = redlock_backend(nodes, prefix=a.prefix, aged=False, cut=tuple(a_nodes[:-1]), max_ttl_seconds=ttl)
    try:
        lease_a = a.acquire(lock_name, ttl, identity="a")
        assert lease_a is not None
        token_before = lease_a.token
        restarted_node = a_nodes[-1]
        _crash_and_restart(restarted_node)  # it forgot A's lease and the counter
        restarted = time.monotonic()

        lease_b = b.acquire(lock_name, ttl, identity="b")  # the restarted node + the nodes A never had
        holders = 1 + (lease_b is not None and lease_a.remaining() > 0)
        figures.record(holders_at_once=holders, acquire_after_restart_refused=lease_b is None)
        assert lease_a.remaining() > 0, "too slow: A's lease ran out before B tried"
        assert lease_b is None, f"two holders: B was granted a majority while A holds {lease_a}"
        renewed = a.renew(lease_a)
        figures.record(old_holder_renewal_refused=renewed is None)
        assert renewed is None  # A's own nodes are no longer a majority: A learns it lost the lease

        # How long the restarted node stays out: to a client cut off from A's other nodes, a
        # lock nobody holds is granted only when the restarted node counts again.
        probe = wait_for(
            lambda: c.acquire(f"{lock_name}-probe", ttl, identity="probe"),
            timeout=60,
            interval=0.2,
            what="the restarted node to count again",
        )
        quarantine_s = time.monotonic() - restarted
        figures.record(quarantine_s=quarantine_s)
        assert probe is not None and quarantine_s >= ttl * 0.99

        # Once A's lease is over B gets the lock, with a larger token (A's nodes remember it).
        successor = wait_for(
            lambda: b.acquire(lock_name, ttl, identity="b"), timeout=60, interval=0.2, what="A's lease to expire"
        )
        figures.record(token_before=token_before, token_after=successor.token)
        assert successor.token > token_before
    finally:
        for client in (a, b, c):
            client.close()


def test_a_redlock_node_with_an_append_only_file_is_not_quarantined_after_a_restart(redlock_servers, lock_name):
    """It keeps its born key, its leases and its counters: it counts again at once."""
    nodes = redlock_servers(3, "--appendonly", "yes", "--appendfsync", "always")
    a = redlock_backend(nodes, cut=(nodes[2],))  # default quarantine: 60 s
    b = redlock_backend(nodes, prefix=a.prefix)
    c = redlock_backend(nodes, prefix=a.prefix, aged=False, cut=(nodes[1],))  # needs the restarted node
    try:
        lease = a.acquire(lock_name, 30, identity="a")  # nodes 1 and 2
        assert lease is not None
        _crash_and_restart(nodes[0])  # replays its append-only file
        assert b.acquire(lock_name, 30, identity="b") is None  # node 1 still knows A's lease
        lease = a.renew(lease, 30)
        assert lease is not None
        assert a.release(lease)
        successor = c.acquire(lock_name, 30, identity="c")  # nodes 1 and 3: node 1 counts at once
        assert successor is not None and successor.token > lease.token
    finally:
        for client in (a, b, c):
            client.close()


def test_on_fresh_redlock_nodes_nobody_gets_a_lock_until_the_quarantine_is_over(redlock_servers, lock_name, caplog):
    """A first deployment cannot be told from a full restart, where holders may still trust
    their leases: nobody is granted anything for the quarantine, and operators are told why."""
    nodes = redlock_servers(3)
    backend = redlock_backend(nodes, aged=False, max_ttl_seconds=2)
    try:
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="taskplatform.backends"):
            assert backend.acquire(lock_name, 2, identity="first") is None
            assert backend.acquire(lock_name, 2, identity="first") is None
        warnings = [r for r in caplog.records if "does not count toward a quorum" in r.getMessage()]
        assert len(warnings) == 3  # once per node, not per attempt
        lease = wait_for(lambda: backend.acquire(lock_name, 2, identity="first"), timeout=30, what="the quarantine")
        assert time.monotonic() - started >= 2 * 0.99 and lease.token == 1
    finally:
        backend.close()


def test_redlock_refuses_leases_longer_than_its_restart_quarantine_covers(request, lock_name):
    from taskplatform.backends.redlock import RedlockLockBackend

    backend = make_backend("redlock", request, max_ttl_seconds=10)
    try:
        with pytest.raises(ValueError, match="longer than this Redlock backend's max_ttl_seconds"):
            backend.acquire(lock_name, 10.5)
        lease = backend.acquire(lock_name, 10)
        assert lease is not None
        with pytest.raises(ValueError, match="max_ttl_seconds"):
            backend.renew(lease, 11)
    finally:
        backend.close()
    urls = ["redis://a:1/0", "redis://b:2/0", "redis://c:3/0"]
    short = RedlockLockBackend("test", {"urls": urls, "max_ttl_seconds": 60, "restart_quarantine_seconds": 30})
    assert any("restart_quarantine_seconds (30) is shorter than max_ttl_seconds (60)" in p for p in short.check())
    assert RedlockLockBackend("test", {"urls": urls}).check() == []


def test_a_lock_server_that_is_gone_raises_a_clear_lock_error(tmp_path):
    from taskplatform.backends.redis import RedisLockBackend
    from tests.conftest import free_port

    server = RedisServer(port=free_port(), workdir=tmp_path / "redis")
    server.start()
    backend = RedisLockBackend("test", {"url": server.url, "socket_timeout": 0.5})
    lease = backend.acquire("gone", 5)
    assert lease is not None
    server.stop()
    with pytest.raises(LockError, match="redis lock backend: renew failed"):
        backend.renew(lease)
    with pytest.raises(LockError, match="acquire failed"):
        backend.acquire("gone", 5)
    backend.close()
