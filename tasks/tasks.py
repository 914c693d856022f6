"""The reference deployment's jobs, written only against the public API of ``taskplatform``.

Demo jobs for ``make run`` (``ping``, ``flaky_sync``) and the reference jobs: coupon issuing,
order time-out close, inventory sync, sharded payment reconciliation, and the order flow
(reserve stock, capture payment, issue a coupon; compensated by a refund and a release).
"""

from __future__ import annotations

import json
import random
import secrets
import urllib.error
import urllib.request
from datetime import UTC, date, datetime, timedelta
from typing import Any

from celery import shared_task
from django.db.models import F
from django.utils import timezone

from taskplatform import Flow, Step
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
    return _issue_coupon(campaign, user_id)


def _issue_coupon(campaign: str, user_id: int) -> dict[str, Any]:
    """Issue one coupon in the caller's transaction (the stock row locked), or say why not."""
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


# --- order time-out close: every minute, each overdue order closed once ------------------------


class CloseOrderTask(IdempotentTask):
    def derive_idempotency_key(self, number: str) -> str:
        return f"close-order:{number}"


@shared_task(base=IdempotentTask, bind=True, name="tasks.close_unpaid_orders")
def close_unpaid_orders(self: IdempotentTask, max_age_minutes: int = 30, batch: int = 500) -> dict[str, int]:
    """Find unpaid orders older than ``max_age_minutes`` and submit one close per order.

    Each close is its own execution keyed by the order number, so overlapping sweeps (a
    slow one still running when the next minute's starts) and re-deliveries close an order
    once; a failing order retries alone without holding back the others.
    """
    from taskplatform import submit_or_get

    from .models import Order

    cutoff = timezone.now() - timedelta(minutes=max_age_minutes)
    numbers = list(
        Order.objects.filter(status=Order.Status.PENDING, created_at__lt=cutoff)
        .order_by("created_at")
        .values_list("number", flat=True)[:batch]
    )
    created = sum(submit_or_get(close_order, [n])[1] for n in numbers)
    return {"overdue": len(numbers), "submitted": created}


@shared_task(base=CloseOrderTask, bind=True, name="tasks.close_order", atomic=True)
def close_order(self: CloseOrderTask, number: str) -> dict[str, Any]:
    """Close one unpaid order (atomic: the status change commits with the ledger's success)."""
    from .models import Order

    closed = Order.objects.filter(number=number, status=Order.Status.PENDING).update(
        status=Order.Status.CLOSED, closed_at=timezone.now()
    )
    return {"order": number, "closed": bool(closed)}


# --- inventory sync: push stock levels downstream with the idempotency key ---------------------


class DownstreamUnavailable(Exception):
    """The warehouse service answered 5xx or timed out: worth retrying."""


class DownstreamRejected(Exception):
    """The warehouse service answered 4xx: retrying would not help."""


@shared_task(
    base=IdempotentTask,
    bind=True,
    name="tasks.sync_inventory",
    autoretry_for=(DownstreamUnavailable,),
    dont_autoretry_for=(DownstreamRejected,),
    retry_backoff=2,
    retry_backoff_max=120,
    retry_jitter=True,
    max_retries=5,
)
def sync_inventory(self: IdempotentTask, timeout_seconds: float = 5.0) -> dict[str, Any]:
    """POST every stock level to ``INVENTORY_SERVICE_URL``/stock.

    The execution's idempotency key travels as the ``Idempotency-Key`` header, the same on
    every attempt, so the downstream service can drop a repeat of a request it already
    applied (our attempt may have timed out after it did). 5xx and timeouts retry with
    backoff; 4xx fails at once.
    """
    from django.conf import settings

    from .models import StockItem

    base = getattr(settings, "INVENTORY_SERVICE_URL", "")
    if not base:
        raise DownstreamRejected("INVENTORY_SERVICE_URL is not configured")
    items = [{"sku": s, "quantity": q} for s, q in StockItem.objects.order_by("sku").values_list("sku", "quantity")]
    body = json.dumps({"items": items}).encode()
    request = urllib.request.Request(
        f"{base.rstrip('/')}/stock",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Idempotency-Key": str(self.idempotency_key),
            "X-Fencing-Token": str(self.fencing_token),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_seconds) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        if 400 <= exc.code < 500:
            raise DownstreamRejected(f"warehouse service refused the sync: HTTP {exc.code}") from None
        raise DownstreamUnavailable(f"warehouse service failed: HTTP {exc.code}") from None
    except (TimeoutError, urllib.error.URLError, ConnectionError) as exc:
        raise DownstreamUnavailable(f"warehouse service unreachable: {exc}") from None
    return {"items": len(items), "status": status}


