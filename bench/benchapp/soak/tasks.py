"""The soak's two bodies: one atomic, one not, each leaving an effect row (and a start row for
planned failures and attempts after the first).

``fail=True`` makes the first attempt raise ``SoakTransient`` (after writing the effect, for the
atomic body, so the rollback is exercised); the retry backs off up to 6 s with full jitter, so
with the soak's ``TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS=3`` about three in seven of the retries
are parked in the ledger and published by the rescuer.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task
from django.db import InterfaceError, OperationalError, connections

from taskplatform.tasks import IdempotentTask

from .models import SoakEffect, SoakStart


class SoakTransient(Exception):
    """The planned failure of a first attempt: retryable."""


#: A body that writes to the database retries when its connection is cut: the soak terminates
#: the database's connections (``pg_terminate_backend``), and an unlisted error is a dead letter.
RETRY: dict[str, Any] = {
    "autoretry_for": (SoakTransient, OperationalError, InterfaceError),
    "retry_backoff": 6,
    "retry_backoff_max": 6,
    "retry_jitter": True,
    "max_retries": 10,  # faults count attempts too; a key must not run out of them
}


def _record_start(**fields: Any) -> None:
    """The start row, on the ``oracle`` connection in autocommit; once more on a fresh
    connection if that one was cut (it is informative: the effect rows are the oracle)."""
    try:
        SoakStart.objects.using("oracle").create(**fields)
    except (OperationalError, InterfaceError):
        connections["oracle"].close()
        SoakStart.objects.using("oracle").create(**fields)


def _body(task: IdempotentTask, name: str, fail: bool) -> int:
    key = task.idempotency_key or ""
    token = task.fencing_token or 0
    fails = fail and task.request.retries == 0
    if fails or task.request.retries:  # not every first attempt: one commit less on the hot path
        _record_start(key=key, task=name, fencing_token=token, pid=os.getpid(), fails=fails, at=time.time())
    if fails and name == "plain":
        raise SoakTransient("planned failure of the first attempt")
    SoakEffect.objects.create(key=key, task=name, fencing_token=token, pid=os.getpid(), at=time.time())
    if fails:  # atomic: the effect is written, then rolled back with the failed attempt
        raise SoakTransient("planned failure of the first attempt, after the write")
    return token


@shared_task(base=IdempotentTask, bind=True, name="soak.atomic", atomic=True, **RETRY)
def atomic(self: IdempotentTask, n: int = 0, fail: bool = False) -> int:
    """Atomic body: its effect commits with the ledger's success mark, or not at all."""
    return _body(self, "atomic", fail)


@shared_task(base=IdempotentTask, bind=True, name="soak.plain", **RETRY)
def plain(self: IdempotentTask, n: int = 0, fail: bool = False) -> int:
    """Non-atomic body: its effect commits at once; a fault between it and the success mark
    runs it again (counted by the soak, and explained by a fault)."""
    return _body(self, "plain", fail)
