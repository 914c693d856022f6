"""Lock servers failing under a held lease: failover, node restart, server gone."""

from __future__ import annotations

import os
import signal
import time

import pytest

from taskplatform.exceptions import LockError
from tests.conftest import RedisServer
from tests.helpers import wait_for
from tests.locks.conftest import make_backend

pytestmark = [pytest.mark.chaos, pytest.mark.fault]


@pytest.mark.scenario(25)
@pytest.mark.timeout(120)
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
