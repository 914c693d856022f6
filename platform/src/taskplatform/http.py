"""Helpers for views that submit work from an HTTP request.

- ``json_body(request)``: the request's JSON object, or ``HttpError`` 413 (too large, checked
  before the body is read) / 400 (not JSON, not an object, ``NaN``/``Infinity`` or a number
  too large for a float, a string with a lone surrogate or a NUL).
- ``unstorable_text(value)``: why a JSON value holds a string that cannot be stored or
  published (a lone surrogate such as ``"\\ud800"``, a NUL), or None.
- ``canonical_json(value)``: one spelling of a JSON value (sorted keys, no whitespace), to
  compare two request bodies that differ only in formatting.
- ``error_response(exc)``: a ``JsonResponse`` for an ``HttpError`` or a ``SubmissionError``
  (400 bad input, 404 unknown task, 413 too large, 422 an idempotency key reused for other
  work), with ``{"error": code, "detail": message}``.
- ``execution_payload(execution)``: what a client may see of an execution: state, attempts,
  times, result or last error, and its event history.

Views stay thin: validate, ``submit_or_get()``, answer ``202 Accepted`` with a ``Location``
for a new execution or ``200 OK`` for an existing one (``submission_response``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from django.http import HttpRequest, JsonResponse

from .conf import platform_settings
from .exceptions import (
    IdempotencyKeyConflictError,
    InvalidArgumentsError,
    InvalidIdempotencyKeyError,
    PayloadTooLargeError,
    SubmissionError,
    UnknownTaskError,
)
from .models import Execution

#: The request header carrying the client's idempotency key.
IDEMPOTENCY_HEADER = "Idempotency-Key"


class HttpError(Exception):
    """An error answered with ``status`` and a JSON body ``{"error": code, "detail": detail}``."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


def json_body(request: HttpRequest, *, max_bytes: int | None = None) -> dict[str, Any]:
    """The request body as a JSON object; 413 above ``max_bytes`` (default: the args limit)."""
    limit = max_bytes if max_bytes is not None else platform_settings().max_args_bytes
    declared = request.META.get("CONTENT_LENGTH") or "0"
    try:
        length = int(declared)
    except ValueError:
        raise HttpError(400, "bad_request", f"invalid Content-Length {declared!r}") from None
    if length > limit:
        raise HttpError(413, "payload_too_large", f"the body has {length} bytes; the limit is {limit}")
    body = request.body
    if len(body) > limit:
        raise HttpError(413, "payload_too_large", f"the body has {len(body)} bytes; the limit is {limit}")
    if not body.strip():
        raise HttpError(400, "invalid_json", "the body must be a JSON object")
    try:
        data = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise HttpError(400, "invalid_json", "the body nests too deeply") from None
    if not isinstance(data, dict):
        raise HttpError(400, "invalid_json", f"the body must be a JSON object, not {type(data).__name__}")
    problem = unstorable_text(data)
    if problem is not None:
        # Refused here, before anything is written: later the database driver, the broker
        # or even the debug error page would fail on it (a 500, or a row no page can show).
        raise HttpError(400, "invalid_json", problem)
    return data


def _refuse_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259); Python accepts them."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """A JSON number as a float; ``1e999`` would silently become ``inf``, which is refused."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]}{'...' if len(text) > 40 else ''} is too large for a float")
    return value


def unstorable_text(value: Any) -> str | None:
    """Why ``value`` (decoded JSON) cannot be stored or published, or None if it can.

    Two kinds of string survive ``json.loads`` but not the trip to the database or broker:
    a lone surrogate (an escape like ``"\\ud800"`` without its pair), which UTF-8 cannot
    encode, so the driver, the broker and even Django's debug page fail on it; and U+0000,
    which PostgreSQL refuses in text and ``jsonb``. Keys are checked too. The walk is
    iterative, so deep nesting (which ``json.loads`` accepted) cannot overflow the stack.
    """
    from .core.validation import text_problem  # the ledger's rule for results too

    stack: list[tuple[str, Any]] = [("$", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                return f"{_short(path)} {problem}"
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                name = key if isinstance(key, str) else str(key)
                problem = text_problem(name)
                if problem:
                    return f"a key in {_short(path)} {problem}"
                children.append((f"{path}.{name}", child))
            stack.extend(reversed(children))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed([(f"{path}[{i}]", child) for i, child in enumerate(item)]))
    return None


def _short(path: str) -> str:
    return path if len(path) <= 120 else f"{path[:117]}..."


def canonical_json(value: Any) -> str:
    """``value`` spelt one way: sorted keys, no whitespace, ASCII (for fingerprints)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def idempotency_key_of(request: HttpRequest) -> str | None:
    """The client's ``Idempotency-Key`` header (stripped), None if absent; 400 if malformed."""
    raw = request.headers.get(IDEMPOTENCY_HEADER)
    if raw is None:
        return None
    key = raw.strip()
    if not key or len(key) > 200 or not key.isprintable():
        raise HttpError(400, "invalid_idempotency_key", "Idempotency-Key must be 1 to 200 printable characters")
    return key


_SUBMISSION_STATUS: list[tuple[type[SubmissionError], int, str]] = [
    (PayloadTooLargeError, 413, "payload_too_large"),
    (IdempotencyKeyConflictError, 422, "idempotency_key_conflict"),
    (UnknownTaskError, 404, "unknown_task"),
    (InvalidIdempotencyKeyError, 400, "invalid_idempotency_key"),
    (InvalidArgumentsError, 400, "invalid_arguments"),
    (SubmissionError, 400, "bad_request"),
]


def error_response(exc: HttpError | SubmissionError) -> JsonResponse:
    if isinstance(exc, HttpError):
        return JsonResponse({"error": exc.code, "detail": exc.detail}, status=exc.status)
    for kind, status, code in _SUBMISSION_STATUS:
        if isinstance(exc, kind):
            return JsonResponse({"error": code, "detail": str(exc)}, status=status)
    raise TypeError(f"not an HTTP-mappable error: {exc!r}")  # pragma: no cover - the list ends with the base


def execution_payload(execution: Execution, *, events: bool = True) -> dict[str, Any]:
    """A client's view of an execution (no arguments: they may hold other users' data)."""
    payload: dict[str, Any] = {
        "id": execution.pk,
        "task": execution.task_name,
        "idempotency_key": execution.idempotency_key,
        "state": execution.state,
        "attempts": execution.attempts,
        "trigger": execution.trigger,
        "created_at": execution.created_at,
        "started_at": execution.started_at,
        "finished_at": execution.finished_at,
        "result": execution.result,
        "error": execution.last_error or None,
    }
    if events:
        payload["events"] = [
            {"at": e.at, "kind": e.kind, "from": e.from_state, "to": e.to_state, "attempt": e.attempt}
            for e in execution.events.order_by("id")
        ]
    return payload


def submission_response(execution: Execution, *, created: bool, location: str) -> JsonResponse:
    """``202`` with ``Location`` for a new execution, ``200`` for one that already existed."""
    response = JsonResponse(execution_payload(execution, events=not created), status=202 if created else 200)
    response["Location"] = location
    return response
