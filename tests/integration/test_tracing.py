"""OpenTelemetry tracing (``TASKPLATFORM_TRACING``): one trace from the caller through
``submit()``, every publication and every attempt, retries and rescues as spans of it.

The caller's side (a stand-in for a view's span, ``submit()``, the first publication, the
rescuer's republication) runs in this process and is read from the SDK's in-memory exporter;
the worker, a real ``celery worker`` started with ``TASKPLATFORM_TRACING=console``, prints its
spans as JSON lines on its standard output, read after it stopped. The two halves are joined
by span ids into one tree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db.models.functions import Now

from taskplatform import submit, submit_many, tracing
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution
from tests.conftest import broker_url, redis_flushdb
from tests.helpers import state_of
from tests.testapp.models import EffectRaw

pytestmark = [pytest.mark.worker]

TASK = "testapp.fails_then_succeeds"


@pytest.fixture
def memory_spans() -> Iterator[Any]:
    """This process traced (``provided`` mode) into an in-memory exporter; off again afterwards."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.setup("provided")
    try:
        yield exporter
    finally:
        tracing.stop()
        exporter.shutdown()


def _node(name: str, span_id: str, parent: str | None, trace_id: str, attributes: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "id": span_id, "parent": parent, "trace": trace_id, "attributes": attributes}


def memory_nodes(exporter: Any) -> list[dict[str, Any]]:
    nodes = []
    for span in exporter.get_finished_spans():
        parent = format(span.parent.span_id, "016x") if span.parent else None
        context = span.get_span_context()
        nodes.append(
            _node(span.name, format(context.span_id, "016x"), parent, format(context.trace_id, "032x"),
                  dict(span.attributes or {}))
        )  # fmt: skip
    return nodes


def console_nodes(path: Path) -> list[dict[str, Any]]:
    """The spans a worker printed (``ConsoleSpanExporter``: one JSON object a line)."""
    nodes = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith('{"name"'):
            continue
        span = json.loads(line)
        parent = span.get("parent_id")
        nodes.append(
            _node(span["name"], span["context"]["span_id"][2:], parent[2:] if parent else None,
                  span["context"]["trace_id"][2:], span.get("attributes") or {})
        )  # fmt: skip
    return nodes


def children(nodes: list[dict[str, Any]], parent: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [n for n in nodes if n["parent"] == parent["id"] and n["name"] == name]


def only_child(nodes: list[dict[str, Any]], parent: dict[str, Any], name: str) -> dict[str, Any]:
    found = children(nodes, parent, name)
    assert len(found) == 1, f"{parent['name']} has {len(found)} children named {name!r}: {nodes}"
    return found[0]


def test_one_trace_runs_from_the_caller_through_submit_the_rescuer_and_every_attempt(
    workers, poll, memory_spans, tmp_path
):
    from opentelemetry import trace

    # The caller: a view's span, and submit() inside it. No worker runs yet, and the message
    # is lost (the broker flushed), so the rescuer publishes it again.
    with trace.get_tracer("test").start_as_current_span("POST /orders"):
        execution = submit(TASK, kwargs={"failures": 1})
    redis_flushdb(broker_url())
    Execution.objects.filter(pk=execution.pk).update(due_at=Now())
    assert run_rescuer().published == 1

    stdout = tmp_path / "worker-spans.jsonl"
    worker = workers.start(concurrency=1, env={"TASKPLATFORM_TRACING": "console"}, stdout=stdout)
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="the retried execution to succeed")
    worker.stop()  # its spans are written when each ends; stopped, its output is complete

    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 2 and EffectRaw.objects.filter(key=row.idempotency_key).count() == 2
    nodes = memory_nodes(memory_spans) + console_nodes(stdout)
    assert {n["trace"] for n in nodes} == {row.trace_id}, "every span is in the execution's trace"

    (view,) = [n for n in nodes if n["name"] == "POST /orders"]
    submitted = only_child(nodes, view, "taskplatform.submit")
    assert submitted["attributes"]["taskplatform.execution_id"] == execution.pk
    only_child(nodes, submitted, f"apply_async/{TASK}")  # the first publication (lost)
    rescue = only_child(nodes, submitted, "taskplatform.rescue")
    assert rescue["attributes"]["taskplatform.outcome"] == "published"
    published = only_child(nodes, rescue, f"apply_async/{TASK}")

    run = only_child(nodes, published, f"run/{TASK}")
    first = only_child(nodes, run, "taskplatform.attempt")
    assert (first["attributes"]["taskplatform.attempt"], first["attributes"]["taskplatform.outcome"]) == (1, "retry")
    assert first["attributes"]["taskplatform.parked"] is False
    retried = only_child(nodes, first, f"apply_async/{TASK}")  # the retry, published by the failed attempt
    second = only_child(nodes, only_child(nodes, retried, f"run/{TASK}"), "taskplatform.attempt")
    assert (second["attributes"]["taskplatform.attempt"], second["attributes"]["taskplatform.outcome"]) == (
        2,
        "succeeded",
    )
    assert second["attributes"]["taskplatform.execution_id"] == execution.pk

    # Every log line of the worker about the execution names the trace.
    lines = [line for line in worker.log().splitlines() if f"execution={execution.pk} " in line]
    assert lines and all(f"trace={row.trace_id}" in line for line in lines), lines


