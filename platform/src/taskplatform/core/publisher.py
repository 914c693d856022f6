"""Publishing ledger rows to the broker: the outbox's second half.

A row is always committed before its message is published (``publish_on_commit``), so a
crash in between leaves a row the rescuer re-publishes, never a message without a row.
A failed publication is logged and left to the rescuer: the caller's request succeeds.

A publication never waits for a result backend: see ``message_options``.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from billiard.exceptions import SoftTimeLimitExceeded
from django.core.signals import setting_changed
from django.db import transaction

from .. import tracing
from .validation import registered_task

if TYPE_CHECKING:
    from ..models import Execution

log = logging.getLogger("taskplatform.publisher")

#: Message headers that point a worker at its ledger row.
HEADER_EXECUTION = "tp_execution"
HEADER_KEY = "tp_key"
#: The job definition's lease in seconds, when it sets one: the first claim takes it from the
#: message rather than reading the job in its statement (see ``core/_pg.py``).
HEADER_LEASE = "tp_lease"
#: The task id the ledger published the message under. A message whose own id is another
#: carries the ledger headers of another message: a parent's, forwarded to a child by code
#: that passes ``self.request.headers`` on (``IdempotentTask`` runs it as a call of its own).
HEADER_TASK_ID = "tp_task_id"


def forwarded(headers: dict[str, Any], task_id: str | None) -> bool:
    """Whether ``headers``, a received message's, carry another message's ledger headers (its
    ``tp_task_id`` is not the message's own id). A message of a publisher older than the
    header is taken for its own."""
    return headers.get(HEADER_TASK_ID, task_id) != task_id


def new_task_id() -> str:
    """A fresh Celery task id for one publication."""
    return str(uuid.uuid4())


def message_options(execution: Execution, *, task_id: str, countdown: float | None) -> dict[str, Any]:
    """``send_task`` options for one publication of ``execution``.

    ``ignore_result`` is the task's own setting (True for every ``IdempotentTask`` unless it
    opts out: the ledger stores results), as ``Task.apply_async`` passes it. ``send_task`` by
    name does not: without it, it first subscribes to the task's result on the result backend
    (Celery's Redis backend does, for an ``AsyncResult`` nobody here holds), and with that
    backend down it retried for about 20 s and then failed the publication, and every later
    one of the process (scenario 12 of the fault catalogue). The worker reads the same value
    from the task, so nothing changes there.
    """
    options: dict[str, Any] = {
        "task_id": task_id,
        "headers": {HEADER_EXECUTION: execution.pk, HEADER_KEY: execution.idempotency_key, HEADER_TASK_ID: task_id},
    }
    task = registered_task(execution.task_name)
    if task is not None and task.ignore_result:
        options["ignore_result"] = True
    if execution.queue:
        options["queue"] = execution.queue
    if execution.priority is not None:
        options["priority"] = execution.priority
    if countdown:
        options["countdown"] = countdown
    job = execution.job
    if job is not None:
        if job.lease_seconds:
            options["headers"][HEADER_LEASE] = job.lease_seconds
        if job.soft_time_limit_seconds:
            options["soft_time_limit"] = job.soft_time_limit_seconds
        if job.time_limit_seconds:
            options["time_limit"] = job.time_limit_seconds
    return options


#: What a worker raises into a running task to stop it: its soft time limit, an ``Exception``.
#: ``publish``, ``publish_many`` and the learning of a shape let it through, so a task that
#: publishes when its limit fires stops there (its rows stay due for the rescuer), instead of
#: going on past its limit after a "publication failed" warning.
_TASK_CONTROL = (SoftTimeLimitExceeded,)


def _require_task_id(task_id: str) -> None:
    """Refuse a publication without its task id: Celery would make one up, while the message's
    ``tp_task_id`` stayed empty, so the worker would take it for a forwarded copy and run it as
    a call of its own, and the row, never claimed, would be published and run again."""
    if not task_id or not isinstance(task_id, str):
        raise ValueError(f"a ledger message needs its task id, not {task_id!r}")


def publish(execution: Execution, *, task_id: str, countdown: float | None = None) -> bool:
    """Send the message for ``execution`` now; False (logged) if the broker refused it.
    ``ValueError`` without a task id (``_require_task_id``): a caller's bug, not a publication
    that failed.

    The message is Celery's, built the way ``publish_many`` builds its messages: from a
    prototype per message shape that this thread keeps between calls (``_shared_prototypes``),
    so a ``submit()`` does not pay for Celery's option merging, header building and queue
    declaration every time (measured: about half of a publication's CPU). Inside a running
    task, whose id goes into every message it sends, ``send_task`` builds each message.
    """
    from celery import current_app

    _require_task_id(task_id)
    try:
        prototypes = _shared_prototypes(current_app)
        if prototypes is None:
            with tracing.publishing(execution.trace_context, execution.task_name, task_id):
                current_app.send_task(
                    execution.task_name,
                    args=execution.args,
                    kwargs=execution.kwargs,
                    **message_options(execution, task_id=task_id, countdown=countdown),
                )
        else:
            with current_app.producer_or_acquire() as producer:
                _BatchSender(current_app, producer, batched=False, prototypes=prototypes).send(
                    execution, task_id, countdown
                )
    except _TASK_CONTROL:  # the running task's soft time limit: not a failed publication
        raise
    except Exception:  # the row is safe in the ledger; the rescuer publishes it again
        log.warning(
            "publication failed; the rescuer will publish it again",
            exc_info=True,
            extra={
                "execution_id": execution.pk,
                "idempotency_key": execution.idempotency_key,
                "celery_task_id": task_id,
            },
        )
        return False
    return True


class _Shared(threading.local):
    """One thread's message prototypes for ``publish``, and the configuration they were built
    under (``_shared_prototypes``)."""

    fingerprint: tuple[Any, ...] = ()
    settings: tuple[Any, ...] = ()  # the settings' values, held so that their ids stay theirs
    prototypes: dict[tuple[Any, ...], _Prototype | None]

    def __init__(self) -> None:
        self.prototypes = {}


_SHARED = _Shared()

#: Bumped whenever Django changes a ``CELERY_*`` setting (``override_settings``), which Celery
#: reads through its configuration's Django layer, not through ``conf.changes``.
_DJANGO_CELERY_SETTINGS = [0]


def _on_setting_changed(*, setting: str, **_: Any) -> None:
    if setting.startswith("CELERY"):
        _DJANGO_CELERY_SETTINGS[0] += 1


setting_changed.connect(_on_setting_changed, dispatch_uid="taskplatform.publisher.prototypes")


def _shared_prototypes(app: Any) -> dict[tuple[Any, ...], _Prototype | None] | None:
    """The calling thread's prototypes for ``publish`` (per thread: a message names the
    thread's ``reply_to``), or None inside a running task (its ids go into each message).

    They are dropped whenever what a prototype holds may have changed: another app, another
    process (a message names the process that sent it: ``origin``), a setting assigned on the
    app (every setting's identity is compared, about a microsecond), or a ``CELERY_*`` Django
    setting changed (``override_settings``). Not seen: a setting's value changed in place (an
    item added to a routes dict already set, ``app.amqp.queues.add``) or a task's attribute
    assigned at run time; assign the setting anew.
    """
    if app.current_worker_task is not None:
        return None
    app = getattr(app, "_get_current_object", lambda: app)()  # ``current_app`` is a proxy
    changes = app.conf.changes
    values = tuple(changes.values())
    fingerprint = (app, os.getpid(), _DJANGO_CELERY_SETTINGS[0], tuple(changes), tuple(map(id, values)))
    shared = _SHARED
    if shared.fingerprint != fingerprint:
        shared.fingerprint, shared.settings, shared.prototypes = fingerprint, values, {}
    return shared.prototypes


def publish_on_commit(execution: Execution, *, task_id: str, countdown: float | None, robust: bool = True) -> None:
    """Publish once the current transaction commits (at once outside a transaction).

    ``publish`` logs every failure but the running task's soft time limit (``_TASK_CONTROL``)
    and a missing task id (``_require_task_id``).
    ``robust=False``, for a ``submit()`` from the caller's code, lets that limit reach the
    code whose commit ran the publication (Django's robust hooks would log it and go on); the
    ledger's own publications (retries, waits) keep Django's robust hooks.
    """
    transaction.on_commit(lambda: publish(execution, task_id=task_id, countdown=countdown), robust=robust)


#: Broker operations a batch buffers before it sends them (kombu's ``Producer.batch``).
PUBLISH_BATCH_SIZE = 1000
#: At most about this many characters of messages written by ``_RawShape`` wait for one
#: round trip (their ``LPUSH`` commands are built whole in the client's buffer).
RAW_PUSH_CHARACTERS = 8 * 1024 * 1024

#: ``message_options`` that differ from message to message (set per message by ``_BatchSender``).
_PER_MESSAGE = frozenset({"task_id", "headers"})


class _BatchSender:
    """Builds and sends the messages of one batch on one producer.

    Celery's ``send_task`` spends most of its time per message on work that is the same for
    every message of a batch: merging the task's options, the time limits, the parent task,
    routing, building the headers (``create_task_message``) and declaring the queue.
    Measured on 10,000 messages in one kombu batch: about 300 µs a message through
    ``send_task``, about 65 µs through this sender, of which about 57 µs are kombu's own
    ``Producer.publish``. So the sender builds one message with Celery's own
    ``create_task_message`` per message shape (task, queue, priority, job) and per message
    changes only what differs: the task id (also the root id and correlation id), the
    arguments and their reprs, and the ledger headers. Each message then goes through
    Celery's ``send_task_message`` like any other, so the ``before_task_publish`` and
    ``after_task_publish`` signals, the ``task-sent`` event and the delivery mode are
    Celery's, and so is the route (Celery's router, run once per shape when no
    ``task_routes`` are configured, else for every message since a router may look at the
    arguments). ``tests/ledger/test_submit_many.py`` compares the messages, signals and
    events with ``publish``'s.

    A message this sender cannot build that way (a countdown, which Celery turns into an
    ETA and, on quorum queues, a delayed-delivery route; an ``expires`` option; a task that
    keeps results, whose result Celery subscribes to; protocol 1) goes through
    ``send_task`` on the same producer. One difference remains: a batch submitted from
    inside a running task is not added to that task's result trail (``add_to_parent``),
    which only tasks that store results have.
    """

    def __init__(
        self,
        app: Any,
        producer: Any,
        *,
        batched: bool,
        prototypes: dict[tuple[Any, ...], _Prototype | None] | None = None,
    ) -> None:
        self.app = app
        self.amqp = app.amqp
        self.producer = producer
        # Inside a kombu batch a publication only buffers commands: once the first message of
        # a shape has connected and declared its queue (with Celery's retry policy, which
        # also bounds the connection attempts), a retry has nothing to retry; the flush is
        # never retried, by kombu's design. Outside a batch, Celery's policy every time.
        self.retry = False if batched else None
        self.started: set[int] = set()  # the prototypes whose first message was sent
        # ``publish`` lends the thread's prototypes, which outlive this sender: then a job that is
        # not loaded cannot have one (its limits may change between two publications).
        self.shared = prototypes is not None
        self.prototypes: dict[tuple[Any, ...], _Prototype | None] = {} if prototypes is None else prototypes
        self.reprs = (app.amqp.argsrepr_maxsize, app.amqp.kwargsrepr_maxsize)
        # Inside a kombu batch on Redis: per prototype, the Redis list and the message kombu
        # wrote for its first message (``_RawShape``), or None where kombu must write each one.
        self.raw: dict[int, _RawShape | None] = {} if batched else None  # type: ignore[assignment]
        # Learnt from a shape's first message, waiting for its second to confirm it (``_RawShape``).
        self.learning: dict[int, _RawShape] = {}
        self.raw_pending: dict[bytes | str, list[str]] = {}
        self.raw_buffered = [0, 0]  # messages and characters in ``raw_pending``
        self.kombu_batch: Any = None  # the kombu batch the messages go through, if any

    @cached_property
    def repr_levels(self) -> int:
        """Celery's ``task_repr_maxlevels``, read when a ``saferepr`` needs it (a setting
        lookup costs as much as the quick repr of a list of ids)."""
        return int(self.app.conf.task_repr_maxlevels)

    def send(self, execution: Execution, task_id: str, countdown: float | None) -> None:
        _require_task_id(task_id)
        prototype = None
        if not countdown:
            # What ``message_options`` reads besides the task id and the execution's own headers.
            job = _job_shape(execution)
            if not (self.shared and job[0] == "job"):
                shape = (execution.task_name, execution.queue, execution.priority, *job)
                if shape not in self.prototypes:
                    self.prototypes[shape] = self._prototype(execution)
                prototype = self.prototypes[shape]
        with tracing.publishing(execution.trace_context, execution.task_name, task_id):
            if prototype is None:
                self.app.send_task(
                    execution.task_name,
                    args=execution.args,
                    kwargs=execution.kwargs,
                    producer=self.producer,
                    **message_options(execution, task_id=task_id, countdown=countdown),
                )
            else:
                self._send(prototype, execution, task_id)

    def _prototype(self, execution: Execution) -> _Prototype | None:
        """What ``send_task`` builds for ``execution``'s message (the same steps, in the same
        order) but the per-message fields, or None when its message must go through ``send_task``."""
        from kombu import Queue
        from kombu.common import Broadcast

        app, name = self.app, execution.task_name
        options = message_options(execution, task_id="", countdown=None)
        if app.conf.task_protocol != 2 or not options.get("ignore_result"):
            return None
        lease = options["headers"].get(HEADER_LEASE)
        for per_message in _PER_MESSAGE:
            del options[per_message]
        task = app.tasks.get(name)
        if task is not None and hasattr(task, "_get_exec_options"):
            defaults = {k: v for k, v in task._get_exec_options().items() if v is not None}
            options = dict(defaults, **options)
        if options.get("expires") is not None or options.get("countdown") or options.get("eta"):
            return None
        for name_ in ("expires", "countdown", "eta"):
            options.pop(name_, None)
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        ignore_result = options.pop("ignore_result", None)
        root_id = parent_id = None
        parent = app.current_worker_task
        if parent:
            root_id = parent.request.root_id or parent.request.id
            parent_id = parent.request.id
            if app.conf.task_inherit_parent_priority:
                options.setdefault("priority", parent.request.delivery_info.get("priority"))
        message = self.amqp.create_task_message(
            "prototype", name, [], {},
            reply_to=app.thread_oid, time_limit=time_limit, soft_time_limit=soft_time_limit,
            create_sent_event=app.conf.task_send_sent_event, root_id=root_id, parent_id=parent_id,
            ignore_result=ignore_result, **options,
        )  # fmt: skip
        for stamp in options.pop("stamped_headers", None) or []:
            options.pop(stamp, None)
        routed = None
        if not self.amqp.router.routes:  # no task_routes: the route depends on the options alone
            routed = self.amqp.router.route(dict(options), name, None, None, task)
            queue = routed.get("queue")
            fixed_queue = isinstance(queue, Queue) and not isinstance(queue, Broadcast)
            return _Prototype(message, options, routed, task, fixed_queue=fixed_queue, lease=lease)
        return _Prototype(message, options, routed, task, fixed_queue=False, lease=lease)

    def _send(self, prototype: _Prototype, execution: Execution, task_id: str) -> None:
        from celery.utils.saferepr import saferepr

        headers0, properties0, body0, event0 = prototype.message
        args, kwargs = execution.args or (), execution.kwargs or {}  # as Celery's ``create_task_message``
        argsize, kwargsize = self.reprs
        argsrepr = _plain_repr(args, argsize) or saferepr(args, argsize, maxlevels=self.repr_levels)
        kwargsrepr = _plain_repr(kwargs, kwargsize) or saferepr(kwargs, kwargsize, maxlevels=self.repr_levels)
        root_id = headers0["root_id"] if headers0["parent_id"] else task_id
        # A copy, its lists and dicts too: a ``before_task_publish`` receiver may change them.
        headers = {k: (v.copy() if type(v) in (dict, list) else v) for k, v in headers0.items()}
        headers.update(id=task_id, root_id=root_id, argsrepr=argsrepr, kwargsrepr=kwargsrepr)
        headers[HEADER_EXECUTION] = execution.pk
        headers[HEADER_KEY] = execution.idempotency_key
        headers[HEADER_TASK_ID] = task_id
        if prototype.lease is not None:
            headers[HEADER_LEASE] = prototype.lease
        properties = dict(properties0)
        properties["correlation_id"] = task_id
        event = None
        if event0 is not None:
            event = dict(event0)
            event.update(uuid=task_id, root_id=root_id, args=argsrepr, kwargs=kwargsrepr)
        routed = prototype.routed
        if routed is None:  # task_routes may route on the arguments: Celery's router, every message
            routed = self.amqp.router.route(dict(prototype.options), execution.task_name, args, kwargs, prototype.task)
        retry = self.retry
        raw = self.raw.get(id(prototype)) if self.raw is not None else None
        if raw is not None:
            if routed.get("headers"):
                headers.update(routed["headers"])
            self._push(raw.key, raw.payload(headers, task_id, (args, kwargs, dict(body0[2]))))
            return
        first = id(prototype) not in self.started
        if first:  # Celery declares the queue and connects, its way
            self.started.add(id(prototype))
            retry = None
            if prototype.fixed_queue and _declared(self.producer, routed):
                routed = dict(routed, declare=[])  # on this connection already (``publish``)
        elif prototype.fixed_queue and retry is False:
            # Inside a batch that kombu buffers (no retry, so no reconnect within it): declared
            # with the first message, not with every message. Where kombu retries a
            # publication, it reconnects and repeats the same ``declare``: Celery's, then.
            routed = dict(routed, declare=[])  # a list of its own: kombu may append to it
        # A ``task-sent`` event is a second command in kombu's pipeline: such a shape is not
        # learnt (``_RawShape.learn``), and Celery sends each message and its event.
        capture = self.raw is not None and prototype.fixed_queue and (first or id(prototype) in self.learning)
        written = _batch_commands(self.producer) if capture else None
        sent_headers = headers.copy()
        self.amqp.send_task_message(
            self.producer,
            execution.task_name,
            (headers, properties, (args, kwargs, dict(body0[2])), event),
            retry=retry,
            **routed,
        )
        if capture:
            learnt = _RawShape.learn(
                self.producer,
                written,
                sent_headers,
                routed,
                task_id,
                (args, kwargs, dict(body0[2])),
                self.learning.pop(id(prototype), None),
            )
            if learnt is not None and first:
                self.learning[id(prototype)] = learnt  # written from only once the second agrees
            else:
                self.raw[id(prototype)] = learnt

    def _push(self, key: bytes | str, payload: str) -> None:
        self.raw_pending.setdefault(key, []).append(payload)
        buffered = self.raw_buffered
        buffered[0] += 1
        buffered[1] += len(payload)
        if buffered[0] >= PUBLISH_BATCH_SIZE or buffered[1] >= RAW_PUSH_CHARACTERS:
            self.flush_raw()

    def flush_raw(self) -> None:
        """Send the messages ``_RawShape`` wrote: one ``LPUSH`` per list, all in one round trip,
        on the producer's Redis connection, once ``PUBLISH_BATCH_SIZE`` messages (whatever
        their lists) or ``RAW_PUSH_CHARACTERS`` are waiting, as kombu's batch sends its
        commands. A list gets them in the order they were written, as from kombu's ``LPUSH``
        of one at a time; and kombu's buffered messages go first, so a shape's first message
        (through kombu) is ahead of the others. Across shapes sharing a list the order may
        differ from the items' (kombu's own batch would keep it): kombu's messages of a
        flush go before the written ones. Celery promises no order between messages (a
        worker prefetches and several consume), and the ledger does not depend on one.
        The routes are the first message's: a binding added to the exchange during the
        batch sees none of its written messages, as if the batch were sent at once then.
        No retry, as for kombu's batch: a failure reaches ``publish_many``, which leaves the
        rows to the rescuer."""
        if not self.raw_pending:
            return
        if self.kombu_batch is not None:  # kombu's messages first: a shape's first one is ahead
            self.kombu_batch.flush()
        pending, self.raw_pending = self.raw_pending, {}
        self.raw_buffered = [0, 0]
        with self.producer.channel.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            for key, payloads in pending.items():
                pipe.lpush(key, *payloads)
            pipe.execute()


def _batch_commands(producer: Any) -> tuple[Any, int] | None:
    """``producer``'s active kombu batch and how many commands its Redis pipeline holds, or
    None (a publish receiver, no batch, not Redis, or a kombu whose batch is built otherwise)."""
    from celery import signals

    if signals.before_task_publish.receivers or signals.after_task_publish.receivers or signals.task_sent.receivers:
        return None  # a receiver sees, and may change, every message: Celery's way for each
    # Not ``producer.channel`` yet: before the first publication it would connect with the
    # connection's own retry policy, not Celery's (``learn`` looks at it after).
    if getattr(producer.connection.transport, "driver_type", None) != "redis":
        return None
    state = getattr(getattr(producer, "_batch_local", None), "current", None)
    if state is None or getattr(state, "immediate", True):
        return None
    session = getattr(state, "session", None)  # made by the batch's first publication
    stack = [] if session is None else getattr(getattr(session, "pipeline", None), "command_stack", None)
    return (state, len(stack)) if isinstance(stack, list) else None


class _RawShape:
    """The messages of one prototype inside a kombu batch on Redis, written here rather than by
    Celery's ``send_task_message`` and kombu's ``Producer.publish`` one at a time.

    Measured on 10,000 messages of one batch: kombu's publication (serialise, wrap, route,
    one ``LPUSH`` command each in its pipeline) was about 45 µs a message, most of what
    ``submit_many`` spent after the commit. Of each message of a shape only the task id (in
    the headers and as ``correlation_id``), the arguments, their reprs, the ledger headers
    and kombu's ``delivery_tag`` differ; the rest is what kombu wrote for the shape's first
    message. So that first message goes through Celery and kombu as before, and the
    ``LPUSH`` kombu buffered for it is kept: its list and its JSON. A later message is that
    JSON with those fields replaced (the body serialised and encoded as kombu does, with
    kombu's functions), and the batch's messages go to their list in one ``LPUSH`` per
    thousand (``_BatchSender.flush_raw``).

    ``learn`` builds the first message again this way and compares it with what kombu wrote,
    field by field; then the second message also goes through kombu, and is compared with
    what the first one's template writes for it, so a field kombu sets per message besides
    the four rewritten is caught. Any difference (a compression, a serializer, another
    transport's format, a kombu that writes otherwise), or a message that did not become
    exactly one buffered ``LPUSH``, and every message of the shape goes through kombu. It is not used
    where a ``before_task_publish``, ``after_task_publish`` or (deprecated) ``task_sent``
    receiver is connected (each message is theirs to see and change: OpenTelemetry's
    instrumentation is one), where ``task-sent`` events are on (each is a second command in
    kombu's pipeline), nor for a queue that is not one fixed list (``_Prototype.fixed_queue``:
    not with ``task_routes``, which may route on the arguments), nor with a
    ``global_keyprefix`` (kombu's key is already prefixed). A wrapper patched around kombu's
    ``Producer.publish`` or Celery's ``send_task_message``, rather than connected to the
    signals, sees a shape's first two messages only. ``tests/ledger/test_submit_many.py``
    compares the messages.
    """

    __slots__ = ("encode", "key", "properties", "template")

    def __init__(self, key: bytes | str, template: dict[str, Any], encode: Any) -> None:
        self.key = key
        self.template = template
        self.properties = template["properties"]
        self.encode = encode

    @classmethod
    def learn(
        cls,
        producer: Any,
        before: tuple[Any, int] | None,
        headers: dict[str, Any],
        routed: dict[str, Any],
        task_id: str,
        body: tuple[Any, ...],
        candidate: _RawShape | None = None,
    ) -> _RawShape | None:
        """The shape of the message kombu just buffered, or None. With ``candidate`` (the
        shape learnt from the first message), this is the second message: ``candidate`` if
        it writes this one as kombu did, else None. So a field kombu or its transport sets
        per message other than the ones ``payload`` rewrites (a sequence number, a time) is
        never copied from the first message into the others."""
        if before is None:
            return None
        try:
            return cls._learn(producer, before, headers, routed, task_id, body, candidate)
        except _TASK_CONTROL:  # the task's limit, not a shape kombu writes otherwise
            raise
        except Exception:  # whatever kombu holds, its own publication of every message is the answer
            _warn_unlearnt("learning the shape failed", exc_info=True)
            return None

    @classmethod
    def _learn(
        cls,
        producer: Any,
        before: tuple[Any, int],
        headers: dict[str, Any],
        routed: dict[str, Any],
        task_id: str,
        body: tuple[Any, ...],
        candidate: _RawShape | None,
    ) -> _RawShape | None:
        from kombu.utils.json import loads

        state, count = before
        stack = getattr(getattr(state.session, "pipeline", None), "command_stack", None)
        if not isinstance(stack, list) or len(stack) != count + 1:
            return None  # flushed meanwhile, or more than one command (an expiring queue)
        command = stack[-1][0]
        if len(command) != 3 or str(command[0]).upper() != "LPUSH":
            return None
        written = loads(command[2])
        if not isinstance(written, dict) or not isinstance(written.get("properties"), dict):
            return None
        channel = producer.channel  # connected by the publication
        if getattr(channel, "global_keyprefix", None) or not hasattr(channel, "conn_or_acquire"):
            return None
        encoding = channel.body_encoding

        def encode(value: tuple[Any, ...]) -> Any:
            from kombu.serialization import dumps

            _type, content_encoding, data = dumps(value, serializer="json")
            raw: Any = data.encode(content_encoding) if isinstance(data, str) else data
            return channel.encode_body(raw, encoding)[0]

        shape = cls(command[1], written, encode) if candidate is None else candidate
        if command[1] != shape.key:
            return None
        if routed.get("headers"):
            headers = dict(headers, **routed["headers"])
        again = loads(shape.payload(headers, task_id, body))
        tag = written["properties"].get("delivery_tag")
        again["properties"]["delivery_tag"] = tag
        if again != written or written["properties"].get("correlation_id") != task_id:
            _warn_unlearnt("kombu wrote the message otherwise")
            return None
        return shape

    def payload(self, headers: dict[str, Any], task_id: str, body: tuple[Any, ...]) -> str:
        from kombu.utils.json import dumps

        message = dict(self.template)
        message["body"] = self.encode(body)
        message["headers"] = headers
        properties = dict(self.properties)
        properties["correlation_id"] = task_id
        properties["delivery_tag"] = str(uuid.uuid4())
        message["properties"] = properties
        return dumps(message)


_UNLEARNT_WARNED: set[str] = set()


def _warn_unlearnt(why: str, **kwargs: Any) -> None:
    """Say once a process why a batch's messages all go through kombu (slower, not wrong): a
    new kombu, a compression, or a bug here; once, since it holds for every batch."""
    if why not in _UNLEARNT_WARNED:
        _UNLEARNT_WARNED.add(why)
        log.warning("batch messages go through kombu one by one: %s", why, **kwargs)


def _declared(producer: Any, routed: dict[str, Any]) -> bool:
    """Whether a publication routed by ``routed`` may skip its queue's declaration: on Redis,
    for a queue of a direct exchange that Celery sends by the queue's name (no exchange and
    routing key of the task's own), which needs nothing declared, once kombu records the queue
    as declared on the producer's connection (a new connection starts with no record). kombu
    binds a copy of the queue, and of its exchange, to the channel before it looks at that
    record: most of the cost of a declaration that does nothing. Elsewhere (RabbitMQ: a retry
    after a reconnect must declare again; a named exchange on Redis, which routes by the
    declared bindings) Celery's declaration."""
    queue = routed["queue"]
    connection: Any = getattr(producer, "connection", None)
    declared = getattr(connection, "declared_entities", None)
    if declared is None or not getattr(connection, "connected", False):
        return False  # not connected yet: the publication connects and declares, Celery's way
    if getattr(connection.transport, "driver_type", None) != "redis":
        return False
    if getattr(queue.exchange, "type", None) != "direct" or (routed.get("exchange") and routed.get("routing_key")):
        return False  # ``exchange`` is None for a queue of several bindings
    return bool(queue.can_cache_declaration) and hash(queue) in declared


def _job_shape(execution: Execution) -> tuple[Any, ...]:
    """What ``message_options`` reads of the execution's job: its lease and time limits when
    the job is loaded (jobs with the same limits share a prototype: the beat's slots of a
    hundred thousand jobs built one each, a third of a slot's publication), else its id (not
    a query per message)."""
    if execution.job_id is None:
        return (None,)
    if not type(execution).job.is_cached(execution):
        return ("job", execution.job_id)
    job = execution.job
    if job is None:
        return (None,)
    return ("limits", job.lease_seconds, job.soft_time_limit_seconds, job.time_limit_seconds)


_NUMBERS = frozenset({int, float, bool, type(None)})


def _plain_key(key: object) -> bool:
    return type(key) is str and key.isidentifier() and key.isascii()


def _plain_repr(value: Any, maxsize: int) -> str | None:
    """``repr(value)`` when it is certainly what Celery's ``saferepr`` gives (the message's
    ``argsrepr``), else None: a list of numbers, or a dict of identifier keys to numbers,
    shorter than ``maxsize``. ``saferepr`` costs about a fifth of a batch's publication; ids
    are the usual arguments. (``test_submit_many`` checks the equality on random values.)
    """
    if isinstance(value, (list, tuple)):
        if not all(type(v) in _NUMBERS for v in value):
            return None
    elif isinstance(value, dict):
        if not all(
            type(v) in _NUMBERS and type(k) is str and k.isidentifier() and k.isascii() for k, v in value.items()
        ):
            return None
    else:
        return None
    text = repr(value)
    return text if len(text) < maxsize else None


@dataclass(frozen=True)
class _Prototype:
    """One message shape of a batch: Celery's message for it, its options and its route."""

    message: Any  # (headers, properties, body, sent event), as ``create_task_message`` made it
    options: dict[str, Any]  # what ``send_task`` routes and passes to ``send_task_message``
    routed: dict[str, Any] | None  # the routed options, when they do not depend on arguments
    task: Any
    fixed_queue: bool  # one declarable queue for every message: declared with the first one
    lease: int | None = None  # the job's lease (``HEADER_LEASE``), the same for the shape


def publish_many(entries: Sequence[tuple[Execution, str, float | None]]) -> bool:
    """Send the messages for many ``(execution, task id, countdown)`` now, through one producer.

    On a transport that can batch (kombu's ``Producer.batch``: the Redis transport buffers
    the ``LPUSH`` commands in a pipeline and sends up to ``PUBLISH_BATCH_SIZE`` in one round
    trip) the batch costs a round trip per thousand messages; elsewhere (RabbitMQ, or Redis
    with client-side retries, which kombu will not batch because a replayed pipeline could
    duplicate writes) each message is sent at once on the same producer. The messages are
    Celery's (see ``_BatchSender``).

    A failure is logged and left to the rescuer, like ``publish``'s: the rows are committed
    with a due time, so any message the broker did not take is published again, and any
    copy it did take twice is absorbed by the claim. The first failure ends the batch (with
    the broker down, trying each message would cost Celery's retry policy each). Returns
    False on a failure.
    """
    if not entries:
        return True
    from celery import current_app

    sent = 0
    try:
        with current_app.producer_or_acquire() as producer:
            batched = bool(getattr(producer, "supports_batch_publish", False))  # kombu >= 5.7
            sender = _BatchSender(current_app, producer, batched=batched)
            with producer.batch(max_size=PUBLISH_BATCH_SIZE) if batched else nullcontext() as batch:
                sender.kombu_batch = batch
                for execution, task_id, countdown in entries:
                    sender.send(execution, task_id, countdown)
                    sent += 1
                sender.flush_raw()
    except _TASK_CONTROL:  # the running task's soft time limit: not a failed publication
        raise
    except Exception:  # the rows are safe in the ledger; the rescuer publishes them again
        log.warning(
            "batch publication failed; the rescuer will publish its rows again",
            exc_info=True,
            extra={
                "executions": len(entries),
                "built": sent,
                "first_execution_id": entries[0][0].pk,
                "last_execution_id": entries[-1][0].pk,
            },
        )
        return False
    return True


def publish_many_on_commit(entries: Sequence[tuple[Execution, str, float | None]], *, robust: bool = True) -> None:
    """``publish_many`` once the current transaction commits (at once outside a transaction);
    ``robust`` as for ``publish_on_commit``."""
    if entries:
        transaction.on_commit(lambda: publish_many(entries), robust=robust)
