"""OpenTelemetry tracing: one trace from the caller, through ``submit()``, every publication and
every attempt, with retries and rescues as spans of it.

Off by default (``TASKPLATFORM_TRACING = "off"``: nothing is imported, every helper here is a
no-op). On, it needs the ``tracing`` extra (``opentelemetry-sdk`` and
``opentelemetry-instrumentation-celery``):

* ``submit()`` / ``submit_many()`` make a ``taskplatform.submit`` span (a child of the caller's,
  a view's request span if the project traces Django) and store its W3C ``traceparent`` on the
  execution row (``Execution.trace_context``; the console shows the trace id);
* every publication of an execution (after the commit, a retry's, the rescuer's) runs under
  that stored context when nothing else is current, so Celery's instrumentation makes its
  ``apply_async/<task>`` span a child of it and carries the context in the message;
* the worker's ``run/<task>`` span (Celery's instrumentation) holds a ``taskplatform.attempt``
  span per delivery: the execution, the attempt, the token, the claim's outcome, and how it
  ended (succeeded, retry with its delay and where it waits, dead letter, absorbed);
* the rescuer's publications and takeovers are ``taskplatform.rescue`` spans in the
  execution's trace;
* every log line carries ``trace_id`` (``observability.logs``).

``"console"`` prints each span as one JSON line on standard output (``make run``:
``TASKPLATFORM_TRACING=console make run``); ``"otlp"`` exports over OTLP/HTTP, configured by the
standard ``OTEL_EXPORTER_OTLP_*`` variables; ``"provided"`` leaves the tracer provider to the
project.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

log = logging.getLogger("taskplatform.tracing")

#: True once ``setup`` turned tracing on in this process: the hot paths test only this.
ACTIVE = False
TRACER_NAME = "taskplatform"
_tracer: Any = None


def setup(mode: str) -> bool:
    """Turn tracing on in this process for ``mode`` (a ``TASKPLATFORM_TRACING`` value); True if on.

    Idempotent. The tracer provider is set up here for ``console`` and ``otlp`` (once per
    process: OpenTelemetry refuses a second one), and Celery is instrumented either way.
    """
    global ACTIVE, _tracer
    if mode == "off" or ACTIVE:
        return ACTIVE
    try:
        from opentelemetry import trace
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
    except ImportError as exc:
        raise RuntimeError(
            f"TASKPLATFORM_TRACING = {mode!r} needs the tracing extra: pip install 'taskplatform[tracing]'"
        ) from exc
    if mode in ("console", "otlp"):
        trace.set_tracer_provider(_provider(mode))
    CeleryInstrumentor().instrument()
    _tracer = trace.get_tracer(TRACER_NAME)
    ACTIVE = True
    return True


def stop() -> None:
    """Turn tracing off in this process (Celery uninstrumented; a tracer provider stays set, as
    OpenTelemetry allows one a process). For tests that turn it on for a while."""
    global ACTIVE, _tracer
    if not ACTIVE:
        return
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().uninstrument()
    ACTIVE, _tracer = False, None


def _provider(mode: str) -> Any:
    import os
    import sys

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or "taskplatform"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if mode == "console":
        # One JSON object per line, written when the span ends (no thread to lose at a fork).
        exporter = ConsoleSpanExporter(out=sys.stdout, formatter=lambda span: span.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        # In the tracing extra, not in the reference deployment's pins (it brings protobuf).
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
            OTLPSpanExporter,
        )

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


@contextmanager
def span(name: str, attributes: dict[str, Any] | None = None, *, record_errors: bool = True) -> Iterator[Any]:
    """A span named ``name``, current inside the block (None when tracing is off). With
    ``record_errors``, an exception leaving the block is recorded on it and marks it failed."""
    if not ACTIVE:
        yield None
        return
    with _tracer.start_as_current_span(
        name,
        attributes=_clean(attributes or {}),
        record_exception=record_errors,
        set_status_on_exception=record_errors,
    ) as current:
        yield current


def annotate(attributes: dict[str, Any]) -> None:
    """Set ``attributes`` on the current span (nothing when tracing is off or no span is current)."""
    if not ACTIVE:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(_clean(attributes))


def error_status(description: str) -> Any:
    """A failed span's status (tracing on only)."""
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR, description)


def traceparent() -> str:
    """The current span's W3C ``traceparent`` ("" when tracing is off or no span is current)."""
    if not ACTIVE:
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


def current_trace_id() -> str | None:
    """The trace id of the current span, for log lines (None when there is none)."""
    if not ACTIVE:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def under(stored: str) -> Any:
    """A context manager under which ``stored`` (a ``traceparent``) is the current context, when
    tracing is on, ``stored`` is set and no span is current already (a worker's attempt that
    publishes its retry stays the parent of that publication)."""
    if not ACTIVE or not stored:
        return nullcontext()
    from opentelemetry import trace

    if trace.get_current_span().get_span_context().is_valid:
        return nullcontext()
    return _attached(stored)


@contextmanager
def _attached(stored: str) -> Iterator[None]:
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    token = context.attach(TraceContextTextMapPropagator().extract({"traceparent": stored}))
    try:
        yield
    finally:
        context.detach(token)


@contextmanager
def publishing(stored: str, task_name: str, task_id: str) -> Iterator[None]:
    """Around one publication of an execution (Celery's instrumentation makes its
    ``apply_async`` span and puts the context in the message inside):

    * under ``stored``, the execution's context, when no span is current (``under``);
    * the caller's context restored afterwards, whatever the instrumentation left attached: it
      attaches its span and detaches it only in ``after_task_publish``, which a failed
      publication, or a task this process has not registered, never reaches;
    * a failed publication's span recorded as failed and ended.
    """
    if not ACTIVE:
        yield
        return
    from opentelemetry import context

    token = context.attach(context.get_current())  # restored by detach below, whatever happens inside
    try:
        with under(stored):
            yield
    except BaseException as exc:
        _end_failed_publication(task_name, task_id, exc)
        raise
    finally:
        context.detach(token)


def _end_failed_publication(task_name: str, task_id: str, exc: BaseException) -> None:
    """End the span Celery's instrumentation started for a publication that raised (it would
    end it in ``after_task_publish``, which does not come): recorded, failed, forgotten."""
    from celery import current_app
    from opentelemetry.instrumentation.celery import utils  # its span store, by (task id, publish)

    task = current_app.tasks.get(task_name)
    stored = utils.retrieve_context(task, task_id, is_publish=True)
    if stored is None:
        return
    span, activation, _token = stored
    span.record_exception(exc)
    span.set_status(error_status(f"publication failed: {exc}"))
    activation.__exit__(None, None, None)
    utils.detach_context(task, task_id, is_publish=True)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes str, bool, int and float attribute values: drop None, stringify the rest."""
    return {
        key: value if isinstance(value, (str, bool, int, float)) else str(value)
        for key, value in attributes.items()
        if value is not None
    }
