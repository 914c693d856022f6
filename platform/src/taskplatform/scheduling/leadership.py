"""Leadership of the beat: the lease on a lock backend, and the fence that stops a stale leader.

``Leadership`` holds (renews every tick) or waits for the beat lease. A leader that cannot
renew keeps publishing only while its lease has more than ``beat_step_down_seconds`` left.
The ``SchedulerFence`` row names the leader that last took over: each publication checks it
in its own transaction, so a leader paused past its lease that wakes up cannot publish once
its successor has taken over (``take_over_fence``, ``check_fence``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.db import connection, transaction
from django.utils import timezone

from ..backends.base import Lease, LockBackend
from ..conf import PlatformSettings
from ..models import SchedulerFence

log = logging.getLogger("taskplatform.beat")


class Leadership:
    """The beat lease on a lock backend: held (renewed every tick) or waited for."""

    def __init__(self, backend: LockBackend, name: str, identity: str, conf: PlatformSettings) -> None:
        self.backend = backend
        self.name = name
        self.identity = identity
        self.lease_seconds = conf.beat_lease_seconds
        self.tick_seconds = conf.beat_tick_seconds
        self.step_down_seconds = conf.beat_step_down_seconds
        self.lease: Lease | None = None
        self._last_error_log = 0.0

    @property
    def token(self) -> int:
        return self.lease.token if self.lease else 0

    def may_publish(self) -> bool:
        """True while the lease can be trusted for one more publication."""
        return self.lease is not None and self.lease.remaining() > self.step_down_seconds

    def step(self) -> tuple[bool, bool]:
        """Renew or try to acquire; returns ``(leading, just_acquired)``."""
        if self.lease is None:
            try:
                self.lease = self.backend.acquire(self.name, self.lease_seconds, identity=self.identity)
            except ValueError as exc:  # refused by the backend's configuration (check taskplatform.E032)
                self._log_error("the lock backend refuses the beat lease (a configuration error): %s", exc)
                return False, False
            except Exception as exc:  # the lock server is unreachable: stay a follower
                self._log_error("could not reach the lock backend to acquire the beat lease: %s", exc)
                return False, False
            if self.lease is not None:
                log.info("beat %s leads (lease %s, fencing token %d)", self.identity, self.name, self.lease.token)
            return self.lease is not None, self.lease is not None
        if not self.renew_if_due():
            return False, False
        if not self.may_publish():
            log.warning(
                "beat %s steps down: its lease has %.1f s left and could not be renewed",
                self.identity,
                self.lease.remaining(),
            )
            self.lease = None
            return False, False
        return True, False

    def renew_if_due(self) -> bool:
        """Renew when at least half a tick passed since the grant; False if the lease was lost.

        An unreachable lock server is not a loss: the lease stays trusted while it has more
        than the step-down margin left (``may_publish``).
        """
        if self.lease is None:
            return False
        if self.lease.remaining() >= self.lease_seconds - self.tick_seconds / 2:
            return True
        try:
            renewed = self.backend.renew(self.lease, self.lease_seconds)
        except Exception as exc:
            self._log_error("could not renew the beat lease: %s", exc)
            return True
        if renewed is None:
            log.warning("beat %s lost the lease %s (expired or taken over)", self.identity, self.name)
            self.lease = None
            return False
        self.lease = renewed
        return True

    def abdicate(self) -> None:
        """Forget the lease without releasing it (it was lost, or a successor fenced us off)."""
        self.lease = None

    def release(self) -> None:
        if self.lease is None:
            return
        try:
            self.backend.release(self.lease)
        except Exception as exc:
            log.warning("could not release the beat lease on shutdown: %s", exc)
        self.lease = None

    def _log_error(self, message: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 10:
            log.error(message, exc)
            self._last_error_log = now


class FencedOff(Exception):
    """A newer leader has taken over the schedule: this process must stop publishing."""


def take_over_fence(name: str, lease: Lease, still_holds: Callable[[], bool]) -> None:
    """Record ``lease`` as the publishing leader of ``name`` (called on acquisition).

    Refused if a higher token already took over (we are a paused, stale leader) unless our
    lease is demonstrably live, which means the lock server's counter was reset (a Redis
    flush): then the fence follows the lock.
    """
    SchedulerFence.objects.get_or_create(name=name)
    with transaction.atomic():
        bound_lock_waits(lease)
        taken = SchedulerFence.objects.filter(name=name, fencing_token__lt=lease.token).update(
            fencing_token=lease.token, leader=lease.owner, updated_at=timezone.now()
        )
    if taken:
        return
    current = SchedulerFence.objects.get(name=name)
    if current.leader == lease.owner and current.fencing_token == lease.token:
        return
    if still_holds():
        log.warning(
            "fence %s holds token %d from %s but the lock granted %d to %s: the lock's counter was reset; "
            "the fence follows the lock",
            name,
            current.fencing_token,
            current.leader,
            lease.token,
            lease.owner,
        )
        SchedulerFence.objects.filter(name=name).update(
            fencing_token=lease.token, leader=lease.owner, updated_at=timezone.now()
        )
        return
    raise FencedOff(f"a newer leader ({current.leader}, token {current.fencing_token}) took over {name}")


def bound_lock_waits(lease: Lease) -> None:
    """In this transaction, on PostgreSQL: wait for the fence row lock at most until the lease
    could be untrusted, and let the server end the transaction if this process stalls inside
    it (a paused leader must not hold the fence row, and so every successor, indefinitely).

    Both bounds are the lease's remaining time less half a second, so a stalled leader's
    transaction ends before a successor can hold the lease. Callers renew just before
    entering the transaction (``LockedScheduler._keep_alive``) and keep the Python work
    between its statements small (objects are built before it starts), so a healthy
    leader is never idle that long.
    """
    if connection.vendor != "postgresql":
        return
    budget_ms = max(250, int(lease.remaining() * 1000) - 500)
    with connection.cursor() as cur:  # one round trip; both settings end with the transaction
        cur.execute(
            "SELECT set_config('lock_timeout', %s, true), set_config('idle_in_transaction_session_timeout', %s, true)",
            [f"{budget_ms}ms", f"{budget_ms}ms"],
        )


def check_fence(name: str, lease: Lease) -> None:
    """Inside the publication transaction: lock the fence row and confirm we still own it."""
    bound_lock_waits(lease)
    if not SchedulerFence.objects.filter(name=name, leader=lease.owner, fencing_token=lease.token).update(
        updated_at=timezone.now()
    ):
        raise FencedOff(f"{name} was taken over by a newer leader")
