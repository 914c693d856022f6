"""Fault points for the fault catalogue's real processes (tests only; production code has none).

A process started with ``TP_FAULT_AT="<module>:<attribute path>:<before|after>"`` has that
callable replaced, when Django loads this app, by a wrapper that ends the process with
``os._exit(1)`` (no clean-up, no ``finally``, no ``atexit``: as ``kill -9`` would, but at a
chosen instruction) before or after the original runs; with ``TP_FAULT_ACTION=stop`` the
process stops itself there instead (``SIGSTOP``), until the test continues it.
``TP_FAULT_SKIP=N`` lets the first N calls through, so the process has done some normal
work first; the fault fires once. Examples::

    TP_FAULT_AT=taskplatform.core.publisher:publish:before      # a row committed, not yet published
    TP_FAULT_AT=taskplatform.core.publisher:publish:after       # a message published, nothing after
    TP_FAULT_AT=taskplatform.core.publisher:publish_many:before  # a batch committed (a beat's), not published
    TP_FAULT_AT=taskplatform.scheduling.scheduler:publish_many_on_commit:after  # a beat's batch inserted, not committed
    TP_FAULT_AT=celery.app.base:Celery.send_task:before         # any message, before it is sent
    TP_FAULT_AT=taskplatform.scheduling.scheduler:check_fence:before  # lease checked, fence not yet

Patch the name where the caller looks it up (``scheduler.publish_many_on_commit`` is the
beat's own reference to it). Before exiting, one line goes to stderr, ``TP_FAULT fired at
<spec> call <n> key=<idempotency key>`` (the slot's or execution's key: an ``idempotency_key``
argument, a message's ``tp_key``/``tp_slot`` header, or the key of an argument or result that
is an execution), so the test knows which slot the fault hit.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
from collections.abc import Callable
from functools import wraps
from typing import Any

WHEN = ("before", "after")
#: ``exit``: ``os._exit(1)``. ``stop``: the process stops itself (``SIGSTOP``) once, as a VM
#: pause or a long GC would stop it at that very point; the test that started it sends
#: ``SIGCONT`` and it carries on from there.
ACTIONS = ("exit", "stop")


def install(spec: str, skip: int = 0, action: str = "exit") -> None:
    """Replace the callable ``spec`` names by one that exits (or stops) the process at its
    ``skip + 1``-th call."""
    if action not in ACTIONS:
        raise ValueError(f"TP_FAULT_ACTION={action!r}: one of {ACTIONS}")
    module_name, path, when = spec.split(":")
    if when not in WHEN:
        raise ValueError(f"TP_FAULT_AT={spec!r}: the last part must be one of {WHEN}")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original: Callable[..., Any] = getattr(owner, name)
    calls = 0
    fired = False
    lock = threading.Lock()

    def fire(args: tuple[Any, ...], kwargs: dict[str, Any], number: int, result: Any = None) -> None:
        headers = kwargs.get("headers") or {}
        keys = [kwargs.get("idempotency_key"), headers.get("tp_key"), headers.get("tp_slot")]
        keys += [getattr(a, "idempotency_key", None) for a in (result, *args, *kwargs.values())]
        # A batch (``publish_many``'s entries): the first execution's key.
        keys += [
            getattr(entry[0] if isinstance(entry, tuple) and entry else entry, "idempotency_key", None)
            for a in args
            if isinstance(a, list | tuple)
            for entry in a[:1]
        ]
        key = next((k for k in keys if isinstance(k, str)), "")
        # To the process's own stderr (file descriptor 2): Celery replaces ``sys.stderr``.
        os.write(2, f"TP_FAULT fired at {spec} call {number} key={key}\n".encode())
        if action == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)
        os.write(2, f"TP_FAULT continued after {spec} call {number}\n".encode())

    @wraps(original)
    def faulty(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls, fired
        with lock:
            calls += 1
            armed = calls > skip and not fired
            fired = fired or armed
            number = calls
        if armed and when == "before":
            fire(args, kwargs, number)
        result = original(*args, **kwargs)
        if armed and when == "after":
            fire(args, kwargs, number, result)
        return result

    setattr(owner, name, faulty)


def install_from_environment() -> None:
    """Install the fault ``TP_FAULT_AT`` names, if any (called from the test app's ``ready``)."""
    spec = os.environ.get("TP_FAULT_AT", "")
    if spec:
        install(spec, skip=int(os.environ.get("TP_FAULT_SKIP", "0")), action=os.environ.get("TP_FAULT_ACTION", "exit"))
