"""The admin shows the ledger read-only, behind authentication."""

from __future__ import annotations

import pytest

from taskplatform.core import ledger
from taskplatform.models import Execution

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def execution() -> Execution:
    execution, _ = ledger.create(
        ledger.NewExecution(idempotency_key="admin-1", task_name="testapp.effect", args=[], kwargs={})
    )
    c = ledger.claim(execution, worker="w:1", celery_task_id="t", lease_seconds=30, max_attempts=3)
    ledger.succeed(c.execution, c.token, {"ok": True}, worker="w:1", data={"duration_ms": 1.0})
    return execution


def test_anonymous_users_are_sent_to_the_login_page(client, execution):
    response = client.get("/admin/taskplatform/execution/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_the_ledger_list_and_history_render_without_edit_controls(admin_client, execution):
    listing = admin_client.get("/admin/taskplatform/execution/")
    assert listing.status_code == 200 and b"admin-1" in listing.content
    detail = admin_client.get(f"/admin/taskplatform/execution/{execution.pk}/change/")
    assert detail.status_code == 200
    assert b"claimed" in detail.content and b"succeeded" in detail.content
    assert b'name="_save"' not in detail.content  # read-only: no save button
    assert admin_client.get("/admin/taskplatform/execution/add/").status_code == 403
