"""JSON endpoints that submit the reference jobs from a request, and report on executions.

Authentication: a session (the admin login; CSRF enforced) or an API token,
``Authorization: Token <key>`` (``manage.py issue_api_token <user> <name>``; CSRF does not
apply to token requests). Anonymous requests get ``401``.

``POST`` endpoints take an optional ``Idempotency-Key`` header, scoped to the user. The first
request with a key answers ``202 Accepted`` with ``Location: /api/executions/<id>``; the same
request again answers ``200 OK`` with the same execution (the same JSON however it is
formatted: whitespace and key order do not matter); the same key on a different request
is ``422``. Invalid input is ``400`` with a message, a body above
``TASKPLATFORM_MAX_ARGS_BYTES`` is ``413``; nothing is recorded in either case.

Operator endpoints use the admin's permissions, not ``is_staff`` alone: starting a
reconciliation or an inventory sync needs ``taskplatform.run_jobdefinition`` (the console's
"Run now"), reading another user's execution needs ``taskplatform.view_execution``. A user
without them gets ``403`` (``404`` for an execution), as the admin refuses them too.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from datetime import date
from functools import wraps
from typing import Any

from django.contrib.auth.models import AnonymousUser, User
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from taskplatform import submit_flow_or_get, submit_or_get
from taskplatform.exceptions import SubmissionError
from taskplatform.http import (
    HttpError,
    canonical_json,
    error_response,
    execution_payload,
    idempotency_key_of,
    json_body,
)
from taskplatform.http import submission_response as platform_submission_response
from taskplatform.models import Execution, FlowRun

from .models import ApiToken, Campaign, ClientRequest, StockItem, hash_token

View = Callable[..., HttpResponse]


def _unauthorized(detail: str) -> JsonResponse:
    response = JsonResponse({"error": "unauthorized", "detail": detail}, status=401)
    response["WWW-Authenticate"] = 'Token realm="api"'
    return response


def api_auth(view: View) -> View:
    """Session (with CSRF) or ``Authorization: Token <key>``; 401 otherwise."""

    @csrf_exempt
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        header = request.headers.get("Authorization", "")
        if header:
            scheme, _, raw = header.partition(" ")
            if scheme != "Token" or not raw.strip():
                return _unauthorized("use 'Authorization: Token <key>'")
            token = ApiToken.objects.select_related("user").filter(key_hash=hash_token(raw.strip())).first()
            if token is None or not token.user.is_active:
                return _unauthorized("unknown or revoked token")
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
            request.user = token.user
        elif isinstance(request.user, AnonymousUser) or not request.user.is_authenticated:
            return _unauthorized("log in or send an API token")
        else:  # a browser session: enforce CSRF as Django would for an unexempted view
            rejected = CsrfViewMiddleware(lambda r: HttpResponse()).process_view(request, view, args, kwargs)
            if rejected is not None:
                return rejected
        return view(request, *args, **kwargs)

    return wrapper


#: The permission to start operator jobs from the API (the console's "Run now" on a job).
RUN_PERMISSION = "taskplatform.run_jobdefinition"
#: The permission to read any execution (the console's execution list).
VIEW_EXECUTIONS_PERMISSION = "taskplatform.view_execution"
#: The one documented form of ``day``: ``date.fromisoformat`` also takes ``20261101``,
#: ``2026-W44-1`` and more, which would name the same day under another idempotency key.
DAY_FORMAT = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def _fingerprints(request: HttpRequest) -> tuple[str, str]:
    """The request's fingerprint over canonical JSON, and the raw-body one older rows hold.

    The same JSON sent again with other whitespace or key order is the same request (a
    client library may re-serialise it on retry), so the body is compared in canonical form.
    Rows written before that change hold a hash of the raw body; they are still honoured.
    """
    method = (request.method or "").encode()
    head = b"%s %s\n" % (method, request.path.encode())
    raw = hashlib.sha256(head + request.body).hexdigest()
    try:
        body = canonical_json(json.loads(request.body)).encode()
    except (ValueError, RecursionError):  # the views parse the body first; be safe anyway
        return raw, raw
    return hashlib.sha256(head + body).hexdigest(), raw


def _user(request: HttpRequest) -> User:
    """The authenticated user (``api_auth`` has turned anonymous requests away)."""
    assert isinstance(request.user, User)
    return request.user


def submit_for(request: HttpRequest, task: str, args: list[Any], kwargs: dict[str, Any]) -> HttpResponse:
    """Submit under the client's ``Idempotency-Key`` (if any) and answer 202 / 200 / 422."""
    client_key = idempotency_key_of(request)
    user = _user(request)
    if client_key is None:
        with transaction.atomic():
            execution, created = submit_or_get(task, args, kwargs, trigger="view")
            # Remember who asked, so they may read the execution back.
            ClientRequest.objects.get_or_create(
                user=user, key=f"auto:{execution.pk}", defaults={"fingerprint": "", "execution": execution}
            )
        return _respond(execution, created)
    fingerprint, raw_fingerprint = _fingerprints(request)
    for _attempt in range(2):  # a concurrent replay of the same key loses the insert race once
        previous = ClientRequest.objects.select_related("execution").filter(user=user, key=client_key).first()
        if previous is not None:
            if previous.fingerprint not in (fingerprint, raw_fingerprint):
                raise HttpError(
                    422, "idempotency_key_conflict",
                    f"Idempotency-Key {client_key!r} was used for a different request; use a new key",
                )  # fmt: skip
            return _respond(previous.execution, created=False)
        try:
            with transaction.atomic():
                execution, created = submit_or_get(task, args, kwargs, trigger="view")
                ClientRequest.objects.create(user=user, key=client_key, fingerprint=fingerprint, execution=execution)
            return _respond(execution, created)
        except IntegrityError:
            continue
    raise HttpError(409, "conflict", "concurrent requests with the same Idempotency-Key; retry")


