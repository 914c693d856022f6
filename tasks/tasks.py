"""Demo jobs for the embedded profile (``make run``); the reference jobs build on the same API."""

from __future__ import annotations

import random
from typing import Any

from celery import shared_task
from django.utils import timezone

from taskplatform.tasks import IdempotentTask


class TransientSyncError(Exception):
    """A downstream hiccup worth retrying."""


@shared_task(base=IdempotentTask, bind=True, name="tasks.ping")
def ping(self: IdempotentTask, source: str = "manual") -> dict[str, Any]:
    """Return who triggered it and when: the smallest job that shows the ledger working."""
    return {"source": source, "at": timezone.now().isoformat(), "key": self.idempotency_key}


@shared_task(
    base=IdempotentTask,
    bind=True,
    name="tasks.flaky_sync",
    autoretry_for=(TransientSyncError,),
    retry_backoff=2,
    retry_backoff_max=20,
    retry_jitter=True,
    max_retries=3,
)
def flaky_sync(self: IdempotentTask, failure_rate: float = 0.5) -> dict[str, Any]:
    """Fail at random with a retryable error, to show backoff, retries and dead letters."""
    if random.random() < failure_rate:
        raise TransientSyncError(f"downstream unavailable (attempt {self.request.retries + 1})")
    return {"synced": True, "attempt": self.request.retries + 1}
