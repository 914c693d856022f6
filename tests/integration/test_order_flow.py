"""The reference deployment's order flow through its view and a real worker.

``POST /api/orders/`` starts ``tasks.tasks.ORDER_FLOW``: reserve stock, capture payment,
issue a coupon. A sold-out campaign fails the last step for good: the payment is refunded
and the stock released, in that order, each exactly once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from taskplatform.models import FlowRun, FlowState
from tasks.models import ApiToken, Campaign, Capture, Coupon, StockItem, StockReservation

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def client() -> Client:
    user = User.objects.create_user("carol", password="pw")
    _token, raw = ApiToken.issue(user, "test")
    return Client(HTTP_AUTHORIZATION=f"Token {raw}")


@pytest.fixture
def shop() -> None:
    StockItem.objects.create(sku="widget", quantity=10)
    Campaign.objects.create(slug="winter", name="Winter", stock=5)
    Campaign.objects.create(slug="spring", name="Spring (sold out)", stock=0)


def order(client: Client, **body: Any) -> Any:
    data = {"order": "A-1", "sku": "widget", "quantity": 2, "amount_cents": 1999, "campaign": "winter", **body}
    return client.post("/api/orders/", data=json.dumps(data), content_type="application/json")


def state_of(client: Client, number: str) -> str:
    return str(client.get(f"/api/orders/{number}").json()["state"])


@pytest.mark.worker
def test_an_order_succeeds_with_stock_reserved_payment_captured_and_a_coupon(workers, poll, client, shop):
    workers.start(concurrency=2)
    first = order(client)
    assert first.status_code == 202 and first["Location"] == "/api/orders/A-1"
    assert order(client).status_code == 200, "the same order again is the same run"
    poll(lambda: state_of(client, "A-1") == FlowState.SUCCEEDED, timeout=60, what="the order flow succeeded")
    assert StockItem.objects.get(sku="widget").quantity == 8
    assert Capture.objects.filter(order="A-1", refunded_at=None).count() == 1
    assert Coupon.objects.filter(campaign__slug="winter").count() == 1


@pytest.mark.worker
def test_a_sold_out_coupon_refunds_the_payment_and_releases_the_stock(workers, poll, client, shop):
    workers.start(concurrency=2)
    assert order(client, order="B-1", campaign="spring").status_code == 202
    poll(lambda: state_of(client, "B-1") == FlowState.COMPENSATED, timeout=60, what="the order flow compensated")
    run = FlowRun.objects.get(key="order:B-1")
    assert run.failed_step == "issue-coupon" and "sold out" in run.error
    capture = Capture.objects.get(order="B-1")
    reservation = StockReservation.objects.get(order="B-1")
    assert capture.refunded_at is not None and reservation.released_at is not None
    assert capture.refunded_at <= reservation.released_at, "undone in reverse order"
    assert StockItem.objects.get(sku="widget").quantity == 10


def test_bad_orders_get_a_clear_400_and_nothing_starts(client, shop):
    for body, message in [
        ({"order": ""}, "order number"),
        ({"sku": "nope"}, "no stock item"),
        ({"quantity": 0}, "positive integer"),
        ({"amount_cents": "12"}, "positive integer"),
        ({"campaign": "nope"}, "no campaign"),
        ({"extra": 1}, "unknown field"),
        ({"order": "A-1\n"}, "order number"),
        ({"amount_cents": 2**70}, "positive integer up to"),
    ]:
        response = order(client, **body)
        assert response.status_code == 400 and message in response.json()["detail"], (body, response.content)
    assert not FlowRun.objects.exists()


def test_the_same_order_number_with_other_contents_is_422(client, shop):
    assert order(client, order="C-1").status_code == 202
    response = order(client, order="C-1", quantity=3)
    assert response.status_code == 422
    assert FlowRun.objects.count() == 1


def test_another_users_order_is_not_found(client, shop):
    order(client, order="D-1")
    other = User.objects.create_user("dave", password="pw")
    _token, raw = ApiToken.issue(other, "t")
    assert Client(HTTP_AUTHORIZATION=f"Token {raw}").get("/api/orders/D-1").status_code == 404
    assert client.get("/api/orders/D-1").status_code == 200