def _respond(execution: Execution, created: bool) -> JsonResponse:
    return platform_submission_response(
        execution, created=created, location=reverse("api-execution", args=[execution.pk])
    )


def handles_errors(view: View) -> View:
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except (HttpError, SubmissionError) as exc:
            return error_response(exc)

    return wrapper


@require_POST
@api_auth
@handles_errors
def request_coupon(request: HttpRequest) -> HttpResponse:
    """``POST /api/coupons/`` ``{"campaign": "<slug>"}``: a coupon for the requesting user."""
    data = json_body(request)
    campaign = data.get("campaign")
    unknown = sorted(set(data) - {"campaign"})
    if unknown:
        raise HttpError(400, "invalid_arguments", f"unknown field(s): {', '.join(unknown)}")
    if not isinstance(campaign, str) or not campaign:
        raise HttpError(400, "invalid_arguments", "'campaign' must be a campaign slug (a non-empty string)")
    if not Campaign.objects.filter(slug=campaign).exists():
        raise HttpError(400, "invalid_arguments", f"no campaign {campaign!r}")
    return submit_for(request, "tasks.issue_coupon", [campaign, request.user.pk], {})


def _require_run_permission(request: HttpRequest) -> None:
    """Operators who may run jobs in the console may start them here; nobody else."""
    user = _user(request)
    if not (user.is_staff and user.has_perm(RUN_PERMISSION)):
        raise HttpError(403, "forbidden", f"operators with the {RUN_PERMISSION!r} permission only")


def _only(data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise HttpError(400, "invalid_arguments", f"unknown field(s): {', '.join(unknown)}")


@require_POST
@api_auth
@handles_errors
def request_reconciliation(request: HttpRequest) -> HttpResponse:
    """``POST /api/reconciliations/`` ``{"day": "YYYY-MM-DD", "shards": 4}`` (run permission): reconcile a day.

    Shards are keyed by day and shard count, so re-running a day resumes it: finished shards
    are not run again.
    """
    _require_run_permission(request)
    data = json_body(request)
    _only(data, {"day", "shards"})
    day, shards = data.get("day"), data.get("shards", 4)
    try:
        parsed = date.fromisoformat(day) if isinstance(day, str) and DAY_FORMAT.fullmatch(day) else None
    except ValueError:
        parsed = None
    if parsed is None:
        raise HttpError(400, "invalid_arguments", "'day' must be a date, YYYY-MM-DD")
    if parsed >= timezone.localdate():
        raise HttpError(400, "invalid_arguments", f"{parsed} has not ended yet; reconcile a past day")
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= 64:
        raise HttpError(400, "invalid_arguments", "'shards' must be an integer from 1 to 64")
    return submit_for(request, "tasks.reconcile_payments", [], {"day": parsed.isoformat(), "shards": shards})


@require_POST
@api_auth
@handles_errors
def request_inventory_sync(request: HttpRequest) -> HttpResponse:
    """``POST /api/inventory/sync`` ``{}`` (run permission): push stock levels downstream now."""
    _require_run_permission(request)
    _only(json_body(request), set())
    return submit_for(request, "tasks.sync_inventory", [], {})


@require_GET
@api_auth
def execution_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """``GET /api/executions/<id>``: state, result and events: the requester's own, or any
    for a staff user with ``taskplatform.view_execution`` (what the console's list needs)."""
    execution = Execution.objects.filter(pk=pk).first()
    user = _user(request)
    allowed = execution is not None and (
        (user.is_staff and user.has_perm(VIEW_EXECUTIONS_PERMISSION))
        or ClientRequest.objects.filter(user=user, execution=execution).exists()
    )
    if not allowed:
        return JsonResponse({"error": "not_found", "detail": f"no execution {pk} of yours"}, status=404)
    assert execution is not None
    return JsonResponse(execution_payload(execution))


ORDER_NUMBER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,39}")
#: The largest quantity or amount in cents an order may carry (the columns are 64-bit).
MAX_ORDER_VALUE = 10**12


