"""submit_many(): submit()'s semantics per item, one batch all or nothing, published after commit.

The broker is the real Redis of the test run; each test publishes to a queue of its own and
reads the messages back from its list, so "published" means a message the broker holds.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.test import override_settings

from taskplatform import submit, submit_many
from taskplatform.exceptions import (
    IdempotencyKeyConflictError,
    InvalidArgumentsError,
    InvalidIdempotencyKeyError,
    NotIdempotentTaskError,
    PayloadTooLargeError,
    SubmissionError,
    UnknownTaskError,
)
from taskplatform.models import Execution, ExecutionEvent, JobDefinition
from tests.testapp.models import Effect
from tests.testapp.tasks import effect

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]

EFFECT = "testapp.effect"


class Broker:
    """The messages on one queue of the test broker."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.client = redis.Redis.from_url(settings.CELERY_BROKER_URL)

    def messages(self) -> list[dict[str, Any]]:
        """Oldest first; a priority other than 0 has its own list (``<queue>\\x06\\x16<priority>``)."""
        found: list[dict[str, Any]] = []
        for key in sorted(self.client.keys(self.name + "*")):
            found += [json.loads(raw) for raw in reversed(self.client.lrange(key, 0, -1))]
        return found

    def keys(self) -> list[str]:
        """The ``tp_key`` header of every message on the queue, oldest first."""
        return [m["headers"]["tp_key"] for m in self.messages()]

    def clear(self) -> None:
        for key in self.client.keys(self.name + "*"):
            self.client.delete(key)


@pytest.fixture
def broker() -> Iterator[Broker]:
    queue = Broker(f"tp-test-many-{uuid.uuid4().hex[:8]}")
    yield queue
    queue.clear()
    for key in queue.client.keys(f"_kombu.binding*{queue.name}"):  # the queue's declaration
        queue.client.delete(key)


def nothing_recorded() -> bool:
    return Execution.objects.count() == 0 and ExecutionEvent.objects.count() == 0


def test_each_item_gets_its_own_key_a_derived_key_or_a_new_one(broker, monkeypatch):
    derive = lambda *a, **kw: f"gate:{kw['gate']}" if "gate" in kw else None  # noqa: E731
    monkeypatch.setattr(effect, "derive_idempotency_key", derive)
    result = submit_many(
        EFFECT,
        [{"kwargs": {"seconds": 1}, "idempotency_key": "given"}, {"kwargs": {"gate": "g1"}}, {}, {"args": []}],
        queue=broker.name,
    )
    keys = [e.idempotency_key for e in result]
    assert keys[:2] == ["given", "gate:g1"]
    assert keys[2].startswith(f"{EFFECT}:") and keys[3].startswith(f"{EFFECT}:") and keys[2] != keys[3]
    assert result.created == (True, True, True, True) and result.existing_keys == ()
    assert broker.keys() == keys  # one message per row, in item order
    rows = {r.idempotency_key: r for r in Execution.objects.all()}
    assert rows.keys() == set(keys)
    for execution, message in zip(result, broker.messages(), strict=True):
        row = rows[execution.idempotency_key]
        assert row.pk == execution.pk == message["headers"]["tp_execution"]
        assert (row.state, row.publish_count, row.queue, row.trigger) == ("PENDING", 1, broker.name, "api")
        assert row.celery_task_id == message["headers"]["id"] and row.due_at is not None
    assert rows["given"].kwargs == {"seconds": 1} and rows["gate:g1"].kwargs == {"gate": "g1"}


def test_the_result_is_a_sequence_of_executions_in_item_order(broker):
    result = submit_many(EFFECT, [{"idempotency_key": f"s{i}"} for i in range(3)], queue=broker.name)
    assert len(result) == 3 and result.created_count == 3
    assert [e.idempotency_key for e in result] == ["s0", "s1", "s2"]
    assert result[-1].idempotency_key == "s2" and [e.idempotency_key for e in result[:2]] == ["s0", "s1"]
    assert submit_many(EFFECT, []).executions == ()
    assert Execution.objects.count() == 3


def test_existing_keys_are_reported_and_not_published_again(broker):
    old = submit(EFFECT, kwargs={"seconds": 1}, idempotency_key="old", queue=broker.name)
    assert broker.keys() == ["old"]
    broker.clear()
    result = submit_many(
        EFFECT,
        [
            {"idempotency_key": "new1"},
            {"idempotency_key": "old", "kwargs": {"seconds": 1}},
            {"idempotency_key": "new2"},
        ],
        queue=broker.name,
    )
    assert result.created == (True, False, True)
    assert result.existing_keys == ("old",)
    assert result[1].pk == old.pk
    assert broker.keys() == ["new1", "new2"]
    assert Execution.objects.get(pk=old.pk).publish_count == 1
    assert Execution.objects.count() == 3


def test_a_batch_of_only_existing_keys_publishes_nothing(broker):
    submit_many(EFFECT, [{"idempotency_key": "a"}, {"idempotency_key": "b"}], queue=broker.name)
    broker.clear()
    again = submit_many(EFFECT, [{"idempotency_key": "b"}, {"idempotency_key": "a"}], queue=broker.name)
    assert again.created == (False, False) and again.existing_keys == ("b", "a")
    assert broker.keys() == [] and Execution.objects.count() == 2


def test_repeated_keys_inside_one_batch_collapse_onto_one_row(broker):
    result = submit_many(
        EFFECT,
        [
            {"idempotency_key": "d", "kwargs": {"seconds": 1}},
            {"idempotency_key": "e"},
            {"idempotency_key": "d", "kwargs": {"seconds": 1}},
        ],
        queue=broker.name,
    )
    assert result[0].pk == result[2].pk and result[0] is result[2]
    assert result.created == (True, True, False) and result.existing_keys == ()
    assert Execution.objects.count() == 2
    assert broker.keys() == ["d", "e"]


def test_a_key_repeated_in_the_batch_with_other_arguments_refuses_the_batch(broker):
    with pytest.raises(IdempotencyKeyConflictError, match="item 2: idempotency key 'd' is also item 0's") as info:
        submit_many(
            EFFECT,
            [
                {"idempotency_key": "d", "kwargs": {"seconds": 1}},
                {"idempotency_key": "e"},
                {"idempotency_key": "d", "kwargs": {"seconds": 2}},
            ],
            queue=broker.name,
        )
    assert (info.value.context["index"], info.value.context["other_index"]) == (2, 0)
    assert nothing_recorded() and broker.keys() == []


def test_a_key_reused_with_other_arguments_refuses_the_whole_batch(broker):
    old = submit(EFFECT, kwargs={"seconds": 1}, idempotency_key="k", queue=broker.name)
    broker.clear()
    with pytest.raises(IdempotencyKeyConflictError, match=r"^item 1: idempotency key 'k' already names") as info:
        submit_many(
            EFFECT,
            [{"idempotency_key": "n1"}, {"idempotency_key": "k", "kwargs": {"seconds": 2}}, {"idempotency_key": "n2"}],
            queue=broker.name,
        )
    assert info.value.context == {"execution_id": old.pk, "index": 1}
    assert list(Execution.objects.values_list("idempotency_key", flat=True)) == ["k"]  # n1, n2 not recorded
    assert broker.keys() == []


