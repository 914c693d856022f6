"""G2 across containers: a live owner in another pid namespace is never taken over early.

Two workers started with the same Celery node name in different containers (pid namespaces)
see each other's pids as missing, or as unrelated processes. The claim must then leave the
decision to the lease. The other container is real: a process in a pid namespace created
with ``unshare``, holding a pid that does not exist in ours.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from taskplatform.core import ledger
from taskplatform.models import EventKind, Execution
from taskplatform.worker.owner import owner_alive, parse_owner, process_alive, worker_identity

pytestmark = [pytest.mark.django_db(transaction=True)]

NODE = "w1@host"

# Run as pid 1 of a new pid namespace: fork until the next child gets ``target`` as its pid;
# that child prints its owner identity and lives until stdin closes.
_FORK_TO_PID = """
import os, sys
target = int(sys.argv[1])
while True:
    pid = os.fork()
    if pid == 0:
        if os.getpid() == target:
            from taskplatform.worker.owner import worker_identity
            print(worker_identity(sys.argv[2]), flush=True)
            sys.stdin.read()
        os._exit(0)
    os.waitpid(pid, 0)
    if pid >= target:
        os._exit(0 if pid == target else 3)
"""


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


def _pid_missing_here() -> int | None:
    """A small pid no process has in our namespace (a container's pids are small)."""
    return next((pid for pid in range(2, 1000) if not os.path.exists(f"/proc/{pid}")), None)


@contextmanager
def owner_in_another_pid_namespace(pid: int) -> Iterator[str]:
    """A live process holding ``pid`` in a fresh pid namespace; yields the identity it records."""
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _FORK_TO_PID, str(pid), NODE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        identity = proc.stdout.readline().strip()
        assert identity, "the owner in the other namespace printed no identity"
        yield identity
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=10)


def _running(owner: str, lease: int = 60) -> Execution:
    execution, _ = ledger.create(
        ledger.NewExecution(idempotency_key="owned", task_name="testapp.effect", args=[], kwargs={})
    )
    claim = ledger.claim(execution, worker=owner, celery_task_id="t-1", lease_seconds=lease, max_attempts=3)
    assert claim.outcome == "claimed"
    return ledger.get(execution.pk)


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare(1) to create a pid namespace")
def test_a_live_owner_in_another_container_with_our_node_name_is_not_taken_over():
    pid = _pid_missing_here()
    if pid is None:
        pytest.skip("no free small pid in this namespace")
    with owner_in_another_pid_namespace(pid) as identity:
        owner = parse_owner(identity)
        assert owner is not None and (owner.node, owner.pid) == (NODE, pid)
        assert not process_alive(pid)  # here that pid is nobody: "<node>:<pid>" would look dead
        execution = _running(identity)

        second = ledger.claim(
            execution,
            worker=worker_identity(NODE),
            celery_task_id="t-2",
            lease_seconds=60,
            max_attempts=3,
            owner_alive=owner_alive,
        )
        assert second.outcome == "duplicate"
        row = Execution.objects.get(pk=execution.pk)
        assert (row.attempts, row.fencing_token, row.worker) == (1, 1, identity)


def test_a_dead_owner_in_our_namespace_is_taken_over_before_its_lease_expires():
    script = f"from taskplatform.worker.owner import worker_identity; print(worker_identity({NODE!r}))"
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
    )
    identity = child.communicate(timeout=30)[0].strip()  # the owner exited: a killed pool child
    execution = _running(identity)
    taken = ledger.claim(
        execution,
        worker=worker_identity("w2@host"),  # any node on this host can judge it
        celery_task_id="t-2",
        lease_seconds=60,
        max_attempts=3,
        owner_alive=owner_alive,
    )
    assert taken.outcome == "claimed" and taken.execution.attempts == 2
    assert EventKind.TAKEN_OVER in Execution.objects.get(pk=execution.pk).events.values_list("kind", flat=True)
