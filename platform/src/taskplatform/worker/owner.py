"""Who owns a running attempt, and whether that owner is known to be dead.

An attempt's owner is recorded as ``"<celery nodename>:<pid>:<boot id>.<pid namespace>:<start>"``,
for instance ``"w1@web-3:4242:c04c82bfe0d14d20.4026531836:917364"``:

* the boot id (``/proc/sys/kernel/random/boot_id``, first 16 hex digits) names one boot of
  one machine; every container on that machine shares it;
* the pid namespace (the inode of ``/proc/self/ns/pid``) tells apart containers on that
  machine, whose pids are counted separately;
* the start time (``/proc/<pid>/stat`` field 22, clock ticks since boot) tells apart the
  processes that held the same pid one after the other.

A worker that receives a message for an execution whose lease is still live asks
``owner_alive(worker)``. Only an owner in *our* pid namespace on *this* boot can be judged:
its pid is looked up here, and it is dead if the pid is gone, a zombie, or now belongs to a
process that started at another time. Any other owner (another machine or container, even one
whose Celery node name is the same as ours, an identity this host cannot read, a row written
in the older ``"<node>:<pid>"`` form) is unknown and the lease decides. The node name alone is
never trusted: two containers started with the same ``-n`` (host networking, copied compose
files) would each see the other's pid as missing, or as some unrelated process, and take over
a live attempt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_BOOT_ID_DIGITS = 16  # 64 random bits: enough to tell machines apart, short enough for the admin


@dataclass(frozen=True)
class OwnerId:
    """The parts of a recorded owner identity."""

    node: str
    pid: int
    namespace: str  # "<boot id>.<pid namespace inode>"
    start: int  # clock ticks after boot at which ``pid`` started


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (state) on; None if the process is not there."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # the command name (field 2) may hold spaces
    return fields if len(fields) >= 20 else None


def _start_time(fields: list[str]) -> int:
    return int(fields[19])  # field 22 of the whole line


def _identity() -> tuple[int, str, int] | None:
    """This process's ``(pid, namespace, start time)``, or None where procfs cannot tell."""
    pid = os.getpid()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:_BOOT_ID_DIGITS]
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/self/stat") as f:
            self_pid = int(f.read().split(" ", 1)[0])
    except (OSError, ValueError):
        return None
    fields = _stat_fields(pid)
    if not boot or self_pid != pid or fields is None:
        # /proc belongs to another pid namespace (mounted from outside): it cannot judge pids.
        return None
    return pid, f"{boot}.{pid_ns}", _start_time(fields)


_cached: tuple[int, str, int] | None = None


def _our_identity() -> tuple[int, str, int] | None:
    global _cached
    if _cached is None or _cached[0] != os.getpid():  # a forked pool child is another process
        _cached = _identity()
    return _cached


def worker_identity(node: str) -> str:
    """The owner string recorded on the attempts this process claims (``Execution.worker``)."""
    me = _our_identity()
    if me is None:
        return f"{node}:{os.getpid()}:?:0"  # judged by nobody: the lease decides
    pid, namespace, start = me
    return f"{node}:{pid}:{namespace}:{start}"


def parse_owner(worker: str) -> OwnerId | None:
    """The parts of an owner string written by ``worker_identity``; None for any other form."""
    rest, _, start = worker.rpartition(":")
    rest, _, namespace = rest.rpartition(":")
    node, _, pid = rest.rpartition(":")
    if not (node and pid.isdigit() and start.isdigit() and "." in namespace):
        return None
    return OwnerId(node=node, pid=int(pid), namespace=namespace, start=int(start))


def owner_alive(worker: str) -> bool | None:
    """Whether the owner ``worker`` of a running attempt is alive: True, False (known dead) or
    None (unknown: not judged from here, the lease decides).

    Our own identity is also ``None``: with a thread pool this process may run the attempt
    itself.
    """
    owner = parse_owner(worker)
    me = _our_identity()
    if owner is None or me is None or owner.namespace != me[1]:
        return None
    if owner.pid == me[0] and owner.start == me[2]:
        return None
    fields = _stat_fields(owner.pid)
    if fields is None:
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return None  # there but unreadable (procfs mounted with hidepid): cannot judge
    if fields[0] in {"Z", "X"}:  # killed but not yet reaped by the pool
        return False
    return _start_time(fields) == owner.start  # another start time: the pid was reused


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this machine (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no procfs: trust the signal check
    return fields[0] not in {"Z", "X"}
