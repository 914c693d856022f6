"""The reference reconciliation counts its day from its schedule slot (pure logic).

Review of issue 15: ``scheduled_for`` is moved by a retry, and by a wait for a fleet-wide limit,
to when the next attempt may start; a reconciliation retried after midnight counted its day
from that and reconciled the wrong day. A beat slot's key never changes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from tasks.tasks import settlement_anchor

SLOT = datetime(2026, 3, 29, 0, 30, tzinfo=UTC)
RETRY_AFTER_MIDNIGHT = datetime(2026, 3, 29, 23, 10, tzinfo=UTC)


def test_a_beat_slot_is_read_from_its_key_not_from_a_moved_scheduled_for() -> None:
    row = SimpleNamespace(
        idempotency_key="payment-reconciliation@2026-03-29T00:30:00Z",
        scheduled_for=RETRY_AFTER_MIDNIGHT,
        created_at=SLOT,
    )
    assert settlement_anchor(row) == SLOT


def test_another_key_falls_back_to_scheduled_for_then_the_creation() -> None:
    given = SimpleNamespace(idempotency_key="recon@admin:1", scheduled_for=SLOT, created_at=RETRY_AFTER_MIDNIGHT)
    assert settlement_anchor(given) == SLOT
    bare = SimpleNamespace(idempotency_key="recon@2026-03-29", scheduled_for=None, created_at=RETRY_AFTER_MIDNIGHT)
    assert settlement_anchor(bare) == RETRY_AFTER_MIDNIGHT