def test_a_key_reused_for_another_task_refuses_the_whole_batch(broker):
    submit("testapp.sleepy", idempotency_key="k", on_commit=False, queue=broker.name)
    with pytest.raises(IdempotencyKeyConflictError, match=r"^item 0: .* of task 'testapp\.sleepy'"):
        submit_many(EFFECT, [{"idempotency_key": "k"}, {"idempotency_key": "n"}], queue=broker.name)
    assert Execution.objects.count() == 1


def test_a_refused_batch_in_the_callers_transaction_rolls_back_only_the_batch(broker):
    submit(EFFECT, kwargs={"seconds": 1}, idempotency_key="k", on_commit=False, queue=broker.name)
    broker.clear()
    with transaction.atomic():
        Effect.objects.create(key="the view's own write", fencing_token=0)
        with pytest.raises(IdempotencyKeyConflictError):
            submit_many(EFFECT, [{"idempotency_key": "n1"}, {"idempotency_key": "k"}], queue=broker.name)
        submit_many(EFFECT, [{"idempotency_key": "n2"}], queue=broker.name)  # the transaction is still usable
    assert Effect.objects.filter(key="the view's own write").count() == 1
    assert sorted(Execution.objects.values_list("idempotency_key", flat=True)) == ["k", "n2"]
    assert broker.keys() == ["n2"]


BAD_ITEMS: list[tuple[str, Any, type[SubmissionError], str]] = [
    ("args not JSON", {"args": [dt.date(2026, 1, 1)]}, InvalidArgumentsError, "must be JSON values"),
    ("kwargs not JSON", {"kwargs": {"x": object()}}, InvalidArgumentsError, "must be JSON values"),
    ("NaN argument", {"args": [float("nan")]}, InvalidArgumentsError, "must be JSON values"),
    ("args not a list", {"args": "abc"}, InvalidArgumentsError, "args must be a list"),
    ("kwargs not a dict", {"kwargs": [1]}, InvalidArgumentsError, "kwargs must be a dict"),
    ("oversized", {"args": ["x" * 2000]}, PayloadTooLargeError, "the limit is 1024 bytes"),
    ("empty key", {"idempotency_key": " "}, InvalidIdempotencyKeyError, "must not be empty"),
    ("key not a string", {"idempotency_key": 5}, InvalidIdempotencyKeyError, "must be a string"),
    ("key too long", {"idempotency_key": "k" * 256}, InvalidIdempotencyKeyError, "the limit is 255"),
    ("countdown and eta", {"countdown": 1, "eta": dt.datetime.now(dt.UTC)}, InvalidArgumentsError, "not both"),
    ("naive eta", {"eta": dt.datetime(2030, 1, 1)}, InvalidArgumentsError, "timezone-aware"),
    ("eta not a datetime", {"eta": "2030-01-01"}, InvalidArgumentsError, "eta must be a datetime"),
    ("countdown not a number", {"countdown": "soon"}, InvalidArgumentsError, "finite number of seconds"),
    ("infinite countdown", {"countdown": float("inf")}, InvalidArgumentsError, "finite number of seconds"),
    ("countdown past 9999", {"countdown": 1e12}, InvalidArgumentsError, "beyond the year 9999"),
    ("unknown field", {"kwarg": {"seconds": 1}}, InvalidArgumentsError, "unknown item field"),
    ("item not a dict", ["args"], InvalidArgumentsError, "an item must be a dict, not list"),
]


@pytest.mark.parametrize(("item", "error", "message"), [b[1:] for b in BAD_ITEMS], ids=[b[0] for b in BAD_ITEMS])
@override_settings(TASKPLATFORM_MAX_ARGS_BYTES=1024)
def test_a_bad_item_refuses_the_batch_naming_it_and_nothing_is_recorded_or_published(item, error, message, broker):
    items = [{"idempotency_key": "good-0"}, item, {"idempotency_key": "good-2"}]
    with pytest.raises(error, match=f"^item 1: .*{message}") as info:
        submit_many(EFFECT, items, queue=broker.name)
    assert info.value.context["index"] == 1
    assert nothing_recorded() and broker.keys() == []


BAD_CALLS: list[tuple[str, Callable[[str], Any], type[SubmissionError], str]] = [
    ("unknown task", lambda q: submit_many("no.such.task", [{}], queue=q), UnknownTaskError, "unknown task"),
    ("not idempotent", lambda q: submit_many("testapp.plain", [{}], queue=q), NotIdempotentTaskError, "IdempotentTask"),
    ("items a dict", lambda q: submit_many(EFFECT, {"args": []}, queue=q), InvalidArgumentsError, "iterable of dicts"),
]


