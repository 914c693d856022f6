"""Structured logging: every line carries the execution it is about.

While a worker runs an execution (and while the beat leader publishes), a context holds the
execution id, idempotency key and fencing token. ``ExecutionContextFilter`` copies them onto
every log record that passes a handler it is attached to (``None`` outside an execution;
explicit ``extra={...}`` values win), so the platform's lines and the task body's own lines
can be joined to the ledger. ``JsonFormatter`` writes one JSON object per line.

Celery's own lines about a task ("received", "succeeded in", "retry", "raised") are written
outside that context, but carry the Celery task id (``record.data["id"]``): the worker
remembers which execution each recent task id is for (``remember_task``: from the message's
header when it arrives, from the claim when it runs), and the filter fills those lines in.

``config/settings/base.py`` wires both (``TASKPLATFORM_LOG_FORMAT=json|plain``), and
the app (``apps.structured_celery_logs``, on Celery's ``after_setup_logger``) applies them to
Celery's own worker and beat handlers in any project.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from .. import tracing

#: The fields every record gets (``trace_id``: the current OpenTelemetry trace, with tracing on).
FIELDS = ("execution_id", "idempotency_key", "fencing_token", "trace_id")
#: A plain-text format that shows them.
PLAIN_FORMAT = (
    "%(asctime)s %(levelname)s %(name)s "
    "[execution=%(execution_id)s key=%(idempotency_key)s token=%(fencing_token)s trace=%(trace_id)s] %(message)s"
)

_context: ContextVar[dict[str, Any] | None] = ContextVar("taskplatform_log_context", default=None)

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


@contextmanager
def execution_context(
    execution_id: int | None = None, idempotency_key: str | None = None, fencing_token: int | None = None
) -> Iterator[None]:
    """Log lines inside this block carry these values."""
    token = _context.set(
        {"execution_id": execution_id, "idempotency_key": idempotency_key, "fencing_token": fencing_token}
    )
    try:
        yield
    finally:
        _context.reset(token)


#: Celery task id -> the execution fields, for this process's most recent deliveries.
_BY_TASK_ID: OrderedDict[str, dict[str, Any]] = OrderedDict()
_BY_TASK_ID_LOCK = threading.Lock()
#: How many task ids a process remembers (a few hundred bytes each).
REMEMBERED_TASKS = 10_000


def remember_task(
    task_id: str,
    execution_id: int,
    idempotency_key: str | None = None,
    fencing_token: int | None = None,
    trace_id: str | None = None,
) -> None:
    """Celery's lines about ``task_id`` carry these execution fields (see the module doc)."""
    fields = {
        "execution_id": execution_id,
        "idempotency_key": idempotency_key,
        "fencing_token": fencing_token,
        "trace_id": trace_id,
    }
    with _BY_TASK_ID_LOCK:
        _BY_TASK_ID[task_id] = fields
        _BY_TASK_ID.move_to_end(task_id)
        while len(_BY_TASK_ID) > REMEMBERED_TASKS:
            _BY_TASK_ID.popitem(last=False)


def _for_task(record: logging.LogRecord) -> dict[str, Any] | None:
    data = getattr(record, "data", None)
    task_id = data.get("id") if isinstance(data, dict) else None
    return _BY_TASK_ID.get(task_id) if isinstance(task_id, str) else None


def current_context() -> dict[str, Any]:
    return dict(_context.get() or dict.fromkeys(FIELDS))


class ExecutionContextFilter(logging.Filter):
    """Adds ``execution_id``, ``idempotency_key`` and ``fencing_token`` to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _context.get() or _for_task(record) or {}
        for name in FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, context.get(name))
        if record.trace_id is None and tracing.ACTIVE:  # type: ignore[attr-defined]
            record.trace_id = tracing.current_trace_id()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the execution fields, extras."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            payload[name] = getattr(record, name, None)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in payload:
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def formatter(kind: str) -> logging.Formatter:
    """The formatter for ``TASKPLATFORM_LOG_FORMAT`` (``json`` or ``plain``)."""
    if kind == "json":
        return JsonFormatter()
    if kind == "plain":
        return logging.Formatter(PLAIN_FORMAT)
    raise ValueError(f"TASKPLATFORM_LOG_FORMAT must be 'json' or 'plain', not {kind!r}")


def apply_to(logger: logging.Logger, kind: str, *, only_celerys: bool = False) -> None:
    """Give every handler of ``logger`` the context filter and the chosen formatter. With
    ``only_celerys``, a handler keeps a formatter of the host's own (a JSON one for its log
    shipper, say, or Celery's formatter with the host's ``CELERY_WORKER_LOG_FORMAT``): only
    Celery's formatter with Celery's default format, or none, is replaced."""
    for handler in logger.handlers:
        if not any(isinstance(f, ExecutionContextFilter) for f in handler.filters):
            handler.addFilter(ExecutionContextFilter())
        if not only_celerys or is_celerys_default(handler.formatter):
            handler.setFormatter(formatter(kind))


def is_celerys_default(fmt: logging.Formatter | None) -> bool:
    """No formatter, or Celery's own with its default worker or task format. Every formatter
    Celery installs is a ``ColorFormatter``, whatever format the host gave it
    (``CELERY_WORKER_LOG_FORMAT``), so the class alone does not tell a host's choice apart."""
    from celery.app.defaults import DEFAULT_PROCESS_LOG_FMT, DEFAULT_TASK_LOG_FMT  # type: ignore[attr-defined]
    from celery.utils.log import ColorFormatter

    if fmt is None:
        return True
    return isinstance(fmt, ColorFormatter) and fmt._fmt in (DEFAULT_PROCESS_LOG_FMT, DEFAULT_TASK_LOG_FMT)
