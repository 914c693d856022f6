"""The request class of ``IdempotentTask`` (Celery's ``Task.Request``).

Celery's worker logs "Task … received" as it builds the request, in its main process, before
any execution context exists. ``LedgerRequest`` remembers the execution a message names (its
``tp_execution`` header, set by ``submit()``, the beat and the rescuer) so that line, and the
others Celery writes about the task, carry the execution's fields
(``observability.logs.remember_task``).
"""

from __future__ import annotations

from typing import Any

from celery.worker.request import Request

from ..core.publisher import HEADER_EXECUTION, HEADER_KEY, forwarded
from ..observability.logs import remember_task


class LedgerRequest(Request):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        headers: dict[str, Any] = self._request_dict  # type: ignore[attr-defined]  # Celery's own
        execution_id = headers.get(HEADER_EXECUTION)
        if (
            isinstance(execution_id, int)
            and not isinstance(execution_id, bool)
            and not forwarded(headers, self.id)  # not a parent's, passed on to a child
        ):
            key = headers.get(HEADER_KEY)
            parent = headers.get("traceparent")  # put there by Celery's OpenTelemetry instrumentation
            trace_id = parent.split("-")[1] if isinstance(parent, str) and parent.count("-") == 3 else None
            remember_task(self.id, execution_id, key if isinstance(key, str) else None, trace_id=trace_id)
