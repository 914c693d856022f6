"""Broker and result-backend faults from the catalogue (``../shared/research/reliability-anchors.md``
§b, scenarios 9-12): a RabbitMQ node restarted or killed under durable queues, a Redis broker
killed and restarted empty, a broker hung for 30 s under load, and a result backend that goes
away. Every server signalled here is one the test started (a private redis-server, a private
RabbitMQ node); effects are counted in tables without a unique constraint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from django.db import connection
from django.test import override_settings

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, ExecutionEvent
from tests.chaos.rabbit import RabbitNode
from tests.chaos.rabbit import missing as rabbit_missing
from tests.conftest import IN_CI, RedisServer
from tests.helpers import result_backend_at, state_of
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.worker, pytest.mark.fault]


# --- counting ----------------------------------------------------------------------------------


@dataclass
class Tally:
    """What happened to a set of executions, counted in the oracle tables."""

    executions: int
    succeeded: int
    body_starts: int
    effects: int
    lost: int
    duplicates: int

    def figures(self) -> dict[str, int]:
        return {
            "executions": self.executions,
            "body_starts": self.body_starts,
            "effects": self.effects,
            "lost": self.lost,
            "duplicates": self.duplicates,
        }


def tally(executions: list[Execution]) -> Tally:
    keys = [e.idempotency_key for e in executions]
    effects = {k: 0 for k in keys}
    for key in Effect.objects.filter(key__in=keys).values_list("key", flat=True):
        effects[key] += 1
    states = dict(Execution.objects.filter(pk__in=[e.pk for e in executions]).values_list("pk", "state"))
    return Tally(
        executions=len(executions),
        succeeded=sum(1 for s in states.values() if s == "SUCCEEDED"),
        body_starts=EffectRaw.objects.filter(key__in=keys, phase="started").count(),
        effects=sum(effects.values()),
        lost=sum(1 for e in executions if states[e.pk] != "SUCCEEDED" or effects[e.idempotency_key] == 0),
        duplicates=sum(max(0, n - 1) for n in effects.values()),
    )


def starts(key: str) -> int:
    return EffectRaw.objects.filter(key=key, phase="started").count()


def events(executions: list[Execution], kind: str) -> int:
    return ExecutionEvent.objects.filter(execution_id__in=[e.pk for e in executions], kind=kind).count()


def all_succeeded(executions: list[Execution], *, rescue: bool = True) -> Callable[[], bool]:
    """A poll predicate: every execution succeeded (running the rescuer as the beat leader would)."""
    pks = [e.pk for e in executions]

    def done() -> bool:
        if rescue:
            run_rescuer()
        return Execution.objects.filter(pk__in=pks, state="SUCCEEDED").count() == len(pks)

    return done


def diagnosis(executions: list[Execution], workers: Any = None) -> str:
    """Each execution's state and events, and the workers' last log lines: for a failure message."""
    lines = []
    for e in Execution.objects.filter(pk__in=[x.pk for x in executions]).order_by("pk"):
        kinds = list(ExecutionEvent.objects.filter(execution_id=e.pk).order_by("id").values_list("kind", flat=True))
        lines.append(
            f"{e.pk} {e.state} attempts={e.attempts} published={e.publish_count}"
            f" starts={starts(e.idempotency_key)} {kinds}"
        )
    for worker in getattr(workers, "workers", []):
        lines.append(f"--- {worker.name} (alive: {worker.alive()})")
        lines.extend(worker.log().splitlines()[-40:])
    return "\n".join(lines)


def wait_all(poll: Any, executions: list[Execution], workers: Any, *, timeout: float, rescue: bool = True) -> None:
    """Poll until every execution succeeded; on a timeout, say where each one is."""
    try:
        poll(all_succeeded(executions, rescue=rescue), timeout=timeout, interval=0.5, what="every execution")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnosis(executions, workers)}") from None


def _require(reason: str) -> None:
    if not reason:
        return
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: the fault catalogue must run, not skip)")
    pytest.skip(reason)


# --- scenario 10: RabbitMQ restarted or killed, durable queue, persistent messages -------------


@pytest.fixture(scope="module")
def rabbit_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    """A private RabbitMQ node for this module (it takes about ten seconds to boot)."""
    _require(rabbit_missing())
    node = RabbitNode(base=tmp_path_factory.mktemp("rabbit"))
    node.start()
    yield node
    node.stop()


@pytest.fixture
def rabbit(rabbit_node: RabbitNode, use_broker: Callable[[str], None]) -> RabbitNode:
    """The private node, up, with an empty ``celery`` queue; this process publishes to it."""
    from kombu import Connection

    if not rabbit_node.running():  # a previous test killed it
        rabbit_node.start()
    with Connection(rabbit_node.url) as conn, contextlib.suppress(Exception):  # no queue yet: nothing to purge
        conn.default_channel.queue_purge("celery")
    use_broker(rabbit_node.url)
    return rabbit_node


def queue_depth(node: RabbitNode) -> int:
    """Messages ready in the ``celery`` queue (not counting the ones delivered and unacked)."""
    from kombu import Connection

    with Connection(node.url) as conn:
        return int(conn.default_channel.queue_declare("celery", passive=True).message_count)


def received_after(worker: Any, offset: int) -> list[str]:
    """Celery task ids the worker logged as received after ``offset`` characters of its log."""
    import re

    return re.findall(r"Task testapp\.effect\[([0-9a-f-]+)\] received", worker.log()[offset:])


def _rabbit_run(
    rabbit: RabbitNode, workers: Any, poll: Any, open_gate: Any, figures: Any, fault: str, queued_n: int = 8
) -> dict[str, Any]:
    """One body running (gated), ``queued_n`` executions waiting in the durable queue, then
    ``fault`` on the node; afterwards every execution must have run its body to one effect.
    Returns what was observed, for the caller's own assertions."""
    worker = workers.start(broker=rabbit.url, concurrency=1)
    running = submit("testapp.effect", kwargs={"gate": "rmq"})
    poll(lambda: starts(running.idempotency_key) == 1, timeout=60, what="the first body running")
    queued = [submit("testapp.effect") for _ in range(queued_n)]
    poll(lambda: queue_depth(rabbit) == queued_n, timeout=30, what=f"{queued_n} messages waiting in the queue")
    executions = [running, *queued]
    original = {e.celery_task_id for e in executions}

    offset = len(worker.log())
    if fault == "stop_app":
        rabbit.stop_app()
        rabbit.start_app()
    else:
        rabbit.kill()
        rabbit.start()
    back = time.monotonic()
    for token in (1, 2, 3):
        open_gate(f"rmq:{token}")

    wait_all(poll, executions, workers, timeout=180)
    recovery_s = time.monotonic() - back
    counts = tally(executions)
    # Messages published before the fault and delivered after it: they survived on disk.
    survived = len(original & set(received_after(worker, offset)))
    seen = {
        **counts.figures(),
        "recovery_s": recovery_s,
        "messages_survived": survived,
        "republished": events(executions, "republished"),
        "rescued": events(executions, "rescued"),
        "taken_over": events(executions, "taken_over"),
        "redelivered_absorbed": events(executions, "duplicate_delivery") + events(executions, "already_finished"),
    }
    figures.record(**seen)
    assert counts.lost == 0 and counts.duplicates == 0
    assert counts.effects == len(executions)
    assert worker.alive(), "the same worker reconnected"
    for execution in queued:
        assert starts(execution.idempotency_key) == 1
    # The running body: the worker lost its connection and cancelled it (Celery's
    # worker_cancel_long_running_tasks_on_connection_loss, on here); its next attempt (the
    # re-delivered message taking over from the dead pool process, or the rescuer after the
    # lease) wrote the one effect.
    assert starts(running.idempotency_key) == 2
    row = Execution.objects.get(pk=running.pk)
    assert (row.attempts, row.fencing_token) == (2, 2)
    assert Effect.objects.get(key=running.idempotency_key).fencing_token == 2
    return {**seen, "messages": len(original)}