# --- payment reconciliation: a daily run split into shards that retry and resume alone ---------


class ReconcileShardTask(IdempotentTask):
    def derive_idempotency_key(self, day: str, shard: int, shards: int) -> str:
        return f"reconcile:{day}:{shard}/{shards}"


class ReconciliationMismatch(Exception):
    """A payment does not match the provider's record (retryable: provider data may lag)."""


def settlement_anchor(execution: Any) -> datetime:
    """The instant a reconciliation's day is counted from: its schedule slot. A beat slot's key
    is ``<job>@<slot, UTC ISO-8601>`` and never changes; ``scheduled_for`` does (a retry or a
    wait for a limit moves it to when the next attempt may start, which may be after midnight).
    Then ``scheduled_for`` as the submission gave it, then the row's creation."""
    if execution is None:
        return timezone.now()
    _, _, suffix = execution.idempotency_key.rpartition("@")
    if suffix.endswith("Z"):
        try:
            return datetime.fromisoformat(suffix[:-1]).replace(tzinfo=UTC)
        except ValueError:
            pass
    return execution.scheduled_for or execution.created_at


@shared_task(base=IdempotentTask, bind=True, name="tasks.reconcile_payments")
def reconcile_payments(
    self: IdempotentTask, shards: int = 4, day: str = "", timezone_name: str = "Europe/Berlin"
) -> dict[str, Any]:
    """Reconcile one settlement day in ``shards`` independent executions.

    ``day`` defaults to the day before this execution's schedule slot in ``timezone_name``,
    so a re-run of the same slot names the same day. Each shard is keyed
    ``reconcile:<day>:<i>/<n>``: running this again (a resume after a crash, or an operator
    re-running the day) submits nothing new for shards that exist, and a failed shard is
    retried on its own (its retries, or the admin's "retry now").
    """
    from zoneinfo import ZoneInfo

    from taskplatform import submit_or_get

    if not 1 <= shards <= 64:
        raise ValueError(f"shards must be 1 to 64, not {shards}")
    if not day:
        anchor = settlement_anchor(self.execution)
        day = (anchor.astimezone(ZoneInfo(timezone_name)).date() - timedelta(days=1)).isoformat()
    date.fromisoformat(day)  # a malformed day fails here, before any shard exists
    created = [submit_or_get(reconcile_payment_shard, [day, i, shards])[1] for i in range(shards)]
    return {"day": day, "shards": shards, "submitted": sum(created)}


@shared_task(
    base=ReconcileShardTask,
    bind=True,
    name="tasks.reconcile_payment_shard",
    autoretry_for=(ReconciliationMismatch,),
    retry_backoff=5,
    retry_backoff_max=300,
    retry_jitter=True,
    max_retries=5,
)
def reconcile_payment_shard(self: ReconcileShardTask, day: str, shard: int, shards: int) -> dict[str, Any]:
    """Reconcile the payments of ``day`` whose id falls in this shard, in committed batches.

    Payments already reconciled are skipped, so an attempt that died half-way resumes where
    it stopped. A payment that does not match raises ``ReconciliationMismatch``: this shard
    retries with backoff while the others finish.
    """
    from django.db import transaction
    from django.db.models import F

    from .models import Payment

    done = 0
    while True:
        batch = list(
            Payment.objects.annotate(bucket=F("id") % shards)
            .filter(settled_on=day, bucket=shard, reconciled_at__isnull=True)
            .order_by("id")[:200]
        )
        if not batch:
            break
        with transaction.atomic():
            for payment in batch:
                if payment.amount_cents < 0:
                    raise ReconciliationMismatch(f"payment {payment.reference}: negative amount")
                Payment.objects.filter(pk=payment.pk, reconciled_at__isnull=True).update(
                    reconciled_at=timezone.now(), reconciled_by=str(self.idempotency_key)
                )
                done += 1
    return {"day": day, "shard": shard, "reconciled": done}


