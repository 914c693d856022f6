"""Structured logs: every platform line names its execution, key and fencing token."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from taskplatform import submit
from taskplatform.core.publisher import HEADER_EXECUTION
from taskplatform.models import Execution
from taskplatform.observability.logs import ExecutionContextFilter, JsonFormatter
from tests.helpers import state_of, wait_for
from tests.testapp.tasks import log_line

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ExecutionContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("taskplatform")
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)


def parsed(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_body_and_platform_lines_carry_the_execution(json_lines: io.StringIO) -> None:
    execution = submit(log_line, on_commit=False)
    log_line.apply(task_id=execution.celery_task_id, headers={HEADER_EXECUTION: execution.pk})
    log_line.apply(task_id="a-duplicate-delivery", headers={HEADER_EXECUTION: execution.pk})
    lines = parsed(json_lines)
    body = next(line for line in lines if line["message"] == "inside the body")
    absorbed = next(line for line in lines if line["message"].startswith("delivery absorbed"))
    for line in (body, absorbed):
        assert line["execution_id"] == execution.pk
        assert line["idempotency_key"] == execution.idempotency_key
        assert line["level"] and line["ts"] and line["logger"].startswith("taskplatform")
    assert body["fencing_token"] == 1
    assert absorbed["fencing_token"] is None, "an absorbed duplicate holds no token of its own"


def test_outside_an_execution_the_fields_are_present_and_empty(json_lines: io.StringIO) -> None:
    logging.getLogger("taskplatform.test").warning("no execution here", extra={"detail": 7})
    (line,) = parsed(json_lines)
    assert line["execution_id"] is None and line["idempotency_key"] is None and line["fencing_token"] is None
    assert line["detail"] == 7


def test_a_real_worker_writes_json_lines_with_the_execution(workers: Any) -> None:
    worker = workers.start(concurrency=1, env={"TASKPLATFORM_LOG_FORMAT": "json"})
    execution = submit(log_line, kwargs={"text": "worker says hello"})
    wait_for(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="the task")
    execution = Execution.objects.get(pk=execution.pk)

    def the_line() -> dict[str, Any] | None:
        for raw in worker.log().splitlines():
            if raw.startswith("{") and json.loads(raw)["message"] == "worker says hello":
                return dict(json.loads(raw))
        return None

    line = wait_for(the_line, timeout=10, what="the body's line in the worker log")
    assert (line["execution_id"], line["idempotency_key"], line["fencing_token"]) == (
        execution.pk,
        execution.idempotency_key,
        execution.fencing_token,
    )


def test_celerys_own_lines_about_a_task_carry_its_execution(workers: Any) -> None:
    """Celery writes "received" (in the worker's main process, before any claim) and
    "succeeded in" (after the body's context has closed): both name the execution, for a
    submitted execution and for a plain ``.delay()`` whose row the worker creates."""
    worker = workers.start(concurrency=1, env={"TASKPLATFORM_LOG_FORMAT": "json"})
    submitted = submit(log_line, kwargs={"text": "submitted"})
    delayed = log_line.delay(text="delayed")
    wait_for(lambda: state_of(submitted.pk) == "SUCCEEDED", timeout=60, what="the submitted task")
    row = wait_for(
        lambda: Execution.objects.filter(celery_task_id=delayed.id, state="SUCCEEDED").first(),
        timeout=60,
        what="the delayed task",
    )

    def celery_lines(task_id: str) -> dict[str, dict[str, Any]] | None:
        found: dict[str, dict[str, Any]] = {}
        for raw in worker.log().splitlines():
            if not raw.startswith("{"):
                continue
            line = json.loads(raw)
            if task_id in line["message"] and line["logger"].startswith("celery"):
                for kind in ("received", "succeeded"):
                    if f" {kind}" in line["message"]:
                        found[kind] = line
        return found if len(found) == 2 else None

    lines = wait_for(lambda: celery_lines(submitted.celery_task_id), timeout=10, what="Celery's lines")
    for kind in ("received", "succeeded"):
        assert lines[kind]["execution_id"] == submitted.pk, (kind, lines[kind])
        assert lines[kind]["idempotency_key"] == submitted.idempotency_key
    assert lines["succeeded"]["fencing_token"] == 1
    lines = wait_for(lambda: celery_lines(delayed.id), timeout=10, what="Celery's lines for .delay()")
    assert lines["succeeded"]["execution_id"] == row.pk and lines["succeeded"]["fencing_token"] == 1
