"""Real lock servers for the contract suite: a 6-node Redis Cluster and 3 Redlock nodes.

Started from the ``redis-server`` binary on free high ports for the test session and
stopped by PID; nothing else on the machine is touched. Fault tests that crash, restart or
pause Redlock nodes start their own (``redlock_servers``).

A Redlock node does not count toward a quorum until it has known a backend's keys for the
restart quarantine (``restart_quarantine_seconds``, ``backends/redlock.py``): on first use
every node is "fresh". The backends built here are on nodes that have served that prefix
for long enough (``age_redlock_nodes`` writes each node's "born" key in the past, on the
node's own clock), as in a deployment that has been running for a while.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI, RedisServer, free_port, port_open, require_service
from tests.helpers import wait_for

#: Node timeout 2 s: a dead master's replica is promoted within a few seconds.
CLUSTER_NODE_ARGS = (
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "2000",
)
CREATE_ARGS = ("--cluster-replicas", "1", "--cluster-yes")


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 < 65535 and not port_open("127.0.0.1", port + 10000, 0.05):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _need_redis_server() -> None:
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        if IN_CI:
            pytest.fail("redis-server / redis-cli not on PATH")
        pytest.skip("redis-server / redis-cli not on PATH")


@dataclass
class RedisClusterNodes:
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def by_port(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def healthy(self) -> bool:
        """Every live node reports the cluster ok, and every replica is in sync with its master.

        Without the second condition a test right after ``--cluster create`` (or after a
        failover) meets replicas still in their first sync: ``WAIT`` cannot confirm a grant
        and a master failover loses it.
        """
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            out = subprocess.run(
                ["redis-cli", "-p", str(node.port), "cluster", "info"], capture_output=True, text=True, timeout=5
            ).stdout
            if "cluster_state:ok" not in out:
                return False
            replication = subprocess.run(
                ["redis-cli", "-p", str(node.port), "info", "replication"], capture_output=True, text=True, timeout=5
            ).stdout
            if "role:slave" in replication and (
                "master_link_status:up" not in replication or "master_sync_in_progress:0" not in replication
            ):
                return False
        return True


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """Six nodes, three masters with one replica each, node timeout 2 s."""
    _need_redis_server()
    base = tmp_path_factory.mktemp("redis-cluster")
    cluster = RedisClusterNodes()
    try:
        for i in range(6):
            port = _free_cluster_port()
            node = RedisServer(
                port=port,
                workdir=base / f"n{i}",
                extra=CLUSTER_NODE_ARGS,
            )
            node.start()
            cluster.nodes.append(node)
        create = subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in cluster.nodes], *CREATE_ARGS],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert create.returncode == 0, create.stdout + create.stderr
        wait_for(cluster.healthy, timeout=30, interval=0.2, what="cluster state ok")
        yield cluster
    finally:
        for node in cluster.nodes:
            node.stop()


@pytest.fixture(scope="session")
def redlock_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    """Three independent Redis servers for Redlock."""
    _need_redis_server()
    base = tmp_path_factory.mktemp("redlock")
    nodes: list[RedisServer] = []
    try:
        for i in range(3):
            node = RedisServer(port=_free_cluster_port(), workdir=base / f"r{i}")
            node.start()
            nodes.append(node)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def redlock_servers(tmp_path: Path) -> Iterator[Callable[..., list[RedisServer]]]:
    """``start(n, *extra)``: n Redlock nodes of this test's own (``extra``: more redis-server
    arguments, e.g. an append-only file), stopped by PID when the test ends."""
    _need_redis_server()
    started: list[RedisServer] = []

    def start(n: int, *extra: str) -> list[RedisServer]:
        nodes = []
        for _ in range(n):
            node = RedisServer(port=_free_cluster_port(), workdir=tmp_path / f"redlock-{len(started)}", extra=extra)
            node.start()
            started.append(node)
            nodes.append(node)
        return nodes

    try:
        yield start
    finally:
        for node in started:
            node.stop()


def age_redlock_nodes(backend: Any) -> None:
    """Let every reachable node of a Redlock backend count at once: write its born key (the
    first time it served this prefix) as longer ago than the restart quarantine, by its own
    clock."""
    for node in backend.nodes:
        try:
            seconds, micros = node.time()
        except backend.redis.ConnectionError:
            continue  # cut off from this client (``redlock_backend(..., cut=...)``)
        now_ms = seconds * 1000 + micros // 1000
        node.set(backend.born_key(), now_ms - int(backend.restart_quarantine_seconds * 1000) - 1000)


def redlock_backend(
    nodes: list[RedisServer],
    *,
    prefix: str | None = None,
    aged: bool = True,
    cut: tuple[RedisServer, ...] = (),
    **options: Any,
) -> Any:
    """A Redlock client of these nodes (a prefix of its own unless given), nodes aged.

    ``cut``: nodes this client is partitioned from: its URL for them is a port nobody
    listens on (refused at once; unlike a paused server, nothing it sent is run later)."""
    from taskplatform.backends.redlock import RedlockLockBackend

    prefix = prefix or f"tp:test:{uuid.uuid4().hex[:8]}:"
    urls = [f"redis://127.0.0.1:{free_port()}/0" if n in cut else n.url for n in nodes]
    backend = RedlockLockBackend("test", {"urls": urls, "prefix": prefix, **options})
    if aged:
        age_redlock_nodes(backend)
    return backend


BACKENDS = [
    "locmem",
    pytest.param("db", marks=[pytest.mark.django_db(transaction=True), pytest.mark.portable]),
    "redis",
    "redis_cluster",
    "redlock",
]


def make_backend(kind: str, request: pytest.FixtureRequest, **options: Any) -> Any:
    """A fresh backend of ``kind`` with a key prefix of its own."""
    from taskplatform.backends.db import DatabaseLockBackend
    from taskplatform.backends.locmem import LocMemLockBackend
    from taskplatform.backends.redis import RedisLockBackend
    from taskplatform.backends.redis_cluster import RedisClusterLockBackend

    prefix = f"tp:test:{uuid.uuid4().hex[:8]}:"
    if kind == "locmem":
        return LocMemLockBackend("test", options)
    if kind == "db":  # the test carries django_db(transaction=True) (see BACKENDS)
        return DatabaseLockBackend("test", options)
    if kind == "redis":
        require_service("Redis", "127.0.0.1", 6379)
        return RedisLockBackend("test", {"url": "redis://127.0.0.1:6379/11", "prefix": prefix, **options})
    if kind == "redis_cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return RedisClusterLockBackend("test", {"url": cluster.url, "prefix": prefix, **options})
    if kind == "redlock":
        return redlock_backend(request.getfixturevalue("redlock_nodes"), prefix=prefix, **options)
    raise ValueError(kind)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    b = make_backend(request.param, request)
    yield b
    b.close()


@pytest.fixture
def lock_name() -> str:
    return f"lock-{uuid.uuid4().hex[:8]}"
