"""The reference deployment's business data: coupon campaigns, API tokens, client requests."""

from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone


class Campaign(models.Model):
    """A coupon campaign with a limited stock."""

    slug = models.SlugField(max_length=100, unique=True)
    name = models.CharField(max_length=200)
    stock = models.PositiveIntegerField(help_text="Coupons left to issue.")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.slug} ({self.stock} left)"


class Coupon(models.Model):
    """One issued coupon: at most one per (campaign, user), enforced by the database too."""

    campaign = models.ForeignKey(Campaign, on_delete=models.PROTECT, related_name="coupons")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="coupons")
    code = models.CharField(max_length=32, unique=True)
    issued_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["campaign", "user"], name="one_coupon_per_user")]

    def __str__(self) -> str:
        return self.code


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token for API clients (``Authorization: Token <key>``); only its hash is stored."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, help_text="What the token is for.")
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.user})"

    @staticmethod
    def new_key() -> tuple[str, str]:
        """A fresh random key and its hash: keep the hash, hand the key to the client once."""
        raw = secrets.token_urlsafe(32)
        return raw, hash_token(raw)

    @classmethod
    def issue(cls, user: models.Model, name: str) -> tuple[ApiToken, str]:
        """Create a token; the raw key is returned once and never stored."""
        raw, key_hash = cls.new_key()
        return cls.objects.create(user=user, name=name, key_hash=key_hash), raw


class ClientRequest(models.Model):
    """A client's ``Idempotency-Key``: replaying the same request returns the same execution.

    The key is scoped to the user; the fingerprint (method, path and body) makes a reuse of
    the key for a different request an error instead of a silent mix-up.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="client_requests")
    key = models.CharField(max_length=200)
    fingerprint = models.CharField(max_length=64)
    execution = models.ForeignKey("taskplatform.Execution", on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="one_request_per_client_key")]

    def __str__(self) -> str:
        return f"{self.user}:{self.key}"


class Order(models.Model):
    """An order that must be paid within a time limit, else it is closed (stock released)."""

    class Status(models.TextChoices):
        PENDING = "pending", "awaiting payment"
        PAID = "paid", "paid"
        CLOSED = "closed", "closed unpaid"

    number = models.CharField(max_length=40, unique=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["status", "created_at"], name="order_status_created")]

    def __str__(self) -> str:
        return f"{self.number} ({self.status})"


class StockItem(models.Model):
    """A stock level the inventory sync pushes to the downstream warehouse service."""

    sku = models.CharField(max_length=64, unique=True)
    quantity = models.IntegerField()
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.sku}: {self.quantity}"


class Payment(models.Model):
    """A settled payment to reconcile against the ledger of the payment provider."""

    reference = models.CharField(max_length=64, unique=True)
    amount_cents = models.BigIntegerField()
    settled_on = models.DateField(db_index=True)
    reconciled_at = models.DateTimeField(null=True, blank=True)
    reconciled_by = models.CharField(max_length=255, blank=True, help_text="Idempotency key of the shard run.")

    def __str__(self) -> str:
        return self.reference


class StockReservation(models.Model):
    """Stock set aside for an order by its flow's first step; released by its compensation."""

    order = models.CharField(max_length=40, unique=True)
    item = models.ForeignKey(StockItem, on_delete=models.PROTECT, related_name="reservations")
    quantity = models.PositiveIntegerField()
    reserved_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.order}: {self.quantity} of {self.item.sku}{' (released)' if self.released_at else ''}"


class Capture(models.Model):
    """The payment provider stub: an order's captured payment, and its refund."""

    order = models.CharField(max_length=40, unique=True)
    amount_cents = models.BigIntegerField()
    captured_at = models.DateTimeField(auto_now_add=True)
    refunded_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.order}: {self.amount_cents} cents{' (refunded)' if self.refunded_at else ''}"
