"""The reference API: jobs submitted from requests, through a real worker.

Status codes: 401 anonymous, 202 + Location for new work, 200 for the same execution again,
400 bad input, 413 oversized body, 422 an Idempotency-Key reused for another request, 403
a session request without CSRF token, 404 another user's execution.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.db.models import Count
from django.test import Client

from taskplatform.models import Execution
from tasks.models import ApiToken, Campaign, ClientRequest, Coupon
from tests.helpers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/coupons/"


def token_client(user: User) -> Client:
    _token, raw = ApiToken.issue(user, "test")
    return Client(HTTP_AUTHORIZATION=f"Token {raw}")


def post(client: Client, body: Any, key: str | None = None, raw: bytes | None = None) -> Any:
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    data = raw if raw is not None else json.dumps(body)
    return client.post(URL, data=data, content_type="application/json", **headers)


@pytest.fixture
def alice() -> User:
    return User.objects.create_user("alice", password="pw-alice")


@pytest.fixture
def campaign() -> Campaign:
    return Campaign.objects.create(slug="winter", name="Winter sale", stock=100)


def test_anonymous_and_bad_tokens_are_refused(campaign: Campaign) -> None:
    assert post(Client(), {"campaign": "winter"}).status_code == 401
    assert post(Client(HTTP_AUTHORIZATION="Token nope"), {"campaign": "winter"}).status_code == 401
    assert post(Client(HTTP_AUTHORIZATION="Bearer x"), {"campaign": "winter"}).status_code == 401
    assert Client().get("/api/executions/1").status_code == 401
    assert not Execution.objects.exists()


def test_a_new_request_is_accepted_and_the_same_request_again_returns_the_same_execution(
    workers: Any, alice: User, campaign: Campaign
) -> None:
    workers.start(concurrency=2)
    client = token_client(alice)
    first = post(client, {"campaign": "winter"}, key="order-1")
    assert first.status_code == 202
    location = first["Location"]
    assert location == f"/api/executions/{first.json()['id']}"

    done = wait_for(
        lambda: (r := client.get(location).json())["state"] == "SUCCEEDED" and r, timeout=60, what="the coupon"
    )
    assert done["result"]["issued"] is True
    assert [e["kind"] for e in done["events"]][-1] == "succeeded"

    again = post(client, {"campaign": "winter"}, key="order-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert again["Location"] == location
    # A new key for the same coupon: the business key (campaign, user) still names one execution.
    other_key = post(client, {"campaign": "winter"}, key="order-2")
    assert other_key.status_code == 200 and other_key.json()["id"] == first.json()["id"]
    assert Coupon.objects.filter(user=alice).count() == 1
    assert Campaign.objects.get().stock == 99


def test_the_same_json_reformatted_under_the_same_key_is_the_same_request(alice: User, campaign: Campaign) -> None:
    client = token_client(alice)
    first = post(client, None, key="k", raw=b'{"campaign":"winter"}')
    assert first.status_code == 202
    for raw in (b'{ "campaign" : "winter" }', b'\n{\n  "campaign": "winter"\n}\n', b'{"campaign":"w\\u0069nter"}'):
        again = post(client, None, key="k", raw=raw)
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"], raw
    assert post(client, None, key="k", raw=b'{"campaign": "winter", "campaign": "winter"}').status_code == 200
    Campaign.objects.create(slug="spring", name="Spring", stock=5)
    assert post(client, {"campaign": "spring"}, key="k").status_code == 422
    assert Execution.objects.count() == 1 and ClientRequest.objects.count() == 1


def test_key_order_does_not_change_the_request() -> None:
    """Two keys in either order: the reconciliation body, under one Idempotency-Key."""
    ops = operator_client("run_jobdefinition")
    headers = {"HTTP_IDEMPOTENCY_KEY": "day-1"}
    url = "/api/reconciliations/"
    first = ops.post(url, data='{"day": "2026-11-01", "shards": 2}', content_type="application/json", **headers)
    assert first.status_code == 202
    again = ops.post(url, data='{"shards":2,"day":"2026-11-01"}', content_type="application/json", **headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = ops.post(url, data='{"shards": 3, "day": "2026-11-01"}', content_type="application/json", **headers)
    assert other.status_code == 422


def test_a_key_recorded_with_a_raw_body_fingerprint_still_matches_its_request(alice: User, campaign: Campaign) -> None:
    """Rows written before fingerprints were canonical hold a hash of the raw body."""
    import hashlib

    client = token_client(alice)
    raw = b'{ "campaign":   "winter" }'
    assert post(client, None, key="old", raw=raw).status_code == 202
    ClientRequest.objects.filter(key="old").update(
        fingerprint=hashlib.sha256(b"POST /api/coupons/\n" + raw).hexdigest()
    )
    assert post(client, None, key="old", raw=raw).status_code == 200
    assert post(client, None, key="old", raw=b'{"campaign":"winter"}').status_code == 422


def test_the_same_key_for_a_different_request_is_refused(alice: User, campaign: Campaign) -> None:
    Campaign.objects.create(slug="spring", name="Spring", stock=5)
    client = token_client(alice)
    assert post(client, {"campaign": "winter"}, key="k").status_code == 202
    refused = post(client, {"campaign": "spring"}, key="k")
    assert refused.status_code == 422
    assert refused.json()["error"] == "idempotency_key_conflict"
    assert Execution.objects.count() == 1


@pytest.mark.parametrize(
    ("body", "raw", "headers", "fragment"),
    [
        (None, b"{not json", {}, "not valid JSON"),
        (None, b"", {}, "must be a JSON object"),
        (["winter"], None, {}, "must be a JSON object, not list"),
        ({}, None, {}, "'campaign' must be a campaign slug"),
        ({"campaign": 7}, None, {}, "'campaign' must be a campaign slug"),
        ({"campaign": "autumn"}, None, {}, "no campaign 'autumn'"),
        ({"campaign": "winter", "user": 1}, None, {}, "unknown field(s): user"),
        ({"campaign": "winter"}, None, {"HTTP_IDEMPOTENCY_KEY": "x" * 201}, "Idempotency-Key must be"),
        (None, b"[" * 5000 + b"]" * 5000, {}, "nests too deeply"),
        # Strings json.loads accepts but UTF-8 (a lone surrogate) or PostgreSQL (NUL) cannot hold.
        (None, b'{"campaign": "\\ud800"}', {}, "$.campaign holds a lone surrogate"),
        (None, b'{"campaign": "winter", "\\udfff": 1}', {}, "a key in $ holds a lone surrogate"),
        (None, b'{"campaign": ["a", {"b": "x\\udc00y"}]}', {}, "$.campaign[1].b holds a lone surrogate"),
        (None, b'{"campaign": "win\\u0000ter"}', {}, "holds a NUL character"),
        # Python's json takes NaN/Infinity and turns 1e999 into inf; none of them is JSON.
        (None, b'{"campaign": NaN}', {}, "NaN is not a JSON value"),
        (None, b'{"campaign": -Infinity}', {}, "-Infinity is not a JSON value"),
        (None, b'{"campaign": 1e999}', {}, "too large for a float"),
    ],
)
@pytest.mark.scenario(36)
def test_bad_input_is_a_400_with_a_message_and_records_nothing(
    alice: User, campaign: Campaign, body: Any, raw: bytes | None, headers: dict[str, str], fragment: str, figures: Any
) -> None:
    client = token_client(alice)
    data = raw if raw is not None else json.dumps(body)
    response = client.post(URL, data=data, content_type="application/json", **headers)
    figures.record(refused=int(response.status_code == 400), rows_written=Execution.objects.count())
    assert response.status_code == 400
    assert fragment in response.json()["detail"]
    assert not Execution.objects.exists() and not ClientRequest.objects.exists()


@pytest.mark.scenario(36)
def test_an_oversized_body_is_a_413_and_records_nothing(alice: User, campaign: Campaign, settings: Any) -> None:
    settings.TASKPLATFORM_MAX_ARGS_BYTES = 1024
    response = post(token_client(alice), {"campaign": "winter", "padding": "x" * 2000})
    assert response.status_code == 413
    assert response.json()["error"] == "payload_too_large"
    assert not Execution.objects.exists()


def test_a_session_request_needs_its_csrf_token(alice: User, campaign: Campaign) -> None:
    browser = Client(enforce_csrf_checks=True)
    browser.login(username="alice", password="pw-alice")
    assert post(browser, {"campaign": "winter"}).status_code == 403
    browser.get("/admin/login/")  # any page that sets the CSRF cookie
    token = browser.cookies["csrftoken"].value
    response = browser.post(URL, data=json.dumps({"campaign": "winter"}), content_type="application/json",
                            HTTP_X_CSRFTOKEN=token)  # fmt: skip
    assert response.status_code == 202


def operator_client(*codenames: str, username: str = "ops") -> Client:
    """An API client for a staff user holding the given ``taskplatform`` permissions."""
    user = User.objects.create_user(username, is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="taskplatform", codename__in=codenames)
    )
    return token_client(user)


def test_an_execution_is_visible_to_its_requester_and_operators_who_may_view_executions_only(
    alice: User, campaign: Campaign
) -> None:
    created = post(token_client(alice), {"campaign": "winter"}).json()
    bob = User.objects.create_user("bob")
    location = f"/api/executions/{created['id']}"
    assert token_client(bob).get(location).status_code == 404
    # Staff without the permission: the admin shows them no execution, neither does the API.
    assert operator_client(username="bare-staff").get(location).status_code == 404
    assert operator_client("run_jobdefinition", username="runner").get(location).status_code == 404
    assert operator_client("view_execution").get(location).status_code == 200
    superuser = User.objects.create_superuser("root")
    assert token_client(superuser).get(location).status_code == 200
    assert token_client(alice).get(location).json()["state"] in {"PENDING", "RUNNING", "SUCCEEDED"}
    assert token_client(alice).get("/api/executions/999999").status_code == 404


def test_a_burst_of_1000_requests_for_100_coupons_issues_exactly_100(workers: Any) -> None:
    """400 users ask 2 or 3 times each (1,000 requests, 32 at a time) for 100 coupons."""
    workers.start(concurrency=4)
    Campaign.objects.create(slug="flash", name="Flash sale", stock=100)
    users = User.objects.bulk_create(User(username=f"u{i}") for i in range(400))
    raws = [ApiToken.issue(u, "burst")[1] for u in users]
    requests = [raws[i % 400] for i in range(1000)]

    def ask(raw: str) -> int:
        try:
            client = Client(HTTP_AUTHORIZATION=f"Token {raw}")
            return int(post(client, {"campaign": "flash"}).status_code)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=32) as pool:
        statuses = list(pool.map(ask, requests))
    assert statuses.count(202) == 400 and statuses.count(200) == 600

    executions = Execution.objects.filter(task_name="tasks.issue_coupon")
    wait_for(lambda: not executions.exclude(state="SUCCEEDED").exists(), timeout=120, what="every request to run")
    assert executions.count() == 400
    assert Coupon.objects.count() == 100
    assert not Coupon.objects.values("user").annotate(n=Count("id")).filter(n__gt=1).exists()
    assert Campaign.objects.get().stock == 0
    results: list[dict[str, Any]] = list(executions.values_list("result", flat=True))
    assert sum(r["issued"] for r in results) == 100
    assert sum(r.get("reason") == "sold out" for r in results) == 300


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"day": "yesterday"}, "'day' must be a date"),
        ({}, "'day' must be a date"),
        ({"day": "2999-01-01"}, "has not ended yet"),
        ({"day": "2026-11-01", "shards": 0}, "'shards' must be an integer from 1 to 64"),
        ({"day": "2026-11-01", "shards": True}, "'shards' must be an integer"),
        ({"day": "2026-11-01", "extra": 1}, "unknown field(s): extra"),
        # Other ISO 8601 spellings date.fromisoformat accepts: only YYYY-MM-DD is documented.
        ({"day": "20261101"}, "'day' must be a date, YYYY-MM-DD"),
        ({"day": "2026-W44-7"}, "'day' must be a date, YYYY-MM-DD"),
        ({"day": "2026W447"}, "'day' must be a date, YYYY-MM-DD"),
        ({"day": "2026-11-01 "}, "'day' must be a date, YYYY-MM-DD"),
        ({"day": "\uff12\uff10\uff12\uff16-11-01"}, "'day' must be a date, YYYY-MM-DD"),  # full-width digits
        ({"day": "2026-02-30"}, "'day' must be a date, YYYY-MM-DD"),
    ],
)
def test_reconciliation_requests_are_validated(body: dict[str, Any], fragment: str) -> None:
    ops = operator_client("run_jobdefinition")
    response = ops.post("/api/reconciliations/", data=json.dumps(body), content_type="application/json")
    assert response.status_code == 400 and fragment in response.json()["detail"]
    assert not Execution.objects.exists()


def test_operator_endpoints_are_for_staff_and_a_rerun_of_a_day_resumes_it(workers: Any) -> None:
    workers.start(concurrency=2)
    alice = token_client(User.objects.create_user("alice"))
    ops = operator_client("run_jobdefinition", "view_execution")
    body = json.dumps({"day": "2026-11-01", "shards": 2})
    forbidden = alice.post("/api/reconciliations/", data=body, content_type="application/json")
    assert forbidden.status_code == 403
    assert alice.post("/api/inventory/sync", data="{}", content_type="application/json").status_code == 403

    first = ops.post("/api/reconciliations/", data=body, content_type="application/json")
    assert first.status_code == 202
    wait_for(
        lambda: Execution.objects.filter(task_name="tasks.reconcile_payment_shard", state="SUCCEEDED").count() == 2,
        timeout=60,
        what="both shards",
    )
    again = ops.post("/api/reconciliations/", data=body, content_type="application/json")
    assert again.status_code == 202  # a new run of the day (no Idempotency-Key) ...
    run = again.json()["id"]
    done = wait_for(lambda: (r := ops.get(f"/api/executions/{run}").json())["state"] == "SUCCEEDED" and r, timeout=60,
                    what="the re-run")  # fmt: skip
    assert done["result"]["submitted"] == 0  # ... which finds both shards done
    assert Execution.objects.filter(task_name="tasks.reconcile_payment_shard").count() == 2


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/api/reconciliations/", {"day": "2026-11-01", "shards": 2}),
        ("/api/inventory/sync", {}),
    ],
)
def test_starting_operator_jobs_needs_the_run_permission_not_just_staff(url: str, body: dict[str, Any]) -> None:
    """A staff user the admin refuses everything is refused here too; "Run now" rights start jobs."""
    for client in (
        operator_client(username="bare-staff"),
        operator_client("view_execution", "view_jobdefinition", username="viewer"),
    ):
        response = client.post(url, data=json.dumps(body), content_type="application/json")
        assert response.status_code == 403 and "run_jobdefinition" in response.json()["detail"]
    assert not Execution.objects.exists()
    allowed = operator_client("run_jobdefinition").post(url, data=json.dumps(body), content_type="application/json")
    assert allowed.status_code == 202
    # The permission without staff status: the admin would not let them in either.
    outsider = User.objects.create_user("outsider")
    outsider.user_permissions.add(Permission.objects.get(codename="run_jobdefinition"))
    refused = token_client(outsider).post(url, data=json.dumps(body), content_type="application/json")
    assert refused.status_code == 403


def test_metrics_need_the_view_execution_permission_not_just_staff() -> None:
    for username, codenames, status in (("bare", (), 401), ("runner", ("run_jobdefinition",), 401),
                                        ("viewer", ("view_execution",), 200)):  # fmt: skip
        user = User.objects.create_user(username, password="pw", is_staff=True)
        user.user_permissions.add(
            *Permission.objects.filter(content_type__app_label="taskplatform", codename__in=codenames)
        )
        browser = Client()
        browser.login(username=username, password="pw")
        assert browser.get("/metrics").status_code == status, username


def test_the_sites_root_leads_to_the_console_not_a_404() -> None:
    """The admin's "View site" link points at ``/``: it must open the console (the login page
    for an anonymous visitor), not Django's 404 page."""
    response = Client().get("/", follow=True)
    assert response.status_code == 200
    assert response.redirect_chain and response.redirect_chain[0][0] == "/admin/"