@pytest.mark.parametrize(("call", "error", "message"), [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_a_bad_call_is_refused_and_nothing_is_recorded_or_published(call, error, message, broker):
    with pytest.raises(error, match=message):
        call(broker.name)
    assert nothing_recorded() and broker.keys() == []


def test_messages_are_sent_only_after_the_callers_transaction_commits(broker):
    with transaction.atomic():
        result = submit_many(EFFECT, [{"idempotency_key": f"c{i}"} for i in range(3)], queue=broker.name)
        assert Execution.objects.count() == 3
        assert broker.keys() == []  # not while the transaction is open
    assert broker.keys() == ["c0", "c1", "c2"]
    assert [m["headers"]["id"] for m in broker.messages()] == [
        Execution.objects.get(pk=e.pk).celery_task_id for e in result
    ]


def test_a_rolled_back_transaction_records_and_publishes_nothing(broker):
    with pytest.raises(RuntimeError), transaction.atomic():
        submit_many(EFFECT, [{"idempotency_key": f"r{i}"} for i in range(3)], queue=broker.name)
        raise RuntimeError("the view failed after submitting")
    assert nothing_recorded() and broker.keys() == []


def test_on_commit_false_publishes_as_soon_as_the_rows_are_inserted(broker):
    with transaction.atomic():
        submit_many(EFFECT, [{"idempotency_key": "now"}], queue=broker.name, on_commit=False)
        assert broker.keys() == ["now"]


def test_far_countdowns_are_parked_in_the_ledger_and_near_ones_go_to_the_broker(broker):
    eta = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    before = dt.datetime.now(dt.UTC)
    result = submit_many(
        EFFECT,
        [
            {"idempotency_key": "soon", "countdown": 5},
            {"idempotency_key": "later", "countdown": 3600},
            {"idempotency_key": "days", "eta": eta},
            {"idempotency_key": "now"},
        ],
        queue=broker.name,
    )
    assert settings.TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS < 3600
    rows = {r.idempotency_key: r for r in Execution.objects.all()}
    for key in ("later", "days"):
        row = rows[key]
        assert (row.publish_count, row.celery_task_id, row.state) == (0, "", "PENDING")
        assert row.due_at == row.scheduled_for
    assert rows["days"].scheduled_for == eta
    assert rows["later"].scheduled_for >= before + dt.timedelta(seconds=3600)
    assert rows["soon"].publish_count == 1 and rows["soon"].scheduled_for is not None
    assert rows["now"].scheduled_for is None
    assert broker.keys() == ["soon", "now"]
    soon, now = broker.messages()
    assert soon["headers"]["eta"] is not None and now["headers"]["eta"] is None
    assert result.created == (True, True, True, True)


def test_a_job_definition_supplies_default_arguments_and_the_queue(broker):
    job = JobDefinition.objects.create(slug="j", task=EFFECT, kwargs={"seconds": 0.1}, queue=broker.name)
    result = submit_many(job, [{}, {"kwargs": {"seconds": 2}}])
    assert [(e.kwargs, e.queue, e.job_id, e.task_name) for e in result] == [
        ({"seconds": 0.1}, broker.name, job.pk, EFFECT),
        ({"seconds": 2}, broker.name, job.pk, EFFECT),
    ]
    assert len(broker.keys()) == 2


def test_large_batches_are_split_across_statements_with_the_same_answers(broker, monkeypatch):
    from taskplatform.core import _pg, ledger

    monkeypatch.setattr(_pg, "INSERT_MANY_ROWS", 2)
    monkeypatch.setattr(ledger, "_KEYS_PER_SELECT", 2)
    submit_many(EFFECT, [{"idempotency_key": "x1"}, {"idempotency_key": "x4"}], queue=broker.name)
    broker.clear()
    keys = [f"x{i}" for i in range(7)]
    result = submit_many(EFFECT, [{"idempotency_key": k} for k in keys], queue=broker.name)
    assert [e.idempotency_key for e in result] == keys
    assert result.created == (True, False, True, True, False, True, True)
    assert result.existing_keys == ("x1", "x4")
    assert broker.keys() == ["x0", "x2", "x3", "x5", "x6"]
    assert Execution.objects.count() == 7
    assert all(e.pk == Execution.objects.get(idempotency_key=e.idempotency_key).pk for e in result)


def test_a_key_inserted_by_another_submitter_after_the_lookup_is_reported_as_existing(broker, monkeypatch):
    """The portable path looks existing keys up first; a row that appears in between (another
    process) makes the bulk insert fail, and the batch falls back to one insert per row."""
    from django.db import connection

    from taskplatform.core import ledger

    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL inserts first (ON CONFLICT DO NOTHING): no lookup to race")
    other = submit(EFFECT, idempotency_key="raced", on_commit=False, queue=broker.name)
    broker.clear()
    monkeypatch.setattr(ledger, "_existing", lambda keys, real=ledger._existing: {} if "raced" in keys else real(keys))
    result = submit_many(EFFECT, [{"idempotency_key": "first"}, {"idempotency_key": "raced"}], queue=broker.name)
    assert result.created == (True, False) and result[1].pk == other.pk
    assert broker.keys() == ["first"]
    assert Execution.objects.count() == 2


def _decoded(message: dict[str, Any]) -> dict[str, Any]:
    """A broker message with its body decoded and its per-publication delivery tag dropped."""
    message = json.loads(json.dumps(message))
    message["body"] = json.loads(base64.b64decode(message["body"]))
    del message["properties"]["delivery_tag"]
    return message


def _celerys_own(execution: Execution, task_id: str) -> None:
    """The message Celery's ``send_task`` builds for ``execution``, with the ledger's options."""
    from celery import current_app

    from taskplatform.core.publisher import message_options

    current_app.send_task(
        execution.task_name,
        args=execution.args,
        kwargs=execution.kwargs,
        **message_options(execution, task_id=task_id, countdown=None),
    )


@pytest.mark.parametrize("sent_events", [False, True], ids=["no-sent-events", "sent-events"])
def test_publish_and_a_batch_send_the_message_celery_would_send(broker, sent_events, monkeypatch):
    """``publish`` and the batch sender build one message per shape with Celery and change only
    the ids, arguments and ledger headers per message: for the same execution and task id, the
    message, the ``before_task_publish`` signal and the ``task-sent`` event are those of
    Celery's own ``send_task``, for a first publication and for one from a kept prototype."""
    from celery import current_app
    from celery.signals import before_task_publish

    from taskplatform.core.publisher import publish, publish_many

    monkeypatch.setitem(current_app.conf, "task_send_sent_event", sent_events)
    job = JobDefinition.objects.create(
        slug="limits",
        task=EFFECT,
        queue=broker.name,
        priority=3,
        soft_time_limit_seconds=5,
        time_limit_seconds=9,
        lease_seconds=7,
    )
    execution = submit(job, args=[1, "two"], kwargs={"seconds": 0.5}, on_commit=False)
    broker.clear()
    signalled: list[dict[str, Any]] = []

    def record(sender: str, **kwargs: Any) -> None:
        signalled.append({"sender": sender, **{k: v for k, v in kwargs.items() if k not in ("signal", "declare")}})

    events = broker.client.pubsub()
    events.psubscribe("*celeryev*")
    events.get_message(timeout=5)  # the subscription's confirmation
    before_task_publish.connect(record, weak=False)
    try:
        _celerys_own(execution, "same-id")
        with monkeypatch.context() as patch:  # built from prototypes, not through send_task
            patch.setattr(current_app, "send_task", lambda *a, **kw: pytest.fail("send_task called"))
            assert publish(execution, task_id="same-id")
            assert publish(execution, task_id="same-id")  # the thread's prototype, kept
            assert publish_many([(execution, "same-id", None)])
    finally:
        before_task_publish.disconnect(record)
    celerys, *ours = broker.messages()
    assert len(ours) == 3
    for message in ours:
        assert _decoded(message) == _decoded(celerys)
    assert celerys["headers"]["tp_key"] == execution.idempotency_key and celerys["headers"]["timelimit"] == [9, 5]
    assert celerys["headers"]["tp_lease"] == 7  # the job's lease, for the first claim (``HEADER_LEASE``)
    assert celerys["properties"]["priority"] == 3
    assert len(signalled) == 4
    assert all(json.dumps(s, default=str) == json.dumps(signalled[0], default=str) for s in signalled)

    sent: list[dict[str, Any]] = []
    while sent_events and len(sent) < 4:
        event = events.get_message(timeout=10)
        assert event is not None, "a task-sent event is missing"
        if event["type"] == "pmessage":
            body = json.loads(base64.b64decode(json.loads(event["data"])["body"]))
            sent.append({k: v for k, v in body.items() if k not in ("timestamp", "clock", "local_received")})
    events.close()
    if sent_events:
        assert all(s == sent[0] for s in sent) and sent[0]["uuid"] == "same-id" and sent[0]["queue"] == broker.name


def test_a_setting_assigned_between_two_publications_is_in_the_second_message(broker, monkeypatch):
    """``publish`` keeps the thread's prototypes between calls, and drops them when a setting
    is assigned: the second message carries the new setting (here: the ``task-sent`` event)."""
    from celery import current_app

    from taskplatform.core.publisher import publish

    monkeypatch.setitem(current_app.conf, "task_send_sent_event", False)
    execution = submit(EFFECT, args=[1], queue=broker.name, on_commit=False)
    events = broker.client.pubsub()
    events.psubscribe("*celeryev*")
    events.get_message(timeout=5)
    assert publish(execution, task_id="before")
    monkeypatch.setitem(current_app.conf, "task_send_sent_event", True)
    assert publish(execution, task_id="after")
    sent = []
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        event = events.get_message(timeout=1)
        if event is not None and event["type"] == "pmessage":
            sent.append(json.loads(base64.b64decode(json.loads(event["data"])["body"]))["uuid"])
    events.close()
    assert sent == ["after"]
    assert [m["headers"]["id"] for m in broker.messages()][-2:] == ["before", "after"]


def test_publish_drops_its_kept_messages_for_a_django_celery_setting_another_app_or_process(broker, monkeypatch):
    """What Celery reads through Django's settings (``override_settings(CELERY_...)``), a
    change of current app, or a fork (a message names the process that sent it) each drop
    the thread's kept prototypes; a second call with nothing changed keeps them."""
    import os

    from celery import Celery, current_app
    from django.test import override_settings

    from taskplatform.core import publisher

    kept = publisher._shared_prototypes(current_app)
    assert kept is not None and publisher._shared_prototypes(current_app) is kept
    with override_settings(CELERY_TASK_SEND_SENT_EVENT=True):
        after_override = publisher._shared_prototypes(current_app)
    assert after_override is not kept
    before = publisher._shared_prototypes(current_app)
    original = current_app._get_current_object()
    Celery("other", set_as_current=True)  # ``current_app``, a proxy, now stands for another app
    try:
        assert publisher._shared_prototypes(current_app) is not before
    finally:
        original.set_current()
    here = publisher._shared_prototypes(current_app)
    monkeypatch.setattr(os, "getpid", lambda: -1)
    assert publisher._shared_prototypes(current_app) is not here


def test_a_receiver_that_changes_a_message_does_not_change_the_next(broker):
    """The kept prototype's lists and dicts are copied for each message: a
    ``before_task_publish`` receiver that changes one message's headers leaves the next
    message of the same shape as Celery would send it."""
    from celery.signals import before_task_publish

    from taskplatform.core.publisher import publish

    job = JobDefinition.objects.create(slug="limited", task=EFFECT, queue=broker.name, time_limit_seconds=9)
    execution = submit(job, args=[1], on_commit=False)
    broker.clear()

    def meddle(headers: dict[str, Any], **_: Any) -> None:
        headers["timelimit"][0] = 999
        if isinstance(headers.get("stamps"), dict):
            headers["stamps"]["meddled"] = True

    before_task_publish.connect(meddle, weak=False)
    try:
        assert publish(execution, task_id="first")
    finally:
        before_task_publish.disconnect(meddle)
    assert publish(execution, task_id="second")
    _celerys_own(execution, "second")
    first, second, celerys = broker.messages()
    assert first["headers"]["timelimit"][0] == 999
    assert _decoded(second) == _decoded(celerys) and second["headers"]["timelimit"] == [9, None]


def test_publish_reads_a_job_that_is_not_loaded_each_time(broker):
    """An execution whose job is not loaded has no kept prototype: a job's lease and time
    limits changed between two publications are in the second message."""
    from taskplatform.core.publisher import publish

    job = JobDefinition.objects.create(
        slug="changing", task=EFFECT, queue=broker.name, lease_seconds=7, time_limit_seconds=9
    )
    execution = submit(job, args=[1], on_commit=False)
    broker.clear()
    assert publish(Execution.objects.get(pk=execution.pk), task_id="before")
    JobDefinition.objects.filter(pk=job.pk).update(lease_seconds=11, time_limit_seconds=13)
    assert publish(Execution.objects.get(pk=execution.pk), task_id="after")
    before, after = broker.messages()
    assert (before["headers"]["tp_lease"], before["headers"]["timelimit"]) == (7, [9, None])
    assert (after["headers"]["tp_lease"], after["headers"]["timelimit"]) == (11, [13, None])


def test_publish_declares_a_queue_the_connection_has_not_declared(broker):
    """On a connection that is up (it just sent to another queue), a queue kombu has no record
    of is declared with its first message (on Redis, the binding kombu routes by)."""
    from taskplatform.core.publisher import publish

    first = submit(EFFECT, args=[1], queue=broker.name, on_commit=False)
    assert publish(first, task_id="warm-up")  # the pooled connection is up and has the first queue
    other = Broker(f"{broker.name}-other")
    try:
        # Parked in the ledger (a far countdown): recorded, not published, so never declared.
        execution = submit(EFFECT, args=[2], queue=other.name, countdown=30 * 24 * 3600, on_commit=False)
        assert not other.client.exists(f"_kombu.binding.{other.name}") and not other.messages()
        assert publish(execution, task_id="other-queue")
        assert other.client.exists(f"_kombu.binding.{other.name}")
    finally:
        other.clear()
        other.client.delete(f"_kombu.binding.{other.name}")


def test_publish_declares_the_queue_again_on_a_new_broker_connection(broker):
    """A kept prototype skips the queue's declaration only while the connection has it: on a
    new connection the next publication declares the queue again (on Redis, the binding kombu
    routes by)."""
    from taskplatform.core.publisher import publish

    execution = submit(EFFECT, args=[1], queue=broker.name, on_commit=False)
    binding = f"_kombu.binding.{broker.name}"
    assert broker.client.exists(binding)
    broker.client.delete(binding)
    assert publish(execution, task_id="same-connection")
    assert not broker.client.exists(binding)  # declared on this connection already: not again
    from celery import current_app
    from kombu import pools

    pools.reset()  # every producer and connection pool closed and forgotten: new connections
    current_app._pool = None
    current_app.amqp._producer_pool = None
    assert publish(execution, task_id="new-connection")
    assert broker.client.exists(binding)
    assert [m["headers"]["id"] for m in broker.messages()][-2:] == ["same-connection", "new-connection"]


def test_the_queue_declaration_is_skipped_only_on_redis_for_a_direct_queue(broker):
    """kombu repeats a publication's ``declare`` after a reconnect within its retry; skipping
    it is only safe where nothing needs declaring to deliver: Redis, a queue of a direct
    exchange (sent by its name). Another transport (here kombu's in-memory one, for RabbitMQ's
    case) or a topic exchange gets Celery's declaration even when kombu records it declared."""
    from kombu import Connection, Exchange, Producer, Queue, binding

    from taskplatform.core.publisher import _declared

    direct, topic = (
        Queue(broker.name, Exchange(broker.name, "direct")),
        Queue(broker.name + "t", Exchange("t", "topic")),
    )
    with Connection(settings.CELERY_BROKER_URL) as redis_conn, Connection("memory://") as memory_conn:
        for conn in (redis_conn, memory_conn):
            producer = Producer(conn.default_channel)
            for queue in (direct, topic):
                queue(producer.channel).declare()
                conn.declared_entities.add(hash(queue))
        redis_producer, memory_producer = Producer(redis_conn.default_channel), Producer(memory_conn.default_channel)
        try:
            assert _declared(redis_producer, {"queue": direct})
            assert not _declared(redis_producer, {"queue": topic})
            assert not _declared(memory_producer, {"queue": direct})
            # A task with an exchange and routing key of its own is sent through the exchange.
            assert not _declared(redis_producer, {"queue": direct, "exchange": broker.name, "routing_key": "x"})
            # A queue of several bindings has no exchange of its own (kombu sets None).
            several = Queue(broker.name + "s", bindings=[binding(Exchange("a", "direct"), routing_key="a")])
            redis_conn.declared_entities.add(hash(several))
            assert several.exchange is None and not _declared(redis_producer, {"queue": several})
        finally:
            broker.client.delete(f"_kombu.binding.{broker.name}", "_kombu.binding.t")


def test_publish_inside_a_running_task_names_it_as_the_parent(broker):
    """Inside a running task, ``publish`` lets Celery build the message: its parent and root
    ids are the task's (a kept prototype would carry none, or another task's)."""
    from celery import current_app

    from taskplatform.core.publisher import publish

    execution = submit(EFFECT, args=[1], queue=broker.name, on_commit=False)
    assert publish(execution, task_id="outside")

    from celery._state import _task_stack

    running = current_app.tasks[EFFECT]
    running.push_request(id="parent-id", root_id="root-id", delivery_info={}, called_directly=False)
    _task_stack.push(running)
    try:
        assert current_app.current_worker_task is running
        assert publish(execution, task_id="inside")
    finally:
        _task_stack.pop()
        running.pop_request()
    outside, inside = broker.messages()[-2:]
    assert outside["headers"]["parent_id"] is None and outside["headers"]["root_id"] == "outside"
    assert inside["headers"]["parent_id"] == "parent-id" and inside["headers"]["root_id"] == "root-id"


def test_jobs_share_a_message_prototype_only_when_their_limits_are_the_same(broker):
    """A batch builds one message prototype per task, queue, priority and the job's lease and
    time limits (the beat's slots of many jobs with the same limits share one): each message
    still carries its own job's limits, whether the job came loaded with its execution or not."""
    from taskplatform.core import publisher as publisher_module
    from taskplatform.core.publisher import publish_many

    limits = [(7, 5, 9), (7, 5, 9), (7, 5, 9), (30, None, 60), (None, None, None)]
    jobs = []
    for n, (lease, soft, hard) in enumerate(limits):
        fields = {"lease_seconds": lease, "soft_time_limit_seconds": soft, "time_limit_seconds": hard}
        jobs.append(JobDefinition.objects.create(slug=f"shape-{n}", task=EFFECT, queue=broker.name, **fields))
    executions = [submit(job, args=[n], on_commit=False) for n, job in enumerate(jobs)]
    fresh = Execution.objects.get(pk=executions[3].pk)  # its job not loaded: read when its message is built
    assert not Execution.job.is_cached(fresh)
    broker.clear()
    batch = [*executions, fresh]
    built: list[int] = []
    real_prototype = publisher_module._BatchSender._prototype

    def prototype(self: Any, execution: Execution) -> Any:
        built.append(execution.pk)
        return real_prototype(self, execution)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(publisher_module._BatchSender, "_prototype", prototype)
        assert publish_many([(execution, f"task-{n}", None) for n, execution in enumerate(batch)])
    # One for the three jobs with limits (7, 5, 9), one for each other limits, one for the
    # execution whose job was not loaded (keyed by its job's id): 4 for 6 messages.
    assert len(built) == 4, built
    sent = {m["headers"]["id"]: m["headers"] for m in broker.messages()}
    for n, execution in enumerate(batch):
        lease, soft, hard = limits[jobs.index(execution.job)]
        headers = sent[f"task-{n}"]
        assert headers["tp_key"] == execution.idempotency_key
        assert headers.get("tp_lease") == lease, (n, headers)
        assert headers["timelimit"] == [hard, soft], (n, headers)


def test_a_broker_that_refuses_the_batch_leaves_the_rows_to_the_rescuer(broker, use_broker, caplog):
    use_broker("redis://127.0.0.1:1/0")  # nothing listens there
    started = time.monotonic()
    result = submit_many(EFFECT, [{"idempotency_key": f"down{i}"} for i in range(3)], queue=broker.name)
    elapsed = time.monotonic() - started
    assert result.created_count == 3  # the call succeeds: the rows are recorded
    # Celery's publish retry policy bounds the attempt (about 0.6 s, as for submit()), not the
    # connection's own (100 retries; a first cut that declared the queue directly took 6 s).
    assert elapsed < 3, f"the call took {elapsed:.1f} s with the broker down"
    assert "batch publication failed; the rescuer will publish its rows again" in caplog.text
    rows = Execution.objects.filter(idempotency_key__startswith="down")
    assert {(r.state, r.publish_count) for r in rows} == {("PENDING", 1)} and all(r.due_at for r in rows)


def test_the_statements_do_not_grow_with_the_batch(broker):
    """One insert per chunk and no query per row: not when building the result, nor when the
    publication reads each execution's job (time limits), which the rows carry cached."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    job = JobDefinition.objects.create(slug="q", task=EFFECT, queue=broker.name, soft_time_limit_seconds=5)
    submit_many(job, [{"idempotency_key": "warm"}])  # the task registry, the broker connection
    with CaptureQueriesContext(connection) as queries:
        result = submit_many(job, [{"idempotency_key": f"q{i}"} for i in range(120)])
        assert all(e.job.soft_time_limit_seconds == 5 for e in result)
    assert len(queries) <= 10, [q["sql"][:80] for q in queries]
    assert len(broker.keys()) == 121


def test_a_transport_that_cannot_batch_gets_each_message_at_once(broker, monkeypatch):
    """RabbitMQ, or Redis with client retries (kombu will not batch them): no kombu batch,
    each message sent on the shared producer with Celery's retry policy, and each with its
    queue to declare (kombu repeats a publication's declaration after a reconnect within its
    retry: skipped, a queue lost with the broker would not be declared again)."""
    from celery.signals import before_task_publish
    from kombu import Producer

    monkeypatch.setattr(Producer, "supports_batch_publish", property(lambda self: False))
    monkeypatch.setattr(Producer, "batch", lambda self, **kw: pytest.fail("batch used"))
    declared: list[list[str]] = []

    def record(declare: list[Any], **_: Any) -> None:
        declared.append([q.name for q in declare])

    before_task_publish.connect(record, weak=False)
    try:
        submit_many(EFFECT, [{"idempotency_key": f"nb{i}", "args": [i]} for i in range(3)], queue=broker.name)
    finally:
        before_task_publish.disconnect(record)
    assert broker.keys() == ["nb0", "nb1", "nb2"]
    assert [m["headers"]["argsrepr"] for m in broker.messages()] == ["[0]", "[1]", "[2]"]
    assert declared == [[broker.name]] * 3


def test_the_quick_argument_repr_is_celerys_saferepr_whenever_it_answers():
    """The batch writes ``argsrepr``/``kwargsrepr`` with ``repr`` for flat numbers (ids, the
    usual arguments) instead of Celery's slower ``saferepr``; on random values both agree."""
    import random

    from celery.utils.saferepr import saferepr

    from taskplatform.core.publisher import _plain_repr

    rnd = random.Random(12)

    def number() -> Any:
        return rnd.choice([rnd.randint(-(10**20), 10**20), rnd.random() * 10 ** rnd.randint(-30, 30), True, None, 0])

    answered = 0
    for maxsize in (16, 64, 1024):
        for _ in range(3000):
            n = rnd.randint(0, 150)
            value: Any = (
                [number() for _ in range(n)]
                if rnd.random() < 0.5
                else {rnd.choice(["a", "b_c", "_", "Kw", "é", "1a", "if", "x-y"]) + str(j): number() for j in range(n)}
            )
            quick = _plain_repr(value, maxsize)
            if quick is not None:
                answered += 1
                assert quick == saferepr(value, maxsize, maxlevels=3), value
    assert answered > 500
    assert _plain_repr(["it's"], 1024) is None and _plain_repr({1: 2}, 1024) is None


@pytest.fixture
def celery_sends(monkeypatch) -> list[str]:
    """The task id of every message that goes through Celery's ``send_task_message``."""
    from celery import current_app

    sends: list[str] = []
    send = current_app.amqp.send_task_message

    def counted(producer: Any, name: str, message: Any, **kwargs: Any) -> Any:
        sends.append(message[0]["id"])
        return send(producer, name, message, **kwargs)

    monkeypatch.setattr(current_app.amqp, "send_task_message", counted)
    monkeypatch.setitem(current_app.conf, "task_send_sent_event", False)  # ``_RawShape`` sends none
    return sends


def test_after_a_shapes_first_message_a_batch_writes_the_message_celery_would_send(broker, celery_sends):
    """Inside a kombu batch on Redis only a shape's first two messages go through Celery and
    kombu; the others are written from what kombu wrote for the first (``_RawShape``). For the same
    execution and task id each equals the message Celery's own ``send_task`` sends: arguments
    of every JSON kind, a job's limits, lease and priority, the ledger headers."""
    from taskplatform.core.publisher import publish_many

    job = JobDefinition.objects.create(
        slug="raw", task=EFFECT, queue=broker.name, priority=3, soft_time_limit_seconds=5, time_limit_seconds=9,
        lease_seconds=7,
    )  # fmt: skip
    arguments = [[1, "two"], ['ünï " \\ ✓', {"a": [1.5, None, True], "b": {"c": -(10**30)}}], [], [[[]]]]
    executions = [submit(job, args=a, kwargs={"k": i, "s": "x" * i}, on_commit=False) for i, a in enumerate(arguments)]
    broker.clear()
    for execution in executions:
        _celerys_own(execution, f"id-{execution.pk}")
    celery_sends.clear()
    assert publish_many([(e, f"id-{e.pk}", None) for e in executions])
    assert celery_sends == [f"id-{e.pk}" for e in executions[:2]]  # the others were written here
    messages = broker.messages()
    celerys, ours = messages[: len(executions)], messages[len(executions) :]
    assert len(ours) == len(executions)
    for mine, theirs in zip(ours, celerys, strict=True):
        assert _decoded(mine) == _decoded(theirs)
    tags = [m["properties"]["delivery_tag"] for m in ours]
    assert len(set(tags)) == len(tags)


def test_a_batch_of_thousands_written_after_its_first_message_arrives_whole_and_in_order(broker, celery_sends):
    """More messages than one ``LPUSH`` carries (``PUBLISH_BATCH_SIZE``), of two shapes (two
    queues): two messages a shape through Celery, every message in the broker once, in the
    order of the items."""
    other = Broker(f"tp-test-many-other-{uuid.uuid4().hex[:8]}")
    try:
        items = [{"idempotency_key": f"big{i}", "args": [i]} for i in range(2600)]
        submit_many(EFFECT, items[:1300], queue=broker.name)
        with transaction.atomic():
            submit_many(EFFECT, items[1300:], queue=other.name)
        assert len(celery_sends) == 4
        assert broker.keys() == [f"big{i}" for i in range(1300)]
        assert other.keys() == [f"big{i}" for i in range(1300, 2600)]
        assert [m["headers"]["argsrepr"] for m in other.messages()[:2]] == ["[1300]", "[1301]"]
    finally:
        other.clear()


def test_with_a_publish_receiver_every_message_of_a_batch_goes_through_celery(broker, celery_sends):
    """A ``before_task_publish`` or ``after_task_publish`` receiver (OpenTelemetry's
    instrumentation, an audit) is owed every message, to see and maybe change: then no message
    is written from another. (One that changes the first message is also caught by the check
    of what kombu wrote; one that only looks is not.)"""
    from celery.signals import after_task_publish, before_task_publish

    seen: list[str] = []
    published: list[str] = []

    def look(headers: dict[str, Any], **_: Any) -> None:
        seen.append(headers["id"])

    def count(headers: dict[str, Any], **_: Any) -> None:
        published.append(headers["id"])

    for signal, receiver in ((before_task_publish, look), (after_task_publish, count)):
        signal.connect(receiver, weak=False)
        try:
            submit_many(EFFECT, [{"idempotency_key": f"rc{signal.name}{i}"} for i in range(4)], queue=broker.name)
        finally:
            signal.disconnect(receiver)
    ids = [m["headers"]["id"] for m in broker.messages()]
    assert len(ids) == 8 and seen == ids[:4] and published == ids[4:]
    assert celery_sends == ids


def test_a_shape_whose_message_kombu_writes_otherwise_goes_through_kombu(broker, celery_sends, monkeypatch):
    """A task that compresses its messages: kombu's first message is not what ``_RawShape``
    would write, so every message of the batch goes through kombu (compressed, decodable)."""
    import zlib

    monkeypatch.setattr(effect, "compression", "zlib", raising=False)
    monkeypatch.setattr(effect, "_exec_options", None)  # Celery's cache of the task's options
    submit_many(EFFECT, [{"idempotency_key": f"z{i}", "args": [i]} for i in range(3)], queue=broker.name)
    assert len(celery_sends) == 3
    messages = broker.messages()
    assert [m["headers"].get("compression") for m in messages] == ["application/x-gzip"] * 3  # kombu names zlib so
    assert [json.loads(zlib.decompress(base64.b64decode(m["body"])))[0] for m in messages] == [[0], [1], [2]]


def test_a_shape_whose_first_message_kombu_already_flushed_goes_through_kombu(broker, celery_sends, monkeypatch):
    """A kombu batch that sent its pipeline with the shape's first message (here: one message
    a flush) leaves nothing to learn from: every message through kombu, none lost."""
    from taskplatform.core import publisher

    monkeypatch.setattr(publisher, "PUBLISH_BATCH_SIZE", 1)
    result = submit_many(EFFECT, [{"idempotency_key": f"f{i}"} for i in range(3)], queue=broker.name)
    assert result.created_count == 3
    assert len(celery_sends) == 3
    assert broker.keys() == ["f0", "f1", "f2"]


def test_with_task_sent_events_every_message_of_a_batch_goes_through_celery(broker, celery_sends, monkeypatch):
    """Celery sends a ``task-sent`` event with each message (``task_send_sent_event``, on in
    the reference deployment for Flower): then no message is written from another."""
    from celery import current_app

    monkeypatch.setitem(current_app.conf, "task_send_sent_event", True)
    events = broker.client.pubsub()
    events.psubscribe("*celeryev*")
    events.get_message(timeout=5)  # the subscription's confirmation
    try:
        submit_many(EFFECT, [{"idempotency_key": f"ev{i}"} for i in range(3)], queue=broker.name)
        sent: list[str] = []
        deadline = time.monotonic() + 10
        while len(sent) < 3 and time.monotonic() < deadline:
            event = events.get_message(timeout=1)
            if event is not None and event["type"] == "pmessage":
                body = json.loads(base64.b64decode(json.loads(event["data"])["body"]))
                if body.get("type") == "task-sent" and body.get("queue") == broker.name:
                    sent.append(body["uuid"])
    finally:
        events.close()
    assert broker.keys() == ["ev0", "ev1", "ev2"]
    assert sorted(sent) == sorted(m["headers"]["id"] for m in broker.messages())  # one event a message
    assert len(celery_sends) == 3


def test_with_routes_that_read_the_arguments_each_message_goes_where_the_router_says(broker, celery_sends):
    """``task_routes`` may route on the arguments: no shape is learnt, each message is routed
    by Celery's router (here the first two to one queue, as a shape's learning sees them,
    then even ids to another)."""
    from celery import current_app

    odd = Broker(f"tp-test-many-odd-{uuid.uuid4().hex[:8]}")

    def route(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any) -> Any:
        other = args[0] >= 2 and args[0] % 2 == 0
        return {"queue": odd.name if other else broker.name} if name == EFFECT else None

    routes = current_app.conf.task_routes
    current_app.conf.task_routes = (route,)
    current_app.amqp.flush_routes()
    current_app.amqp.__dict__.pop("router", None)  # Celery's cached router, made again from the routes
    try:
        submit_many(EFFECT, [{"idempotency_key": f"r{i}", "args": [i]} for i in range(6)])
        assert [m["headers"]["argsrepr"] for m in broker.messages()] == ["[0]", "[1]", "[3]", "[5]"]
        assert [m["headers"]["argsrepr"] for m in odd.messages()] == ["[2]", "[4]"]
    finally:
        odd.clear()
        current_app.conf.task_routes = routes
        current_app.amqp.flush_routes()
        current_app.amqp.__dict__.pop("router", None)


@pytest.fixture
def fresh_broker_pool(monkeypatch) -> None:
    """The app's broker connections and producers made anew (new transport options), the
    test run's own pools given back afterwards."""
    from celery import current_app

    monkeypatch.setattr(current_app, "_pool", None)
    monkeypatch.setattr(current_app.amqp, "_producer_pool", None)


def test_with_a_global_key_prefix_every_message_reaches_the_prefixed_list(broker, celery_sends, fresh_broker_pool):
    """kombu's ``global_keyprefix``: the key in kombu's pipeline is prefixed already, and a
    prefixed client would prefix it again; so every message goes through kombu, to one list."""
    from celery import current_app

    options = current_app.conf.broker_transport_options
    current_app.conf.broker_transport_options = dict(options or {}, global_keyprefix="tp-pfx:")
    try:
        submit_many(EFFECT, [{"idempotency_key": f"p{i}", "args": [i]} for i in range(4)], queue=broker.name)
        assert broker.client.llen(f"tp-pfx:{broker.name}") == 4
        assert broker.client.keys("*tp-pfx:tp-pfx:*") == []
    finally:
        current_app.conf.broker_transport_options = options
        for key in broker.client.keys(f"tp-pfx:*{broker.name}*"):
            broker.client.delete(key)


def test_a_deprecated_task_sent_receiver_gets_every_message(broker, celery_sends):
    """Celery still sends its deprecated ``task_sent`` signal for each message."""
    from celery.signals import task_sent

    got: list[str] = []

    def receive(task_id: str | None = None, **_: Any) -> None:
        got.append(str(task_id))

    task_sent.connect(receive, weak=False)
    try:
        submit_many(EFFECT, [{"idempotency_key": f"ts{i}"} for i in range(4)], queue=broker.name)
    finally:
        task_sent.disconnect(receive)
    assert got == [m["headers"]["id"] for m in broker.messages()]


def test_an_expiring_queue_has_its_expiry_renewed_by_every_message(broker, celery_sends):
    """A queue with ``x-expires``: kombu follows each ``LPUSH`` with ``PEXPIRE`` commands, so
    the first message leaves more than one command and no shape is learnt."""
    from celery import current_app
    from kombu import Queue

    queues = current_app.amqp.queues
    queues[broker.name] = Queue(broker.name, queue_arguments={"x-expires": 600000})
    try:
        submit_many(EFFECT, [{"idempotency_key": f"x{i}"} for i in range(4)], queue=broker.name)
    finally:
        queues.pop(broker.name, None)
    assert broker.keys() == ["x0", "x1", "x2", "x3"]
    assert len(celery_sends) == 4
    assert 0 < broker.client.pttl(broker.name) <= 600000


def test_inside_a_running_task_written_messages_name_it_as_their_parent(broker, celery_sends, monkeypatch):
    """Submitted from a task's body: every message carries that task as parent and root, and
    its priority when the parent's is inherited (then on Redis's list for that priority)."""
    from celery import current_app
    from celery._state import _task_stack

    from taskplatform.core.publisher import publish_many

    monkeypatch.setitem(current_app.conf, "task_inherit_parent_priority", True)
    executions = [submit(EFFECT, args=[i], queue=broker.name, on_commit=False) for i in range(3)]
    broker.clear()
    celery_sends.clear()
    running = current_app.tasks[EFFECT]
    running.push_request(id="parent-id", root_id="root-id", delivery_info={"priority": 6}, called_directly=False)
    _task_stack.push(running)
    try:
        assert publish_many([(e, f"t{i}", None) for i, e in enumerate(executions)])
    finally:
        _task_stack.pop()
        running.pop_request()
    messages = broker.messages()
    assert [m["headers"]["id"] for m in messages] == ["t0", "t1", "t2"]
    assert {(m["headers"]["parent_id"], m["headers"]["root_id"], m["properties"]["priority"]) for m in messages} == {
        ("parent-id", "root-id", 6)
    }
    assert len(celery_sends) == 2
    assert broker.client.keys(broker.name) == []  # all on the list of priority 6


def test_a_failure_to_learn_a_shape_leaves_its_messages_to_kombu(broker, celery_sends, monkeypatch, caplog):
    """Whatever goes wrong while learning a shape from kombu's first message (here: its JSON
    cannot be read), every message of the batch still goes through kombu, with one warning."""
    import kombu.utils.json

    from taskplatform.core import publisher

    def broken(*_: Any, **__: Any) -> Any:
        raise ValueError("unreadable")

    monkeypatch.setattr(kombu.utils.json, "loads", broken)
    monkeypatch.setattr(publisher, "_UNLEARNT_WARNED", set())
    for batch in range(2):
        result = submit_many(EFFECT, [{"idempotency_key": f"l{batch}-{i}"} for i in range(3)], queue=broker.name)
        assert result.created_count == 3
    assert broker.keys() == ["l0-0", "l0-1", "l0-2", "l1-0", "l1-1", "l1-2"]
    assert len(celery_sends) == 6
    assert caplog.text.count("batch messages go through kombu one by one: learning the shape failed") == 1


def test_written_messages_wait_for_at_most_a_batch_whatever_their_lists(broker, celery_sends, monkeypatch):
    """Messages written for several lists are sent once ``PUBLISH_BATCH_SIZE`` wait in all (not
    that many a list): a failure late in a large batch leaves the earlier ones delivered."""
    from taskplatform.core import publisher

    monkeypatch.setattr(publisher, "PUBLISH_BATCH_SIZE", 10)
    waiting: list[int] = []
    flush = publisher._BatchSender.flush_raw

    def watched(self: Any) -> None:
        waiting.append(sum(map(len, self.raw_pending.values())))
        flush(self)

    monkeypatch.setattr(publisher._BatchSender, "flush_raw", watched)
    queues = [broker.name, f"{broker.name}x", f"{broker.name}y"]
    executions = [submit(EFFECT, args=[i], queue=q, on_commit=False) for q in queues for i in range(9)]
    broker.clear()
    assert publisher.publish_many([(e, f"w{i}", None) for i, e in enumerate(executions)])
    assert max(waiting) <= 10 and sum(waiting) == 21  # the first two of each list via kombu
    assert len(broker.messages()) == 27


def test_a_first_message_that_left_more_than_one_command_leaves_its_shape_to_kombu(broker, celery_sends, monkeypatch):
    """A transport that writes more than the ``LPUSH`` for each message (here a counter it
    increments before it, as a later kombu might): written messages would skip that command,
    so every message goes through kombu and the counter counts them all."""
    from kombu.transport import redis as kombu_redis

    counter = f"{broker.name}-count"
    put = kombu_redis.Channel._put

    def counted_put(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        batch = kwargs.get("_publish_batch")
        if batch is not None:
            batch.add("incr", counter)
        put(self, queue, message, **kwargs)

    monkeypatch.setattr(kombu_redis.Channel, "_put", counted_put)
    try:
        submit_many(EFFECT, [{"idempotency_key": f"c{i}"} for i in range(4)], queue=broker.name)
        assert broker.client.get(counter) == b"4"
    finally:
        broker.client.delete(counter)
    assert len(celery_sends) == 4 and broker.keys() == ["c0", "c1", "c2", "c3"]


def test_a_field_kombu_sets_per_message_is_never_copied_from_the_first_message(broker, celery_sends, monkeypatch):
    """A transport that adds a field of its own to each message (here a sequence number, as a
    later kombu might): the second message, also sent by kombu, does not match what the first
    one's template writes for it, so every message goes through kombu and none carries the
    first message's number. (Review finding: comparing the first message with itself only
    checked the fields ``_RawShape`` rewrites.)"""
    import itertools

    from kombu.transport.virtual import base

    numbers = itertools.count()
    augment = base.Channel._inplace_augment_message

    def numbered(self: Any, message: Any, exchange: Any, routing_key: Any) -> None:
        augment(self, message, exchange, routing_key)
        message["properties"]["x_sequence"] = next(numbers)

    monkeypatch.setattr(base.Channel, "_inplace_augment_message", numbered)
    submit_many(EFFECT, [{"idempotency_key": f"n{i}"} for i in range(4)], queue=broker.name)
    assert broker.keys() == ["n0", "n1", "n2", "n3"]
    assert [m["properties"]["x_sequence"] for m in broker.messages()] == [0, 1, 2, 3]
    assert len(celery_sends) == 4


@pytest.mark.parametrize("when", ["at-once", "on-commit", "on-commit-in-atomic"])
@pytest.mark.parametrize("many", [False, True], ids=["submit", "submit_many"])
def test_a_soft_time_limit_that_fires_while_publishing_reaches_the_caller_and_loses_no_row(
    broker, monkeypatch, many, when
):
    """A task's soft time limit raised while its ``submit`` publishes is the task's to handle,
    not a failed publication to log and pass over: it reaches the code that called ``submit``
    (with ``on_commit``, the code whose commit ran the publication), and the committed row
    stays due for the rescuer. (Review findings: it was swallowed by ``publish``, then by
    Django's robust commit hooks, and the body ran on past its limit.)"""
    from celery import current_app
    from celery.exceptions import SoftTimeLimitExceeded

    def fires(*_: Any, **__: Any) -> Any:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(current_app.amqp, "send_task_message", fires)
    on_commit = when != "at-once"
    scope = transaction.atomic() if when == "on-commit-in-atomic" else nullcontext()
    with pytest.raises(SoftTimeLimitExceeded), scope:
        if many:
            submit_many(EFFECT, [{"idempotency_key": "stl"}], queue=broker.name, on_commit=on_commit)
        else:
            submit(EFFECT, idempotency_key="stl", queue=broker.name, on_commit=on_commit)
    row = Execution.objects.get(idempotency_key="stl")
    assert row.state == "PENDING" and row.due_at is not None
    assert broker.messages() == []


def test_a_soft_time_limit_that_fires_while_a_shape_is_learnt_reaches_the_caller(broker, monkeypatch):
    """The same limit raised while a shape is learnt from kombu's message (JSON of the whole
    message) is not a shape kombu writes otherwise: it reaches the caller."""
    from celery.exceptions import SoftTimeLimitExceeded

    from taskplatform.core import publisher

    def fires(*_: Any, **__: Any) -> Any:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(publisher._RawShape, "_learn", classmethod(fires))
    with pytest.raises(SoftTimeLimitExceeded):
        submit_many(EFFECT, [{"idempotency_key": f"sl{i}"} for i in range(5)], queue=broker.name, on_commit=False)
    assert Execution.objects.filter(idempotency_key__startswith="sl", state="PENDING").count() == 5


def test_a_shape_whose_second_message_kombu_routes_elsewhere_goes_through_kombu(broker, celery_sends, monkeypatch):
    """A queue on a topic exchange, whose binding moves to another queue between a shape's
    first and second message: kombu routes the second to the new list, so the shape is not
    written from (its learnt list is stale) and every later message goes where kombu's
    lookup sends it. (A direct queue's messages go by the anonymous exchange, Celery's way:
    their list is the queue's name and cannot move.)"""
    from celery import current_app
    from kombu import Exchange, Queue

    from taskplatform.core import publisher

    moved = Broker(f"tp-test-many-moved-{uuid.uuid4().hex[:8]}")
    exchange = f"{broker.name}-x"
    table, sep = f"_kombu.binding.{exchange}", "\x06\x16"
    learn = publisher._RawShape.learn.__func__
    calls: list[int] = []

    def learn_then_move(cls: Any, *args: Any, **kwargs: Any) -> Any:
        shape = learn(cls, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:  # after the first message: the routing key now leads elsewhere
            (member,) = broker.client.smembers(table)  # routing key, pattern, queue
            assert member.decode().endswith(sep + broker.name)
            broker.client.srem(table, member)
            broker.client.sadd(table, member.decode()[: -len(broker.name)] + moved.name)
        return shape

    monkeypatch.setattr(publisher._RawShape, "learn", classmethod(learn_then_move))
    queues = current_app.amqp.queues
    queues[broker.name] = Queue(broker.name, Exchange(exchange, type="topic"), routing_key=broker.name)
    try:
        submit_many(EFFECT, [{"idempotency_key": f"m{i}"} for i in range(4)], queue=broker.name)
        assert broker.keys() == ["m0"]
        assert moved.keys() == ["m1", "m2", "m3"]
    finally:
        queues.pop(broker.name, None)
        moved.clear()
        broker.client.delete(table, f"_kombu.binding_permanent.{exchange}")
    assert len(celery_sends) == 4
