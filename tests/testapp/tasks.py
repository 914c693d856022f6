"""Instrumented tasks for the integration tests: each leaves observable effects."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import shared_task
from celery.exceptions import Ignore

from taskplatform import Flow, Step
from taskplatform.tasks import IdempotentTask

from .models import Effect, EffectRaw, Gate, Span


class TransientError(Exception):
    """Retryable."""


class FatalError(Exception):
    """Never retried."""


def _wait_gate(task: IdempotentTask, gate: str, timeout: float = 60) -> None:
    """Block until the test opens ``<gate>:<fencing token>`` (so each attempt has its own gate)."""
    name = f"{gate}:{task.fencing_token}"
    deadline = time.monotonic() + timeout
    while not Gate.objects.filter(name=name, open=True).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {name} never opened")
        time.sleep(0.05)


def _raw(task: IdempotentTask, phase: str) -> None:
    EffectRaw.objects.create(
        key=task.idempotency_key, phase=phase, pid=os.getpid(), fencing_token=task.fencing_token or 0
    )


@shared_task(base=IdempotentTask, bind=True, name="testapp.effect")
def effect(self: IdempotentTask, seconds: float = 0.0, gate: str = "") -> dict[str, Any]:
    """Record an attempt, optionally wait, then commit the one effect for this key."""
    _raw(self, "started")
    if gate:
        _wait_gate(self, gate)
    if seconds:
        time.sleep(seconds)  # the body's own work, not synchronisation
    Effect.objects.create(key=self.idempotency_key, fencing_token=self.fencing_token or 0)
    _raw(self, "done")
    return {"pid": os.getpid(), "token": self.fencing_token}


@shared_task(base=IdempotentTask, bind=True, name="testapp.effect_losing_prepared_statements")
def effect_losing_prepared_statements(self: IdempotentTask) -> None:
    """Record an attempt and commit its effect, having made the server forget every prepared
    statement of this worker's connection behind psycopg's back (what a transaction-mode
    pooler's switch of server connection, or a ``DISCARD ALL``, looks like to the client): the
    ledger's success, prepared on an earlier task, is then refused by the server."""
    from django.db import connection

    _raw(self, "started")
    connection.ensure_connection()
    connection.connection.pgconn.exec_(b"DEALLOCATE ALL")  # not through psycopg: it must not know
    Effect.objects.create(key=self.idempotency_key, fencing_token=self.fencing_token or 0)
    _raw(self, "done")


def _log_start(task: IdempotentTask) -> None:
    """Record a body start outside the database transaction (a Redis list, no constraint), so an
    atomic body's start is counted even when its transaction rolls back."""
    import redis
    from django.conf import settings

    redis.Redis.from_url(settings.CELERY_BROKER_URL).rpush(
        f"tp-starts:{task.idempotency_key}", f"{task.fencing_token}:{os.getpid()}"
    )


@shared_task(base=IdempotentTask, bind=True, name="testapp.atomic_gated", atomic=True)
def atomic_gated(self: IdempotentTask, gate: str = "") -> dict[str, Any]:
    """An atomic body: log its start outside the transaction, write its effect, wait for a gate."""
    _log_start(self)
    Effect.objects.create(key=self.idempotency_key, fencing_token=self.fencing_token or 0)
    if gate:
        _wait_gate(self, gate)
    return {"token": self.fencing_token}


@shared_task(base=IdempotentTask, bind=True, name="testapp.effect_then_wait")
def effect_then_wait(self: IdempotentTask, gate: str = "") -> None:
    """Not atomic: commit the effect first, then wait (a crash here is after the effect and
    before the ledger records success)."""
    _raw(self, "started")
    Effect.objects.create(key=self.idempotency_key, fencing_token=self.fencing_token or 0)
    if gate:
        _wait_gate(self, gate)


@shared_task(base=IdempotentTask, bind=True, name="testapp.atomic_effect", atomic=True)
def atomic_effect(self: IdempotentTask, fail: bool = False, gate: str = "") -> dict[str, Any]:
    """Write the effect inside the ledger's transaction; optionally fail after writing."""
    Effect.objects.create(key=f"{self.idempotency_key}#{self.fencing_token}", fencing_token=self.fencing_token or 0)
    if gate:
        _wait_gate(self, gate)
    if fail:
        raise FatalError("failing after the write")
    return {"token": self.fencing_token}


@shared_task(
    base=IdempotentTask,
    bind=True,
    name="testapp.always_fails",
    autoretry_for=(TransientError,),
    retry_backoff=1,
    retry_backoff_max=2,
    retry_jitter=True,
    max_retries=3,
)
def always_fails(self: IdempotentTask) -> None:
    _raw(self, "started")
    raise TransientError(f"transient failure on attempt {self.request.retries + 1}")


@shared_task(
    base=IdempotentTask,
    bind=True,
    name="testapp.fatal",
    autoretry_for=(Exception,),
    dont_autoretry_for=(FatalError,),
    max_retries=5,
)
def fatal(self: IdempotentTask) -> None:
    _raw(self, "started")
    raise FatalError("this input can never succeed")


@shared_task(
    base=IdempotentTask,
    bind=True,
    name="testapp.fails_then_succeeds",
    autoretry_for=(TransientError,),
    retry_backoff=1,
    retry_backoff_max=1,
    retry_jitter=False,
    max_retries=5,
)
def fails_then_succeeds(self: IdempotentTask, failures: int = 1) -> int:
    _raw(self, "started")
    if self.request.retries < failures:
        raise TransientError("not yet")
    return self.request.retries + 1


@shared_task(base=IdempotentTask, bind=True, name="testapp.poison", max_retries=2)
def poison(self: IdempotentTask) -> None:
    """Kills its own pool process every time: a poison message."""
    _raw(self, "started")
    os._exit(1)


@shared_task(name="testapp.plain")
def plain(x: int) -> int:
    """A plain Celery task (not idempotent), to show submit() refuses it."""
    return x


@shared_task(base=IdempotentTask, bind=True, name="testapp.explicit_retry")
def explicit_retry(self: IdempotentTask, succeed_on: int = 0) -> int:
    """Asks for retries the Celery way (``raise self.retry(...)``)."""
    _raw(self, "started")
    attempt = self.request.retries + 1
    if attempt == succeed_on:
        return attempt
    try:
        raise TransientError(f"attempt {attempt} not good enough")
    except TransientError as exc:
        raise self.retry(exc=exc, countdown=0, max_retries=2) from exc


@shared_task(base=IdempotentTask, bind=True, name="testapp.sleepy")
def sleepy(self: IdempotentTask, seconds: float = 5) -> None:
    _raw(self, "started")
    time.sleep(seconds)  # the body's own work


@shared_task(base=IdempotentTask, bind=True, name="testapp.log_line")
def log_line(self: IdempotentTask, text: str = "inside the body") -> None:
    """Log one line from the body (structured-logging tests)."""
    logging.getLogger("taskplatform.testapp").warning(text)


@shared_task(base=IdempotentTask, bind=True, name="testapp.flaky_heartbeat")
def flaky_heartbeat(self: IdempotentTask, seconds: float = 10, failures: int = 2) -> dict[str, Any]:
    """Make this process's next ``failures`` lease renewals raise a non-database error, then
    run for ``seconds``: the lease keeper must survive the errors and keep the lease."""
    from taskplatform.core import ledger

    real = ledger.renew_lease
    failed = 0

    def renew_lease(execution_id: int, token: int, lease_seconds: int) -> bool:
        nonlocal failed
        if failed < failures:
            failed += 1
            raise RuntimeError(f"injected lease renewal failure {failed}")
        return real(execution_id, token, lease_seconds)

    _raw(self, "started")
    ledger.renew_lease = renew_lease  # type: ignore[assignment]
    try:
        time.sleep(seconds)  # the body's own work
    finally:
        ledger.renew_lease = real  # type: ignore[assignment]
    _raw(self, f"injected:{failed}")
    if self.lease_lost:
        _raw(self, "lease_lost")
    return {"lease_lost": self.lease_lost}


@shared_task(base=IdempotentTask, bind=True, name="testapp.atomic_ignore", atomic=True)
def atomic_ignore(self: IdempotentTask, gate: str = "") -> None:
    """Write a row in the ledger's transaction, then end with ``Ignore``."""
    _raw(self, "written")
    if gate:
        _wait_gate(self, gate)
    raise Ignore()


@shared_task(base=IdempotentTask, bind=True, name="testapp.atomic_replace", atomic=True)
def atomic_replace(self: IdempotentTask, gate: str = "") -> Any:
    """Write a row in the ledger's transaction, then replace itself with ``testapp.replacement``."""
    _raw(self, "written")
    if gate:
        _wait_gate(self, gate)
    return self.replace(replacement.s(self.idempotency_key, self.execution.pk if self.execution else 0))


@shared_task(base=IdempotentTask, bind=True, name="testapp.plain_replace")
def plain_replace(self: IdempotentTask, gate: str = "") -> Any:
    """Like ``atomic_replace``, not atomic: its write commits at once, then it replaces itself."""
    _raw(self, "written")
    if gate:
        _wait_gate(self, gate)
    return self.replace(replacement.s(self.idempotency_key, self.execution.pk if self.execution else 0))


@shared_task(base=IdempotentTask, bind=True, name="testapp.replacement")
def replacement(self: IdempotentTask, parent_key: str, parent_id: int) -> None:
    """Record that the replacement ran, and what it saw of its parent: its row and its state."""
    from taskplatform.models import Execution

    parent_rows = EffectRaw.objects.filter(key=parent_key, phase="written").count()
    parent_state = Execution.objects.values_list("state", flat=True).get(pk=parent_id)
    EffectRaw.objects.create(
        key=parent_key, phase=f"replacement:{parent_rows}:{parent_state}", pid=os.getpid(), fencing_token=0
    )


@shared_task(base=IdempotentTask, bind=True, name="testapp.until_lease_lost")
def until_lease_lost(self: IdempotentTask, timeout: float = 30) -> bool:
    """Work in small steps until ``self.lease_lost`` says another party owns the key."""
    _raw(self, "started")
    deadline = time.monotonic() + timeout
    while not self.lease_lost:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # one step of the body's own work
    _raw(self, "lease_lost")
    return True


@shared_task(base=IdempotentTask, bind=True, name="testapp.soft_limited")
def soft_limited(self: IdempotentTask, seconds: float = 10, on_soft: str = "return") -> str:
    """Work for ``seconds``; at the soft time limit either clean up and return ("return": one
    effect, the clean-up) or ignore it and keep working ("ignore": the hard limit ends it)."""
    from celery.exceptions import SoftTimeLimitExceeded

    _raw(self, "started")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(max(0.0, deadline - time.monotonic()))  # the body's own work
        except SoftTimeLimitExceeded:
            _raw(self, "soft_limit")
            if on_soft == "return":
                Effect.objects.create(key=self.idempotency_key, fencing_token=self.fencing_token or 0)
                return "cleaned up"
    return "finished"


@shared_task(base=IdempotentTask, bind=True, name="testapp.effect_elsewhere")
def effect_elsewhere(self: IdempotentTask, gate_file: str) -> None:
    """A non-atomic body whose effect does not go through the connection the ledger uses (an
    HTTP call, another database): it waits for a file, not the database, then writes through
    a fresh connection. A partition of its host cannot make it fail the way a body that keeps
    using a dead connection does."""
    from pathlib import Path

    from django.db import connection

    _raw(self, "started")
    gate = Path(f"{gate_file}:{self.fencing_token}")
    deadline = time.monotonic() + 120
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate file {gate} never appeared")
        time.sleep(0.05)
    connection.close()  # whatever the old connection's fate, the effect goes out on a new one
    Effect.objects.create(key=self.idempotency_key, fencing_token=self.fencing_token or 0)


@shared_task(base=IdempotentTask, bind=True, name="testapp.doubled_with_result", ignore_result=False)
def doubled_with_result(self: IdempotentTask, n: int) -> int:
    """Keeps its result in Celery's result backend too (``ignore_result=False``): the
    ``.delay().get()`` pattern of an existing project."""
    return 2 * n


#: The object ``shared_result`` returns, changed by its ``after_return`` once Celery is done with it.
SHARED_RESULT: dict[str, Any] = {}


class _ChangesItsResultAfterwards(IdempotentTask):
    def after_return(self, *args: Any, **kwargs: Any) -> None:
        SHARED_RESULT["value"] = "changed after the body returned"


@shared_task(base=_ChangesItsResultAfterwards, bind=True, name="testapp.shared_result")
def shared_result(self: IdempotentTask, n: int) -> dict[str, Any]:
    """Returns a module-level object that its own hook changes right after: the ledger must
    keep what the body returned (``worker/recorder.py`` encodes it before the handoff)."""
    SHARED_RESULT["value"] = n
    return SHARED_RESULT


@shared_task(base=IdempotentTask, bind=True, name="testapp.parent_state")
def parent_state(self: IdempotentTask, key: str) -> None:
    """A callback (``link``): records the state its parent's row has when it runs."""
    from taskplatform.models import Execution

    state = Execution.objects.get(idempotency_key=key).state
    EffectRaw.objects.create(key=f"parent-state:{key}", phase=state, pid=os.getpid())


# --- Django's task API (django-tasks) on the ledger: taskplatform.task_backend ------------------

from django_tasks import task as django_task  # noqa: E402


def _count(key: str, phase: str = "started") -> None:
    EffectRaw.objects.create(key=key, phase=phase, pid=os.getpid())


@django_task(key=lambda order, amount=10: f"receipt:{order}")
def receipt(order: str, amount: int = 10) -> dict[str, Any]:
    """Keyed by the order: the same order enqueued twice is one execution."""
    _count(f"receipt:{order}")
    Effect.objects.create(key=f"receipt:{order}")
    return {"order": order, "amount": amount}


@django_task(takes_context=True, retry_on=(TransientError,), max_retries=3, retry_backoff=1)
def flaky_receipt(context: Any, order: str) -> int:
    """Fails its first attempt (retryable), succeeds on the second: returns the attempt."""
    _count(f"flaky:{order}")
    if context.attempt == 1:
        raise TransientError("the first attempt fails")
    return int(context.attempt)


@django_task(retry_on=(TransientError,), max_retries=1, retry_backoff=1)
def hopeless(order: str) -> None:
    """Fails every attempt: a dead letter after two."""
    _count(f"hopeless:{order}")
    raise TransientError(f"order {order} cannot be done")


@django_task(key=lambda order: None)
def keyless(order: str) -> None:
    """A key function that returns no key: refused at enqueue (else every enqueue is new work)."""


@shared_task(base=IdempotentTask, bind=True, name="testapp.limited")
def limited(self: IdempotentTask, seconds: float = 0.0) -> None:
    """A body under a fleet-wide limit in the tests: records its span (start, then end)."""
    span = Span.objects.create(
        key=self.idempotency_key, pid=os.getpid(), fencing_token=self.fencing_token or 0, started=time.time()
    )
    if seconds:
        time.sleep(seconds)  # the body's own work
    Span.objects.filter(pk=span.pk).update(ended=time.time())


@shared_task(base=IdempotentTask, bind=True, name="testapp.limited_atomic", atomic=True)
def limited_atomic(self: IdempotentTask, seconds: float = 0.0) -> None:
    """An atomic body under a limit: its effect commits with its success, or not at all."""
    Effect.objects.create(key=self.idempotency_key, fencing_token=self.fencing_token or 0)
    if seconds:
        time.sleep(seconds)  # the body's own work


# --- a flow for the tests (tests/integration/test_flows.py) ---------------------------------------


@shared_task(base=IdempotentTask, bind=True, name="testapp.flow_step", atomic=True)
def flow_step(self: IdempotentTask, step: str, order: str, fail_at: str = "", kill_at: str = "", **_: Any) -> dict:
    """A forward step: its effect (``<order>:<step>``) commits with its success, or not at all.
    Fails for good at ``fail_at``; at ``kill_at`` it waits for the test's gate (to be killed)."""
    _log_start(self)
    Effect.objects.create(key=f"{order}:{step}", fencing_token=self.fencing_token or 0)
    if step == fail_at:
        raise FatalError(f"step {step} fails for good")
    if step == kill_at:
        _wait_gate(self, f"flow-kill:{order}:{step}")
    return {"step": step, "token": self.fencing_token}


@shared_task(base=IdempotentTask, bind=True, name="testapp.flow_undo", atomic=True, max_retries=1)
def flow_undo(self: IdempotentTask, step: str, order: str, kill_at: str = "", undo_fails: str = "", **_: Any) -> dict:
    """A compensation: its effect (``<order>:<step>:undo``) commits with its success. At
    ``undo_fails`` it fails for good while the gate ``undo-ok:<order>`` is closed."""
    _log_start(self)
    Effect.objects.create(key=f"{order}:{step}:undo", fencing_token=self.fencing_token or 0)
    if step == undo_fails and not Gate.objects.filter(name=f"undo-ok:{order}", open=True).exists():
        raise FatalError(f"the compensation of {step} fails")
    if f"undo:{step}" == kill_at:
        _wait_gate(self, f"flow-kill:{order}:undo:{step}")
    return {"undone": step}


@shared_task(base=IdempotentTask, bind=True, name="testapp.flow_step_once", atomic=True, max_retries=0)
def flow_step_once(self: IdempotentTask, step: str, order: str, kill_at: str = "", **_: Any) -> dict:
    """``flow_step`` with one attempt only: a worker lost on it dead-letters the step."""
    _log_start(self)
    Effect.objects.create(key=f"{order}:{step}", fencing_token=self.fencing_token or 0)
    if step == kill_at:
        _wait_gate(self, f"flow-kill:{order}:{step}")
    return {"step": step, "token": self.fencing_token}


@shared_task(base=IdempotentTask, bind=True, name="testapp.flow_step_late")
def flow_step_late(self: IdempotentTask, step: str, order: str, **_: Any) -> dict:
    """A non-atomic forward step that waits for the test's gate, then does its effect (which
    commits at once, whatever the ledger then says of the attempt)."""
    _log_start(self)
    _wait_gate(self, f"flow-late:{order}:{step}")
    Effect.objects.create(key=f"{order}:{step}", fencing_token=self.fencing_token or 0)
    return {"step": step, "token": self.fencing_token}


def _step_kwargs(step: str) -> Any:
    def build(input: Any, results: Any) -> dict[str, Any]:
        previous = {name: value for name, value in results.items()}
        return {**input, "step": step, "previous": previous}

    return build


TEST_FLOW = Flow(
    "test-order",
    [
        Step("a", "testapp.flow_step", compensate="testapp.flow_undo", kwargs=_step_kwargs("a"),
             compensate_kwargs=_step_kwargs("a")),
        Step("b", "testapp.flow_step", compensate="testapp.flow_undo", kwargs=_step_kwargs("b"),
             compensate_kwargs=_step_kwargs("b")),
        Step("c", "testapp.flow_step", kwargs=_step_kwargs("c")),
    ],
)  # fmt: skip

#: ``TEST_FLOW`` whose step ``b`` has a single attempt (``flow_step_once``).
TEST_FLOW_ONE_SHOT = Flow(
    "test-order-one-shot",
    [
        Step("a", "testapp.flow_step", compensate="testapp.flow_undo", kwargs=_step_kwargs("a"),
             compensate_kwargs=_step_kwargs("a")),
        Step("b", "testapp.flow_step_once", compensate="testapp.flow_undo", kwargs=_step_kwargs("b"),
             compensate_kwargs=_step_kwargs("b")),
        Step("c", "testapp.flow_step", kwargs=_step_kwargs("c")),
    ],
)  # fmt: skip

#: ``TEST_FLOW`` whose step ``b`` is non-atomic and waits for a gate (``flow_step_late``).
TEST_FLOW_LATE = Flow(
    "test-order-late",
    [
        Step("a", "testapp.flow_step", compensate="testapp.flow_undo", kwargs=_step_kwargs("a"),
             compensate_kwargs=_step_kwargs("a")),
        Step("b", "testapp.flow_step_late", compensate="testapp.flow_undo", kwargs=_step_kwargs("b"),
             compensate_kwargs=_step_kwargs("b")),
        Step("c", "testapp.flow_step", kwargs=_step_kwargs("c")),
    ],
)  # fmt: skip

#: A flow whose second step replaces itself (``plain_replace``): refused, the step fails.
TEST_FLOW_REPLACING = Flow(
    "test-order-replacing",
    [
        Step("a", "testapp.flow_step", compensate="testapp.flow_undo", kwargs=_step_kwargs("a"),
             compensate_kwargs=_step_kwargs("a")),
        Step("r", "testapp.plain_replace", kwargs=lambda input, results: {}),
    ],
)  # fmt: skip


@shared_task(base=IdempotentTask, bind=True, name="testapp.forwarding_parent")
def forwarding_parent(self: IdempotentTask, child: str = "", child_task_id: str = "") -> None:
    """Record its run, and send ``child`` (a task name) with this message's custom headers
    forwarded whole, ledger headers included: what ``docs/writing-tasks.md`` warns against,
    done the way user code would do it. The child is sent without arguments (so a child of
    this same task forwards nothing further)."""
    from celery import current_app

    _raw(self, "started")
    if child:
        current_app.send_task(child, task_id=child_task_id, headers=dict(self.request.headers or {}))
