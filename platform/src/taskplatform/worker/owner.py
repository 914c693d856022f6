"""Who owns a running attempt, and whether that owner is known to be dead.

An attempt's owner is recorded as ``"<celery nodename>:<pid>"``. A worker that receives a
message for an execution whose lease is still live asks ``owner_alive_on(node)``: an owner on
this very node can be checked with signal 0, so the attempt of a pool child killed here is
taken over at once instead of after its lease.
"""

from __future__ import annotations

import os
from typing import Any


def owner_alive_on(node: str) -> Any:
    """A probe telling whether the owner ``"<node>:<pid>"`` of a running attempt is alive.

    Only owners on this node can be checked (signal 0 to the pid); elsewhere the answer is
    ``None`` (unknown) and the lease decides. Our own pid is also ``None``: with a thread
    pool this process may run the attempt itself.
    """

    def probe(worker: str) -> bool | None:
        owner_node, _, pid_text = worker.rpartition(":")
        if owner_node != node or not pid_text.isdigit():
            return None
        pid = int(pid_text)
        if pid == os.getpid():
            return None
        return process_alive(pid)

    return probe


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this machine (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: trust the signal check
    return state not in {"Z", "X"}  # killed but not yet reaped by the pool