@pytest.fixture
def confirmed_publishing(rabbit: RabbitNode, use_broker: Callable[[str], None]) -> Iterator[None]:
    """This process publishes with publisher confirms (``confirm_publish``): each publication
    returns once RabbitMQ has the message safely (on disk, for a persistent message)."""
    from celery import current_app

    previous = current_app.conf.broker_transport_options
    current_app.conf.broker_transport_options = {**previous, "confirm_publish": True}
    use_broker(rabbit.url)  # new connections, with the option
    yield
    current_app.conf.broker_transport_options = previous
    use_broker(rabbit.url)


@pytest.mark.scenario(10)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rabbitmq_app_restart_loses_and_doubles_nothing(rabbit, workers, poll, open_gate, figures):
    """Scenario 10. ``rabbitmqctl stop_app; start_app`` on a private node while one body runs
    and eight executions wait: the durable queue keeps its persistent messages, the worker
    reconnects, the running body's message is re-delivered; each execution runs once."""
    seen = _rabbit_run(rabbit, workers, poll, open_gate, figures, "stop_app")
    assert seen["messages_survived"] == seen["messages"], "every message came back with the queue"
    assert seen["republished"] == 0


@pytest.mark.scenario(10)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rabbitmq_node_killed_keeps_confirmed_messages(
    rabbit, confirmed_publishing, workers, poll, open_gate, figures
):
    """Scenario 10, hard: SIGKILL of the node's Erlang VM (``beam.smp``), then a restart on the
    same data. Published with confirms, every message was on disk and comes back; each
    execution runs once, nothing needs re-publishing."""
    seen = _rabbit_run(rabbit, workers, poll, open_gate, figures, "kill")
    assert seen["messages_survived"] == seen["messages"], "every confirmed message came back"
    assert seen["republished"] == 0


