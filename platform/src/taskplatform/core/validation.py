"""Validation at the edge: nothing invalid reaches the ledger or the broker.

Used by ``submit()``, the jobs service and the console's job form, so every entry point
gives the same clear message for the same mistake.

A task counts as an ``IdempotentTask`` by its marker attribute (``IDEMPOTENT_MARKER``), not by
``isinstance``: the core never imports the worker layer that defines the class.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..conf import platform_settings
from ..exceptions import (
    InvalidArgumentsError,
    InvalidIdempotencyKeyError,
    NotIdempotentTaskError,
    PayloadTooLargeError,
    UnknownTaskError,
)

if TYPE_CHECKING:
    from celery import Task

#: Class attribute set (True) on ``worker.task.IdempotentTask``: how the core and the beat
#: recognise a task that runs under the ledger without importing the worker layer.
IDEMPOTENT_MARKER = "taskplatform_idempotent"


def is_idempotent(task: object) -> bool:
    """True for an ``IdempotentTask`` (a task that claims its ledger row before running)."""
    return getattr(task, IDEMPOTENT_MARKER, False) is True


def registered_task(name: str) -> Task | None:
    """The task registered under ``name`` with the current Celery app, or None."""
    from celery import current_app

    if name not in current_app.tasks:
        # Outside a worker (a web process, a shell, the beat) the apps' tasks modules may
        # not be imported yet; Celery imports them on this call, as a worker does at start.
        current_app.loader.import_default_modules()
    return current_app.tasks.get(name)


def resolve_task(task_or_name: Task | str) -> Any:
    """The registered ``IdempotentTask`` for a task object or name, or a clear error."""
    name = task_or_name if isinstance(task_or_name, str) else getattr(task_or_name, "name", None)
    if not isinstance(name, str) or not name:
        raise UnknownTaskError(f"not a task or task name: {task_or_name!r}")
    task = registered_task(name)
    if task is None:
        raise UnknownTaskError(
            f"unknown task {name!r}: no task of this name is registered with the Celery app "
            f"(is its module imported, e.g. listed in an installed app's tasks.py?)",
            task=name,
        )
    if not is_idempotent(task):
        raise NotIdempotentTaskError(
            f"task {name!r} does not use taskplatform.tasks.IdempotentTask as its base; "
            f"declare it with @shared_task(base=IdempotentTask, bind=True)",
            task=name,
        )
    return task


def encode_arguments(args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any], int]:
    """Check that args/kwargs are plain JSON and within the size limit.

    Returns the normalised ``(args, kwargs, size_in_bytes)``. The rule is strict JSON
    (no datetime, Decimal or custom objects) so what the ledger stores is exactly what the
    worker receives.
    """
    if args is None:
        args = []
    if kwargs is None:
        kwargs = {}
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise InvalidArgumentsError(f"args must be a list or tuple, not {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise InvalidArgumentsError(f"kwargs must be a dict, not {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise InvalidArgumentsError(f"kwargs keys must be strings, got {key!r}")
    args, kwargs = list(args), dict(kwargs)
    try:
        encoded = json.dumps([args, kwargs], allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentsError(
            f"task arguments must be JSON values (str, int, float, bool, None, list, dict): {exc}"
        ) from exc
    size = len(encoded.encode())
    limit = platform_settings().max_args_bytes
    if size > limit:
        raise PayloadTooLargeError(
            f"task arguments are {size} bytes encoded; the limit is {limit} bytes "
            f"(TASKPLATFORM_MAX_ARGS_BYTES). Pass a reference (an id) instead of the data.",
            size=size,
            limit=limit,
        )
    return args, kwargs, size


def check_idempotency_key(key: object) -> str:
    """Return ``key`` if it is a usable idempotency key, else raise."""
    limit = platform_settings().max_key_length
    if not isinstance(key, str):
        raise InvalidIdempotencyKeyError(f"idempotency key must be a string, not {type(key).__name__}")
    if not key.strip():
        raise InvalidIdempotencyKeyError("idempotency key must not be empty")
    if len(key) > limit:
        raise InvalidIdempotencyKeyError(f"idempotency key is {len(key)} characters; the limit is {limit}")
    return key


def text_problem(text: str) -> str:
    """What makes ``text`` unstorable in a database's text or JSON, or ""."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate (a \\uD800-\\uDFFF escape not in a pair), which is not text"
    if "\x00" in text:
        return "holds a NUL character (\\u0000), which databases do not store in text"
    return ""


def _first_text_problem(value: Any) -> str:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                return problem
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return ""


def encode_result(value: Any, *, copy: bool = False) -> tuple[Any, str | None]:
    """The JSON value to store as a result, or ``(None, why not)`` if it cannot be stored.

    ``copy``: a copy of the value as JSON reads it back, for a write that happens later on
    another thread (a shared object the caller changes meanwhile must not change the result)."""
    try:
        encoded = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        return None, f"result not stored: not a JSON value ({exc})"
    # PostgreSQL's jsonb refuses both (and the statement that carries the success with the next
    # claim would fail with it): looked for only when the JSON text has an escape of the kind.
    if "\\u0000" in encoded or "\\ud" in encoded:
        problem = _first_text_problem(value)
        if problem:
            return None, f"result not stored: a string in it {problem}"
    limit = platform_settings().max_result_bytes
    if len(encoded.encode()) > limit:
        return None, f"result not stored: {len(encoded)} bytes exceeds TASKPLATFORM_MAX_RESULT_BYTES={limit}"
    return (json.loads(encoded) if copy else value), None