# --- the order flow: reserve stock, capture payment, issue a coupon; undone in reverse ---------


class OrderStepFailed(Exception):
    """An order step that cannot succeed (out of stock, coupon campaign sold out): not retried."""


@shared_task(base=IdempotentTask, bind=True, name="tasks.reserve_stock", atomic=True, max_retries=3)
def reserve_stock(self: IdempotentTask, order: str, sku: str, quantity: int, **_: Any) -> dict[str, Any]:
    """Set ``quantity`` of ``sku`` aside for ``order`` (atomic with the step's success)."""
    from .models import StockItem, StockReservation

    item = StockItem.objects.select_for_update().filter(sku=sku).first()
    if item is None or item.quantity < quantity:
        raise OrderStepFailed(f"not enough {sku} in stock for order {order}")
    StockItem.objects.filter(pk=item.pk).update(quantity=F("quantity") - quantity)
    StockReservation.objects.create(order=order, item=item, quantity=quantity)
    return {"sku": sku, "reserved": quantity}


@shared_task(
    base=IdempotentTask, bind=True, name="tasks.release_stock", atomic=True,
    autoretry_for=(Exception,), retry_backoff=2, retry_backoff_max=60, max_retries=10,
)  # fmt: skip
def release_stock(self: IdempotentTask, order: str, **_: Any) -> dict[str, Any]:
    """Compensation of ``reserve_stock``: put the order's reserved stock back."""
    from .models import StockItem, StockReservation

    reservation = StockReservation.objects.select_for_update().filter(order=order, released_at=None).first()
    if reservation is None:
        return {"released": 0}
    StockItem.objects.filter(pk=reservation.item_id).update(quantity=F("quantity") + reservation.quantity)
    StockReservation.objects.filter(pk=reservation.pk).update(released_at=timezone.now())
    return {"released": reservation.quantity}


@shared_task(base=IdempotentTask, bind=True, name="tasks.capture_payment", atomic=True, max_retries=3)
def capture_payment(self: IdempotentTask, order: str, amount_cents: int, **_: Any) -> dict[str, Any]:
    """Capture the order's payment at the provider (a stub: a ``Capture`` row)."""
    from .models import Capture

    capture = Capture.objects.create(order=order, amount_cents=amount_cents)
    return {"capture": capture.pk, "amount_cents": amount_cents}


@shared_task(
    base=IdempotentTask, bind=True, name="tasks.refund_payment", atomic=True,
    autoretry_for=(Exception,), retry_backoff=2, retry_backoff_max=60, max_retries=10,
)  # fmt: skip
def refund_payment(self: IdempotentTask, order: str, **_: Any) -> dict[str, Any]:
    """Compensation of ``capture_payment``: refund the order's capture."""
    from .models import Capture

    refunded = Capture.objects.filter(order=order, refunded_at=None).update(refunded_at=timezone.now())
    return {"refunded": refunded}


@shared_task(base=IdempotentTask, bind=True, name="tasks.issue_order_coupon", atomic=True, max_retries=3)
def issue_order_coupon(self: IdempotentTask, order: str, campaign: str, user_id: int, **_: Any) -> dict[str, Any]:
    """The order's coupon; a sold-out or unknown campaign fails the step for good."""
    issued = _issue_coupon(campaign, user_id)
    if not issued["issued"]:
        raise OrderStepFailed(f"no coupon for order {order}: {issued['reason']}")
    return issued


#: ``POST /api/orders/`` starts one run per order number (``tasks/views.py``).
ORDER_FLOW = Flow(
    "order",
    [
        Step("reserve-stock", reserve_stock, compensate=release_stock),
        Step("capture-payment", capture_payment, compensate=refund_payment),
        Step("issue-coupon", issue_order_coupon),
    ],
)