def _flow_payload(run: FlowRun) -> dict[str, Any]:
    return {
        "flow": run.pk, "key": run.key, "state": run.state, "step": run.step, "failed_step": run.failed_step,
        "error": run.error, "results": run.results, "location": reverse("api-order", args=[run.input["order"]]),
    }  # fmt: skip


@require_POST
@api_auth
@handles_errors
def request_order(request: HttpRequest) -> HttpResponse:
    """``POST /api/orders/`` ``{"order", "sku", "quantity", "amount_cents", "campaign"}``: the
    order flow (reserve stock, capture payment, issue a coupon to the requesting user; on a
    failure, the steps done are undone). One run per order number: ``202`` when this request
    started it, ``200`` with the same run when it existed, ``422`` for the same order number
    with other contents."""
    data = json_body(request)
    _only(data, {"order", "sku", "quantity", "amount_cents", "campaign"})
    order, sku, campaign = data.get("order"), data.get("sku"), data.get("campaign")
    quantity, cents = data.get("quantity", 1), data.get("amount_cents")
    if not isinstance(order, str) or not ORDER_NUMBER.fullmatch(order):
        raise HttpError(400, "invalid_arguments", "'order' must be an order number (letters, digits, . _ -; 1-40)")
    if not isinstance(sku, str) or not StockItem.objects.filter(sku=sku).exists():
        raise HttpError(400, "invalid_arguments", f"no stock item {sku!r}")
    for name, value in (("quantity", quantity), ("amount_cents", cents)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_ORDER_VALUE:
            raise HttpError(400, "invalid_arguments", f"{name!r} must be a positive integer up to {MAX_ORDER_VALUE}")
    if not isinstance(campaign, str) or not Campaign.objects.filter(slug=campaign).exists():
        raise HttpError(400, "invalid_arguments", f"no campaign {campaign!r}")
    payload = {"order": order, "sku": sku, "quantity": quantity, "amount_cents": cents, "campaign": campaign,
               "user_id": _user(request).pk}  # fmt: skip
    try:
        run, created = submit_flow_or_get("order", key=f"order:{order}", input=payload)
    except SubmissionError as exc:
        if "other input" in str(exc):
            raise HttpError(422, "idempotency_key_conflict", f"order {order!r} exists with other contents") from exc
        raise
    body = _flow_payload(run)
    response = JsonResponse(body, status=202 if created else 200)
    response["Location"] = body["location"]
    return response


@require_GET
@api_auth
def order_detail(request: HttpRequest, order: str) -> HttpResponse:
    """``GET /api/orders/<order>``: the order flow's state, for whoever placed the order or a
    staff user who may view executions."""
    run = FlowRun.objects.filter(key=f"order:{order}", flow="order").first()
    user = _user(request)
    allowed = run is not None and (
        run.input.get("user_id") == user.pk or (user.is_staff and user.has_perm(VIEW_EXECUTIONS_PERMISSION))
    )
    if not allowed:
        return JsonResponse({"error": "not_found", "detail": f"no order {order!r} of yours"}, status=404)
    assert run is not None
    return JsonResponse(_flow_payload(run))