@pytest.mark.django_db
def test_tracing_off_stores_no_trace_and_makes_no_span() -> None:
    assert not tracing.ACTIVE
    execution = submit("testapp.effect", on_commit=False)
    assert (execution.trace_context, Execution.objects.get(pk=execution.pk).trace_id) == ("", "")
    with tracing.span("nothing") as span:
        assert span is None
    assert tracing.traceparent() == ""


@pytest.mark.django_db(transaction=True)
def test_a_batchs_messages_carry_the_trace_stored_on_their_rows(memory_spans) -> None:
    """``submit_many`` publishes after the commit, when no span is current: each message must
    still carry its row's trace (Celery's instrumentation writes the header; found in review:
    it started a new root trace per message, so the console's trace id found nothing)."""
    from celery.signals import before_task_publish
    from django.db import transaction
    from opentelemetry import trace

    seen: list[dict[str, Any]] = []

    def grab(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
        seen.append(dict(headers or {}))  # connected after the instrumentation: sees what it wrote

    before_task_publish.connect(grab, weak=False)
    try:
        with transaction.atomic():
            submit_many("testapp.effect", [{"idempotency_key": f"batch-{i}"} for i in range(3)])
    finally:
        before_task_publish.disconnect(grab)
    rows = {row.pk: row for row in Execution.objects.filter(idempotency_key__startswith="batch-")}
    assert len(seen) == 3 and len({row.trace_id for row in rows.values()}) == 1
    for headers in seen:
        assert headers["traceparent"].split("-")[1] == rows[headers["tp_execution"]].trace_id != ""
    assert not trace.get_current_span().get_span_context().is_valid


@pytest.mark.django_db(transaction=True)
def test_a_failed_publication_is_a_failed_span_and_leaves_no_context_behind(memory_spans, use_broker) -> None:
    """Found in review: the instrumentation ends its publication span in ``after_task_publish``,
    which a failed publication never reaches: the span was never exported and stayed attached
    (later spans of the process became its children)."""
    from celery import current_app
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import utils

    use_broker("redis://127.0.0.1:1/0")  # nothing listens there
    for _ in range(2):
        submit("testapp.effect", on_commit=False)  # recorded; its publication fails
    assert not trace.get_current_span().get_span_context().is_valid
    spans = [span for span in memory_spans.get_finished_spans() if span.name == "apply_async/testapp.effect"]
    assert [span.status.status_code.name for span in spans] == ["ERROR", "ERROR"]
    assert not getattr(current_app.tasks["testapp.effect"], utils.CTX_KEY, None)
