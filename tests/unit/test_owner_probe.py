"""The dead-owner probe used to take over a killed pool child's attempt without waiting.

The owner identities are produced by real processes (``worker_identity`` run in a child),
including one in another pid namespace created with ``unshare`` (a container on this host
started with the same Celery node name as ours).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from taskplatform.worker.owner import owner_alive, parse_owner, process_alive, worker_identity
from tests.helpers import wait_for

NODE = "w1@host"  # every identity below uses the same node name: it must not matter

# Prints its owner identity, then stays alive until its stdin closes.
_OWNER = (
    "import sys; from taskplatform.worker.owner import worker_identity; "
    f"print(worker_identity({NODE!r}), flush=True); sys.stdin.read()"
)


@contextmanager
def live_owner(*prefix: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A live process (run under ``prefix``, e.g. ``unshare``) and the identity it records."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        identity = proc.stdout.readline().strip()
        assert identity, "the owner process printed no identity"
        yield proc, identity
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=10)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


def test_a_zombie_counts_as_dead_like_a_reaped_process():
    child = subprocess.Popen(["true"])
    # Exited but not reaped: what a killed pool child is until billiard notices.
    wait_for(lambda: _state(child.pid) == "Z", timeout=5, what="zombie")
    assert process_alive(child.pid) is False
    child.wait()
    assert process_alive(child.pid) is False
    assert process_alive(os.getpid()) is True


def test_the_identity_is_readable_and_names_boot_namespace_and_start_time():
    identity = worker_identity(NODE)
    owner = parse_owner(identity)
    assert owner is not None and (owner.node, owner.pid) == (NODE, os.getpid())
    assert identity.startswith(f"{NODE}:{os.getpid()}:")
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip().replace("-", "")
    assert owner.namespace == f"{boot[:16]}.{os.stat('/proc/self/ns/pid').st_ino}"
    assert len(identity) < 100  # fits Execution.worker (255) with room for a long node name


def test_a_live_owner_in_our_namespace_is_alive_and_dead_once_it_exits():
    with live_owner() as (_proc, identity):
        assert owner_alive(identity) is True
    assert owner_alive(identity) is False  # exited and reaped: the pid is gone


def test_a_killed_owner_not_yet_reaped_is_dead():
    with live_owner() as (proc, identity):
        proc.kill()
        wait_for(lambda: _state(proc.pid) == "Z", timeout=5, what="zombie")
        assert owner_alive(identity) is False


def test_a_pid_reused_by_another_process_is_a_dead_owner():
    with live_owner() as (_proc, identity):
        owner = parse_owner(identity)
        assert owner is not None
        # The recorded owner held this pid earlier; the live process now holding it started later.
        earlier = f"{owner.node}:{owner.pid}:{owner.namespace}:{owner.start - 1}"
        assert owner_alive(earlier) is False
        assert owner_alive(identity) is True


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare(1) to create a pid namespace")
def test_an_owner_in_another_pid_namespace_with_our_node_name_is_unknown():
    """A container with the same node name: its pid means nothing here, so only the lease decides."""
    with live_owner("unshare", "--pid", "--fork", "--mount-proc") as (_proc, identity):
        owner = parse_owner(identity)
        assert owner is not None and owner.node == NODE
        ours = parse_owner(worker_identity(NODE))
        assert ours is not None and owner.namespace != ours.namespace
        # Its pid (1 in its namespace) is a different process here; a node + pid probe would
        # have judged the live owner dead (pid reused) and taken its attempt over.
        assert process_alive(owner.pid)
        assert owner_alive(identity) is None


def test_ourselves_legacy_and_malformed_owners_are_unknown():
    assert owner_alive(worker_identity(NODE)) is None  # thread pools: this process may run it
    child = subprocess.Popen(["true"])
    child.wait()
    assert owner_alive(f"{NODE}:{child.pid}") is None  # the old "<node>:<pid>" form: not trusted
    assert owner_alive("garbage") is None
    assert owner_alive(f"{NODE}:{child.pid}:?:0") is None  # a host without procfs
