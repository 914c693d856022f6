"""The reference deployment's jobs, written only against the public API of ``taskplatform``.

Demo jobs for ``make run`` (``ping``, ``flaky_sync``) and the reference jobs (coupon issuing).
"""

from __future__ import annotations

import random
import secrets
from typing import Any

from celery import shared_task
from django.db.models import F
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


# --- coupon issuing: at most one coupon per (campaign, user), never more than the stock ---------


class CouponTask(IdempotentTask):
    """Keyed by business identity: one execution per (campaign, user), whoever asks how often."""

    def derive_idempotency_key(self, campaign: str, user_id: int) -> str:
        return f"coupon:{campaign}:{user_id}"


@shared_task(base=CouponTask, bind=True, name="tasks.issue_coupon", atomic=True, max_retries=3)
def issue_coupon(self: CouponTask, campaign: str, user_id: int) -> dict[str, Any]:
    """Issue one coupon of ``campaign`` to ``user_id``.

    Atomic mode: the stock decrement, the coupon row and the ledger's SUCCEEDED commit in
    one transaction, so a crash or a duplicate delivery can neither issue a second coupon
    nor lose a decrement. Keyed by (campaign, user): asking again returns the first answer.
    """
    from .models import Campaign, Coupon

    row = Campaign.objects.select_for_update().filter(slug=campaign).first()
    if row is None:
        return {"issued": False, "reason": "unknown campaign"}
    existing = Coupon.objects.filter(campaign=row, user_id=user_id).first()
    if existing is not None:  # issued outside this key (e.g. by an operator): report it
        return {"issued": True, "code": existing.code}
    if row.stock == 0:
        return {"issued": False, "reason": "sold out"}
    Campaign.objects.filter(pk=row.pk).update(stock=F("stock") - 1)
    code = secrets.token_hex(8).upper()
    Coupon.objects.create(campaign=row, user_id=user_id, code=code)
    return {"issued": True, "code": code}