@pytest.mark.scenario(10)
@pytest.mark.slow
@pytest.mark.timeout(300)
@override_settings(TASKPLATFORM_REPUBLISH_AFTER_SECONDS=15)
def test_a_rabbitmq_node_killed_loses_unconfirmed_messages_and_the_rescuer_republishes_them(
    rabbit, workers, poll, open_gate, figures
):
    """Scenario 10, hard, without publisher confirms (the platform's default): RabbitMQ had not
    yet written the persistent messages to disk when its VM was killed (in the runs so far,
    none of the nine came back). Their rows are still PENDING, so the rescuer re-publishes each
    after its publication grace (15 s here, 300 s by default), and re-queues the running
    attempt after its lease; each execution runs once."""
    seen = _rabbit_run(rabbit, workers, poll, open_gate, figures, "kill")
    lost_by_broker = seen["messages"] - seen["messages_survived"]
    figures.record(messages_lost_by_broker=lost_by_broker)
    # A lost waiting message: its PENDING row is re-published; the running body's lost message:
    # its RUNNING row's lease expires and the rescuer re-queues it.
    assert seen["republished"] + seen["rescued"] >= lost_by_broker


# --- scenario 9: Redis broker SIGKILLed and restarted empty -----------------------------------


@pytest.mark.scenario(9)
@pytest.mark.timeout(240)
@override_settings(TASKPLATFORM_REPUBLISH_AFTER_SECONDS=2)
def test_a_redis_broker_killed_and_restarted_empty_loses_nothing(
    private_redis, use_broker, workers, poll, open_gate, figures
):
    """Scenario 9 (restart). SIGKILL of a redis-server without persistence while one body runs
    and ten executions wait, then a restart on the same port, empty: the worker reconnects by
    itself (celery#8030, #9054), the rescuer re-publishes every lost row, and re-queues the
    running attempt whose message vanished; each execution's effect is written once."""
    use_broker(private_redis.url)
    worker = workers.start(broker=private_redis.url, concurrency=1)
    running = submit("testapp.effect", kwargs={"gate": "restart"})
    poll(lambda: starts(running.idempotency_key) == 1, timeout=60, what="the first body running")
    queued = [submit("testapp.effect") for _ in range(10)]
    client = redis.Redis.from_url(private_redis.url)
    poll(lambda: client.llen("celery") == 10, timeout=30, what="10 messages waiting")
    executions = [running, *queued]

    assert private_redis.proc is not None
    os.kill(private_redis.proc.pid, signal.SIGKILL)
    private_redis.proc.wait(timeout=10)
    poll(lambda: "Connection to broker lost" in worker.log(), timeout=60, what="the worker noticed")
    private_redis.start()  # same port, nothing on disk: an empty broker
    restarted = time.monotonic()
    # Empty of messages: the ten waiting ones and the running one's unacked copy are gone. The
    # worker may already have reconnected and declared its bindings (``_kombu.binding.*``), so
    # the database is not necessarily empty of keys.
    messages = {k.decode() for k in client.scan_iter() if not k.startswith(b"_kombu.binding.")}
    assert client.llen("celery") == 0 and not client.exists("unacked"), messages
    for token in (1, 2, 3):
        open_gate(f"restart:{token}")

    wait_all(poll, executions, workers, timeout=180)
    recovery_s = time.monotonic() - restarted
    counts = tally(executions)
    figures.record(
        **counts.figures(),
        recovery_s=recovery_s,
        republished=events(executions, "republished"),
        rescued=events(executions, "rescued"),
        redelivered_absorbed=events(executions, "duplicate_delivery") + events(executions, "already_finished"),
    )
    assert counts.lost == 0 and counts.duplicates == 0 and counts.effects == len(executions)
    assert worker.alive(), "the same worker reconnected and served the re-published work"
    for execution in queued:
        assert starts(execution.idempotency_key) == 1
        assert Execution.objects.get(pk=execution.pk).publish_count >= 2, "its first message was lost"
    # The running body was cancelled when the worker lost the broker; its message vanished
    # with the restart, so its lease expired and the rescuer re-queued it.
    assert starts(running.idempotency_key) == 2
    assert events([running], "rescued") == 1
    assert Effect.objects.get(key=running.idempotency_key).fencing_token == 2


# --- scenario 11: a broker hung for 30 s under steady load -----------------------------------

HANG_SECONDS = 30
SUBMISSIONS = 20


@pytest.mark.scenario(11)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_broker_hung_for_30_seconds_under_load_runs_everything_once(
    private_redis, use_broker, workers, poll, figures
):
    """Scenario 11 in full. The broker (a private redis-server) is SIGSTOPped for 30 s while a
    body runs and twenty submissions arrive spread over the pause. Each submission's row
    commits before its publication blocks; the running body finishes on the database; after
    SIGCONT every blocked publication completes (nobody hangs for ever) and each runs once."""
    use_broker(private_redis.url)
    workers.start(broker=private_redis.url, concurrency=2)
    running = submit("testapp.effect", kwargs={"seconds": 4})
    poll(lambda: starts(running.idempotency_key) == 1, timeout=60, what="a body running")
    before = set(Execution.objects.values_list("pk", flat=True))

    submitted: list[Execution] = []
    returned_after: list[float] = []
    errors: list[BaseException] = []

    def submit_one() -> None:
        began = time.monotonic()
        try:
            submitted.append(submit("testapp.effect"))  # the row commits; its publication blocks
            returned_after.append(time.monotonic() - began)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)
        finally:
            connection.close()

    assert private_redis.proc is not None
    pid = private_redis.proc.pid
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    threads: list[threading.Thread] = []
    try:
        for i in range(SUBMISSIONS):
            # Pace the load over the pause (one every 1.25 s): load generation, not synchronisation.
            time.sleep(max(0.0, stopped + i * (HANG_SECONDS - 5) / SUBMISSIONS - time.monotonic()))
            thread = threading.Thread(target=submit_one, daemon=True)
            thread.start()
            threads.append(thread)
        poll(lambda: state_of(running.pk) == "SUCCEEDED", timeout=HANG_SECONDS, what="the body finished meanwhile")
        rows = poll(
            lambda: (n := Execution.objects.exclude(pk__in=before).count()) == SUBMISSIONS and n,
            timeout=HANG_SECONDS,
            what="every submission's row committed while the broker hangs",
        )
        time.sleep(max(0.0, stopped + HANG_SECONDS - time.monotonic()))  # the fault's length
        hung_s = time.monotonic() - stopped
        waiting = sum(t.is_alive() for t in threads)
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()

    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a publication still blocks after SIGCONT"
    assert not errors, errors
    executions = [running, *Execution.objects.exclude(pk__in=before).order_by("pk")]
    wait_all(poll, executions, workers, timeout=180)
    recovery_s = time.monotonic() - resumed
    counts = tally(executions)
    figures.record(
        **counts.figures(),
        recovery_s=recovery_s,
        hung_s=hung_s,
        rows_committed_while_hung=rows,
        publications_blocked=waiting,
        longest_submit_s=max(returned_after),
        republished=events(executions, "republished"),
    )
    assert len(executions) == SUBMISSIONS + 1
    assert counts.lost == 0 and counts.duplicates == 0
    assert counts.body_starts == counts.effects == len(executions)


# --- scenario 12: the result backend goes away ----------------------------------------------


@pytest.fixture
def result_backend(private_redis: RedisServer) -> Iterator[RedisServer]:
    """A result backend on a private redis-server, for the workers (environment) and for this
    process (the publishing side: Celery subscribes to a task's result when it publishes)."""
    with result_backend_at(private_redis.url):
        yield private_redis


@pytest.mark.scenario(12)
@pytest.mark.timeout(120)
def test_a_publication_does_not_wait_for_an_unreachable_result_backend(
    private_redis, use_broker, transactional_db, figures
):
    """Scenario 12, the publishing side alone. Celery's ``send_task`` subscribes to the task's
    result on a Redis result backend before it publishes; with the backend unreachable that
    retried for 20 s and then failed the publication, and every later one (the row stayed
    PENDING until the rescuer's next try, which failed the same way). The platform publishes
    tasks that ignore their result (every ``IdempotentTask`` by default) without it."""
    from tests.conftest import free_port

    use_broker(private_redis.url)
    with result_backend_at(f"redis://127.0.0.1:{free_port()}/0"):  # nothing listens there
        began = time.monotonic()
        execution = submit("testapp.effect")
        took = time.monotonic() - began
    figures.record(executions=1, lost=0, submit_s=took)
    assert redis.Redis.from_url(private_redis.url).llen("celery") == 1, "the message reached the broker"
    assert took < 5, f"submit() took {took:.1f} s"
    assert Execution.objects.get(pk=execution.pk).publish_count == 1


@pytest.mark.scenario(12)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_the_result_backend_going_away_loses_and_blocks_nothing(
    result_backend, workers, poll, open_gate, figures, fault
):
    """Scenario 12. The result backend (a private redis-server) is killed, or stopped, while a
    body runs: the body's success is recorded in the ledger, and executions submitted
    afterwards (with ``submit()`` and with a plain ``.delay()``) are published and run at
    once; nothing reads or needs the result backend."""
    from tests.testapp.tasks import effect

    worker = workers.start(concurrency=2, env={"CELERY_RESULT_BACKEND": result_backend.url})
    warm = submit("testapp.effect")  # this process and the worker have used the backend's config
    poll(lambda: state_of(warm.pk) == "SUCCEEDED", timeout=60, what="a first execution")
    running = submit("testapp.effect", kwargs={"gate": "rb"})
    poll(lambda: starts(running.idempotency_key) == 1, timeout=60, what="a body running")
    keys_written = redis.Redis.from_url(result_backend.url).dbsize()

    assert result_backend.proc is not None
    pid = result_backend.proc.pid
    os.kill(pid, getattr(signal, fault))
    faulted = time.monotonic()
    try:
        open_gate("rb:1")
        later = [submit("testapp.effect") for _ in range(3)]  # submitted while the backend is away
        called = effect.delay()  # a plain Celery call: its row is written by the worker
        plain = poll(
            lambda: Execution.objects.filter(celery_task_id=called.id).first(), timeout=60, what="the .delay() row"
        )
        executions = [warm, running, *later, plain]
        # No rescuer here: the outbox's first publication has to get through by itself.
        wait_all(poll, executions, workers, timeout=60, rescue=False)
        recovery_s = time.monotonic() - faulted
    finally:
        if fault == "SIGSTOP":
            os.kill(pid, signal.SIGCONT)
    counts = tally(executions)
    publications = Execution.objects.filter(pk__in=[e.pk for e in executions]).values_list("publish_count", flat=True)
    figures.record(
        **counts.figures(), recovery_s=recovery_s, result_keys_written=keys_written, publications=sum(publications)
    )
    assert keys_written == 0, "the platform writes no outcome to the result backend"
    assert counts.lost == 0 and counts.duplicates == 0
    assert counts.body_starts == counts.effects == len(executions)
    assert all(e.publish_count == 1 for e in Execution.objects.filter(pk__in=[x.pk for x in later]))
    assert worker.alive()
