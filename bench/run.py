"""End-to-end and drain throughput of a benchmark task, several ways, on the same machine, in one run.

    .venv/bin/python bench/run.py [--tasks 20000] [--repeat 1] [--body noop]
        [--variants plain,dcr,once,ledger,ledger_delay,procrastinate]

The Celery variants run one real ``celery worker`` (Redis broker, prefork, concurrency 2,
``acks_late``, prefetch 1, connection reuse on). The Procrastinate peer runs its own worker
(``manage.py procrastinate worker --concurrency 2``: one process, jobs in two threads) on the
same PostgreSQL database. Two figures per variant:

* end to end: this process publishes the tasks while the worker consumes; the clock runs
  from the first publication until no task is queued or running (Celery: the broker holds no
  queued or unacknowledged message; Procrastinate: no job is ``todo`` or ``doing``);
* drain: the queue is filled first, then the worker starts consuming; worker-side cost only.
  Celery: the worker's consumer is cancelled, the queue filled, the consumer added back.
  Procrastinate: the worker runs, idle, listening to queue ``bench``; the jobs are deferred
  into ``bench_hold``, a queue it does not read, then moved to ``bench`` by one ``UPDATE`` in
  the transaction that also sends the ``job_inserted`` notification a defer would have sent.
  The clock starts before that commit (after the ``UPDATE`` itself), so neither the worker's
  start-up nor the filling is counted.

``--body`` chooses what each task does (``bench/benchapp/bodies.py``): ``noop``, ``cpu1ms``
(a 1 ms busy loop), ``io10ms`` (a 10 ms sleep) or ``write`` (one row into a table with no
unique constraint; the ledger variants run it with ``atomic = True``). The task name carries
the body, so the worker runs the body the producer asked for; ``write`` is verified by
counting rows (one per task, not more).

Also reported: the ratio to plain Celery, the publish rate, the PostgreSQL transactions per
task (``pg_stat_database``, end-to-end run; the transactions of this process's own polling of
``procrastinate_jobs`` are subtracted), the CPU per task by process group (this process, the
worker's process tree, PostgreSQL, Redis; the polling costs its share there), and of the worker's
CPU the main process's share (Celery's consumer: it fetches, dispatches and acknowledges every message,
one at a time), how busy that CPU kept the machine's cores (CPU a task times tasks a second,
over the cores: what is left is time every process spent waiting) and the SQL statements per
task (counted in-process on the same code path).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

from bench.benchapp.bodies import BODIES  # noqa: E402  (no Django import: safe before setup)

VARIANTS = {
    "plain": "plain Celery (no result backend)",
    "dcr": "Celery + django-celery-results (PostgreSQL)",
    "dcr_default": "Celery + django-celery-results, out of the box (no CELERY_DB_REUSE_MAX)",
    "once": "Celery + celery-once (Redis lock)",
    "ledger": "taskplatform IdempotentTask + submit() (PostgreSQL ledger)",
    "ledger_delay": "taskplatform IdempotentTask + plain .delay() (worker makes row)",
    "procrastinate": "Procrastinate (PostgreSQL queue, Django contrib)",
    "floor": "plain Celery + two prepared one-row commits a task (the floor)",
    "floor_submit": "plain Celery + a one-row commit before publishing, two in the worker (submit()'s floor)",
    "floor_one": "plain Celery + one prepared one-row commit a task (the floor of .delay()'s one commit)",
    "floor_submit_one": "plain Celery + a one-row commit before publishing, one in the worker (submit()'s shape)",
    "limited": "taskplatform submit() under a concurrency limit of 4 (database lock backend)",
    "limited_redis": "taskplatform submit() under a concurrency limit of 4 (Redis lock backend)",
}
#: The ledger variants (their runs end when every execution is recorded).
LEDGER_VARIANTS = ("ledger", "ledger_delay", "limited", "limited_redis")
#: The lock backend of ``limited_redis``'s slots (a database the benchmarks own, flushed per run).
LIMITS_REDIS_URL = "redis://127.0.0.1:6379/12"
BODY_DESCRIPTIONS = {
    "noop": "no-op",
    "cpu1ms": "1 ms busy loop",
    "io10ms": "10 ms sleep",
    "write": "one-row insert",
}
#: How long to wait before reading ``pg_stat_database``: a backend that has gone idle sends
#: the counts of its last second of transactions only after 10 s idle (PostgreSQL 15+'s
#: ``PGSTAT_IDLE_INTERVAL``); reading sooner misses the workers' last second of work.
STATS_FLUSH_SECONDS = 11.0
#: How often the end of a run is looked for (seconds), on the broker or on procrastinate_jobs.
POLL_SECONDS = 0.01
#: Pool processes of every Celery worker, and Procrastinate's worker concurrency (--concurrency).
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "2"))


def ensure_database() -> None:
    """Create the database ``DATABASE_URL`` names (bench/settings.py's default if unset) and
    migrate it: the platform's, django-celery-results', Procrastinate's and the bench app's tables."""
    import psycopg
    from django.conf import settings
    from psycopg import sql

    db = settings.DATABASES["default"]
    server = {
        "host": db.get("HOST") or "127.0.0.1",
        "port": db.get("PORT") or 5432,
        "user": db.get("USER") or "postgres",
        "password": db.get("PASSWORD") or None,
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]]).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db["NAME"])))
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
        cwd=ROOT,
        check=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings"},
    )


def reset_state() -> None:
    """Empty the brokers, the ledger, the result table, Procrastinate's jobs and the effects."""
    import redis
    from django.conf import settings
    from django.db import connection

    redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()
    redis.Redis.from_url(settings.BENCH_ONCE_REDIS_URL).flushdb()
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE taskplatform_executionevent, taskplatform_execution, django_celery_results_taskresult, "
            "procrastinate_events, procrastinate_jobs, benchapp_bencheffect, benchapp_benchfloor "
            "RESTART IDENTITY CASCADE"
        )


def pg_transactions() -> int:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_force_next_flush()")
        cur.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        return int(cur.fetchone()[0])


def start_worker(variant: str) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings"}
    if variant == "dcr_default":
        env["BENCH_DB_REUSE_MAX"] = "unset"
    if variant == "limited_redis":
        env["TASKPLATFORM_LOCK_URL"] = LIMITS_REDIS_URL
    name = f"bench-{variant}@%h"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "config", "worker", "-P", "prefork", "-c", str(CONCURRENCY),
            "-Q", "bench", "-n", name, "--without-mingle", "--without-gossip", "--without-heartbeat",
            "--loglevel", "WARNING",
        ],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    from celery import current_app

    deadline = time.monotonic() + 60
    target = name.replace("%h", os.uname().nodename)
    while time.monotonic() < deadline:
        if current_app.control.ping(destination=[target], timeout=0.5):
            return proc, target
        if proc.poll() is not None:
            raise RuntimeError(f"worker for {variant} exited with {proc.returncode}")
    proc.kill()
    raise RuntimeError(f"worker for {variant} did not answer within 60 s")


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


@functools.cache
def _broker() -> Any:
    """One client for the run's polling (every 10 ms): a new connection per poll cost this
    process and Redis a connection's set-up each time, CPU that the workers share."""
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def queue_length() -> int:
    return int(_broker().llen("bench"))


def drained() -> bool:
    r = _broker()
    return r.llen("bench") == 0 and r.hlen("unacked") == 0


def publisher(variant: str, body: str = "noop") -> Any:
    """The call that publishes one task ``i`` of ``variant`` running ``body`` (Celery variants)."""
    from bench.benchapp.tasks import TASKS
    from taskplatform import submit

    tasks = TASKS[body]
    if variant in ("ledger", "limited", "limited_redis"):
        return lambda i: submit(tasks["ledger"], [i])
    if variant in ("floor_submit", "floor_submit_one"):
        from bench.benchapp.bodies import insert_row

        task = tasks[variant]
        return lambda i: task.delay(i, insert_row(i, "PENDING"))
    family = {
        "plain": "plain",
        "dcr": "dcr",
        "dcr_default": "dcr",
        "once": "once",
        "ledger_delay": "ledger",
        "floor": "floor",
        "floor_one": "floor_one",
    }
    return tasks[family[variant]].delay


def verify(variant: str, body: str, n: int) -> str:
    """What the database says about the ``n`` tasks just run (the broker alone says little)."""
    from django.db import connection
    from django_celery_results.models import TaskResult

    from bench.benchapp.models import BenchEffect, BenchFloor
    from taskplatform.models import Execution

    checks = []
    if body == "write":
        checks.append(f"{BenchEffect.objects.count()}/{n} rows written")
    if variant in LEDGER_VARIANTS:
        checks.append(f"{Execution.objects.filter(state='SUCCEEDED').count()}/{n} executions SUCCEEDED")
    elif variant.startswith("floor"):
        checks.append(f"{BenchFloor.objects.filter(state='SUCCEEDED').count()}/{n} floor rows SUCCEEDED")
    elif variant.startswith("dcr"):
        checks.append(f"{TaskResult.objects.filter(status='SUCCESS').count()}/{n} results stored")
    elif variant == "procrastinate":
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
            checks.append(f"{cur.fetchone()[0]}/{n} jobs succeeded")
    return "; ".join(checks) or "broker drained"


class Peer(Protocol):
    """One variant's worker and producer, as ``run_variant`` drives them."""

    worker_pid: int

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def publish(self, i: int) -> Any: ...
    def wait_done(self, timeout: float) -> int:
        """Wait until no task is queued or running; the PostgreSQL transactions spent polling."""
        ...

    def hold(self) -> None:
        """From now on, ``fill`` queues tasks the running worker does not take."""
        ...

    def fill(self, n: int) -> int:
        """Queue tasks 0..n-1 without their being consumed; how many are queued."""
        ...

    def release(self) -> float:
        """Let the worker consume what ``fill`` queued; the ``perf_counter`` the drain starts at."""
        ...


class CeleryPeer:
    """A Celery variant: one ``celery worker`` (prefork -c 2) consuming queue ``bench``."""

    def __init__(self, variant: str, body: str) -> None:
        self.variant = variant
        self.publish = publisher(variant, body)
        self.worker_pid = 0

    def start(self) -> None:
        self.proc, self.name = start_worker(self.variant)
        self.worker_pid = self.proc.pid

    def stop(self) -> None:
        stop_worker(self.proc)

    def wait_done(self, timeout: float) -> int:
        wait_drained(timeout)
        if self.variant not in LEDGER_VARIANTS:
            return 0  # polls Redis, not PostgreSQL
        # The ledger's run ends when every execution is recorded, not when the last message is
        # acknowledged: a success written behind the pool process (worker/recorder.py) may land
        # a few milliseconds after its acknowledgement.
        from taskplatform.models import Execution

        polls, deadline = 0, time.monotonic() + timeout
        while Execution.objects.filter(state__in=("PENDING", "RUNNING", "RETRYING")).exists():
            polls += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"executions not finished within {timeout} s")
            time.sleep(0.002)
        return polls + 1

    def hold(self) -> None:
        from celery import current_app

        current_app.control.cancel_consumer("bench", destination=[self.name], reply=True, timeout=5)

    def fill(self, n: int) -> int:
        for i in range(n):
            self.publish(i)
        return queue_length()

    def release(self) -> float:
        from celery import current_app

        start = time.perf_counter()
        current_app.control.add_consumer("bench", destination=[self.name], reply=True, timeout=5)
        return start


class ProcrastinatePeer:
    """Procrastinate through its Django contrib: ``manage.py procrastinate worker --concurrency 2``
    on queue ``bench``, jobs deferred from this process with ``job.defer(i=i)``."""

    def __init__(self, body: str) -> None:
        from bench.benchapp.jobs import JOBS

        self.job = JOBS[body]
        self.worker_pid = 0

    def publish(self, i: int) -> Any:
        return self.job.defer(i=i)

    def start(self) -> None:
        from django.db import connection

        from bench.benchapp.jobs import QUEUE

        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM procrastinate_workers WHERE last_heartbeat > now() - interval '60 s'")
            if cur.fetchone()[0]:
                raise RuntimeError("a live Procrastinate worker is registered on this database: it would take jobs")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "procrastinate",
                "worker",
                "--concurrency",
                str(CONCURRENCY),
                "--queues",
                QUEUE,
            ],
            cwd=ROOT,
            env={**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.worker_pid = self.proc.pid
        # Ready once its listener has run LISTEN: a job deferred before that would wait for the
        # worker's next poll (5 s) instead of being noticed at once.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND query LIKE %s",
                    [f'LISTEN "procrastinate_queue_v1#{QUEUE}"%'],
                )
                if cur.fetchone():
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"procrastinate worker exited with {self.proc.returncode}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("procrastinate worker did not listen within 60 s")

    def stop(self) -> None:
        stop_worker(self.proc)

    def wait_done(self, timeout: float) -> int:
        from django.db import connection

        deadline = time.monotonic() + timeout
        polls = 0
        with connection.cursor() as cur:
            while True:
                cur.execute("SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status IN ('todo', 'doing'))")
                polls += 1
                if not cur.fetchone()[0]:
                    return polls
                if time.monotonic() > deadline:
                    raise RuntimeError(f"procrastinate jobs not finished within {timeout} s")
                time.sleep(POLL_SECONDS)

    def hold(self) -> None:
        pass  # fill() defers into a queue the worker does not listen to

    def fill(self, n: int) -> int:
        from django.db import connection

        from bench.benchapp.jobs import HOLD_QUEUE

        deferrer = self.job.configure(queue=HOLD_QUEUE)
        for i in range(n):
            deferrer.defer(i=i)
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo' AND queue_name = %s", [HOLD_QUEUE]
            )
            return int(cur.fetchone()[0])

    def release(self) -> float:
        from django.db import connection, transaction

        from bench.benchapp.jobs import HOLD_QUEUE, QUEUE

        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(
                "UPDATE procrastinate_jobs SET queue_name = %s WHERE queue_name = %s AND status = 'todo'",
                [QUEUE, HOLD_QUEUE],
            )
            # What procrastinate's insert trigger sends for a deferred job; the worker only reads
            # the type and then fetches until the queue is empty.
            cur.execute(
                "SELECT pg_notify(%s, json_build_object('type', 'job_inserted', 'job_id', 0)::text)",
                [f"procrastinate_queue_v1#{QUEUE}"],
            )
            start = time.perf_counter()  # the jobs become visible, and the worker is woken, at commit
        return start


def make_peer(variant: str, body: str) -> Peer:
    if variant == "procrastinate":
        return ProcrastinatePeer(body)
    return CeleryPeer(variant, body)


def set_limit(variant: str, body: str) -> None:
    """The ``limited`` variants' limit on the ledger task (4 at once: never full at prefork
    2, so the run measures what a limit costs, not waiting); none for the others."""
    from bench.benchapp.tasks import TASKS
    from taskplatform.models import Limit

    Limit.objects.all().delete()
    if variant.startswith("limited"):
        Limit.objects.create(task_name=TASKS[body]["ledger"].name, concurrency=4, note="bench")


def run_variant(variant: str, n: int, body: str = "noop") -> dict[str, Any]:
    """End to end (publishing while the worker consumes), then drain-only (queue prefilled)."""
    peer = make_peer(variant, body)
    reset_state()
    set_limit(variant, body)
    peer.start()
    try:
        peer.publish(-1)  # warm-up: imports, connections
        peer.wait_done(60)
        # Between the broker's pop and the task's first write the queue looks drained with
        # nothing written yet: a reset then left the warm-up's row to be counted (4001/4000).
        deadline = time.monotonic() + 60
        while re.search(r"(?<!\d)0/1 ", verify(variant, body, 1)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the warm-up task of {variant} left no trace: {verify(variant, body, 1)}")
            time.sleep(0.01)
        reset_state()
        tx_before = pg_transactions()
        cpu_before = cpu_snapshot(peer.worker_pid)
        main_before = _proc_ticks(peer.worker_pid)
        start = time.perf_counter()
        for i in range(n):
            peer.publish(i)
        published = time.perf_counter()
        polls = peer.wait_done(600)
        end = time.perf_counter()
        cpu = cpu_per_task(cpu_before, cpu_snapshot(peer.worker_pid), n)
        main_us = (_proc_ticks(peer.worker_pid) - main_before) / os.sysconf("SC_CLK_TCK") / n * 1e6
        time.sleep(STATS_FLUSH_SECONDS)
        tx = pg_transactions() - tx_before - 2 - polls
        check = verify(variant, body, n)

        # Drain-only: the worker does not take what is queued, the queue is filled, then it does.
        reset_state()
        peer.hold()
        queued = peer.fill(n)
        if queued != n:
            raise RuntimeError(f"drain run invalid: {queued} of {n} tasks queued before consuming resumed")
        drain_start = peer.release()
        peer.wait_done(600)
        drain_end = time.perf_counter()
        drain_check = verify(variant, body, n)
    finally:
        peer.stop()
    return {
        "variant": variant,
        "body": body,
        "tasks": n,
        "seconds": round(end - start, 3),
        "tasks_per_second": round(n / (end - start), 1),
        "publish_per_second": round(n / (published - start), 1),
        "drain_per_second": round(n / (drain_end - drain_start), 1),
        "pg_transactions_per_task": round(tx / n, 2),
        "cpu_us_per_task": cpu,
        "worker_main_us_per_task": round(main_us, 1),
        "cores_busy": round(sum(cpu.values()) / 1e6 * n / (end - start) / (os.cpu_count() or 1), 2),
        "check": check,
        "drain_check": drain_check,
    }


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(command name, parent pid, user + system CPU ticks) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    rest = text[text.rindex(")") + 2 :].split()
    return name, int(rest[1]), int(rest[11]) + int(rest[12])


def _proc_ticks(pid: int) -> int:
    """User + system CPU ticks of one live process (0 if gone): the worker's main process, in
    Celery's case the consumer that fetches, dispatches and acknowledges every message."""
    stat = _proc_stat(pid)
    return stat[2] if stat else 0


def _reaped_ticks(pid: int) -> int:
    """User + system CPU ticks of ``pid``'s children that ended and were waited for: a
    PostgreSQL backend that closed during a run (Celery's worker closes its connections every
    ``CELERY_DB_REUSE_MAX`` tasks) is no longer in ``/proc``, but its time is the postmaster's."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[13]) + int(rest[14])


def _other_database_backend(pid: int, database: str) -> bool:
    """Whether a ``postgres`` process serves another database than the bench's (its process
    title names a client, ``host(port)`` or ``[local]``, or is an autovacuum worker, and does
    not name ``database``): on a shared server, other databases' load is not the benchmark's."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    words = title.split()
    serves_a_database = "autovacuum worker" in title or any(w.endswith(")") or w == "[local]" for w in words)
    return serves_a_database and database not in words


def cpu_snapshot(worker_pid: int) -> dict[str, dict[int, int]]:
    """CPU ticks per live process, grouped: this process (the producer), the worker (its whole
    process tree: Celery's main and pool processes, or Procrastinate's one process and its
    threads), PostgreSQL (the server's own processes and the bench database's backends) and Redis.

    The processes that ended between two snapshots count too, through their parent's reaped
    children (``_reaped_ticks``, keyed by the parent's negative pid): the worker's and the
    postmaster's. The postmaster's include every database's closed backends: on a shared
    server, run the bench alone."""
    from django.conf import settings

    database = settings.DATABASES["default"]["NAME"]
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            stats[int(entry)] = stat
    worker = {worker_pid}
    while grown := {pid for pid, (_, ppid, _) in stats.items() if ppid in worker} - worker:
        worker |= grown
    groups: dict[str, dict[int, int]] = {"producer": {}, "worker": {}, "postgres": {}, "redis": {}}
    for pid, (name, _, ticks) in stats.items():
        if pid == os.getpid():
            groups["producer"][pid] = ticks
        elif pid in worker:
            groups["worker"][pid] = ticks
        elif name == "postgres" and not _other_database_backend(pid, database):
            groups["postgres"][pid] = ticks
        elif name == "redis-server":
            groups["redis"][pid] = ticks
    groups["worker"][-worker_pid] = _reaped_ticks(worker_pid)
    for pid, (name, ppid, _) in stats.items():
        if name == "postgres" and stats.get(ppid, ("",))[0] != "postgres":  # the postmaster
            groups["postgres"][-pid] = _reaped_ticks(pid)
    return groups


def cpu_per_task(before: dict[str, dict[int, int]], after: dict[str, dict[int, int]], n: int) -> dict[str, float]:
    """Microseconds of CPU per task in each group between two snapshots (a process that
    started in between counts from zero)."""
    hz = os.sysconf("SC_CLK_TCK")
    return {
        group: round(sum(t - before[group].get(pid, 0) for pid, t in after[group].items()) / hz / n * 1e6, 1)
        for group in after
    }


def wait_drained(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not drained():
        if time.monotonic() > deadline:
            raise RuntimeError(f"queue not drained within {timeout} s")
        time.sleep(0.01)


def statements_per_execution() -> dict[str, float]:
    """SQL statements on each database-backed path, counted with Django's query capture."""
    from celery import current_app
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from bench.benchapp import tasks as t
    from taskplatform import submit
    from taskplatform.core.publisher import HEADER_EXECUTION

    reset_state()
    counts: dict[str, float] = {}
    samples = 50
    with CaptureQueriesContext(connection) as submit_q:
        executions = [submit(t.ledger_noop, [i], on_commit=False) for i in range(samples)]
    with CaptureQueriesContext(connection) as run_q:
        for e in executions:
            t.ledger_noop.apply(args=[e.args[0]], task_id=e.celery_task_id, headers={HEADER_EXECUTION: e.pk})
    counts["ledger_submit"] = len(submit_q.captured_queries) / samples
    counts["ledger_worker"] = len(run_q.captured_queries) / samples
    with CaptureQueriesContext(connection) as dcr_q:
        for i in range(samples):
            current_app.backend.store_result(f"bench-{i}", i, "SUCCESS")
    counts["dcr_worker"] = len(dcr_q.captured_queries) / samples
    # Procrastinate's defer goes through Django's connection (its worker's queries do not).
    from bench.benchapp.jobs import JOBS

    with CaptureQueriesContext(connection) as defer_q:
        for i in range(samples):
            JOBS["noop"].defer(i=i)
    counts["procrastinate_defer"] = len(defer_q.captured_queries) / samples
    reset_state()
    return counts


def paired_ratio(rounds: list[dict[str, Any]], plain_rounds: list[dict[str, Any]]) -> float | None:
    """The median over the rounds of a variant's end-to-end rate over plain Celery's in the
    same round: the rounds are interleaved, so a machine whose speed drifts during the run
    moves both sides of each ratio together, where the ratio of the two medians can pair a
    fast round with a slow one."""
    if not plain_rounds:
        return None
    pairs = [
        r["tasks_per_second"] / p["tasks_per_second"]
        for r, p in zip(rounds, plain_rounds, strict=True)
        if p["tasks_per_second"]
    ]
    return round(statistics.median(pairs), 2) if pairs else None


def measure(body: str, variants: list[str], tasks: int, repeat: int) -> dict[str, Any]:
    """Every variant with one body, ``repeat`` interleaved rounds (every other one in reverse
    order, so no variant always runs first or last in a round); medians and the table."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_no in range(repeat):
        for variant in variants if round_no % 2 == 0 else variants[::-1]:
            result = run_variant(variant, tasks, body)
            runs[variant].append(result)
            print(f"round {round_no + 1}: {json.dumps(result)}", flush=True)

    metrics = (
        "tasks_per_second",
        "drain_per_second",
        "publish_per_second",
        "pg_transactions_per_task",
        "worker_main_us_per_task",
        "cores_busy",
    )
    best = {
        v: {
            **rs[-1],
            **{m: round(statistics.median(r[m] for r in rs), 2) for m in metrics},
            "cpu_us_per_task": {
                g: statistics.median(r["cpu_us_per_task"][g] for r in rs) for g in rs[-1]["cpu_us_per_task"]
            },
        }
        for v, rs in runs.items()
    }
    base = best.get("plain", {}).get("tasks_per_second")
    drain_base = best.get("plain", {}).get("drain_per_second")
    for v, r in best.items():
        r["ratio"] = round(r["tasks_per_second"] / base, 2) if base else None
        r["drain_ratio"] = round(r["drain_per_second"] / drain_base, 2) if drain_base else None
        r["paired_ratio"] = paired_ratio(runs[v], runs.get("plain", []))

    print()
    print(
        f"{tasks} tasks per run, body {body} ({BODY_DESCRIPTIONS[body]}), medians of {repeat}; "
        f"Celery: Redis broker, prefork -c {CONCURRENCY}, acks_late, prefetch 1; "
        f"Procrastinate: one worker, concurrency {CONCURRENCY}"
    )
    print("(paired: the median of each round's ratio to plain Celery in the same round, steadier when the")
    print(" machine's speed drifts during the run)")
    print(
        f"{'variant':<64} {'e2e/s':>7} {'vs plain':>8} {'paired':>7} {'drain/s':>8} {'vs plain':>8} "
        f"{'publish/s':>9} {'PG tx':>6}"
    )
    for v in variants:
        r = best[v]
        spread = ", ".join(str(x["tasks_per_second"]) for x in runs[v])
        print(
            f"{VARIANTS[v]:<64} {r['tasks_per_second']:>7} {r['ratio'] or '-':>8} {r['paired_ratio'] or '-':>7} "
            f"{r['drain_per_second']:>8} {r['drain_ratio'] or '-':>8} {r['publish_per_second']:>9} "
            f"{r['pg_transactions_per_task']:>6}   e2e runs [{spread}]; {r['check']}"
        )
    print()
    groups = ("producer", "worker", "postgres", "redis")
    print(f"CPU µs per task, end to end, medians ({body}); 'main': the worker's main process, of 'worker';")
    print(f"'busy': CPU a task times tasks a second, over the machine's {os.cpu_count()} cores:")
    print(f"{'variant':<64} " + " ".join(f"{g:>9}" for g in groups) + f" {'total':>9} {'main':>7} {'busy':>5}")
    for v in variants:
        r = best[v]
        cpu = r["cpu_us_per_task"]
        print(
            f"{VARIANTS[v]:<64} " + " ".join(f"{cpu[g]:>9}" for g in groups) + f" {round(sum(cpu.values()), 1):>9}"
            f" {r['worker_main_us_per_task']:>7} {r['cores_busy']:>5}"
        )
    print(flush=True)
    return {"body": body, "tasks": tasks, "runs": runs, "median": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per variant (interleaved); the median is kept")
    parser.add_argument("--variants", default="plain,dcr,once,ledger", help=f"any of {','.join(VARIANTS)}")
    parser.add_argument(
        "--body", "--bodies", dest="bodies", default="noop",
        help=f"what each task does, one or more of {','.join(BODIES)}; the first runs every variant",
    )  # fmt: skip
    parser.add_argument(
        "--body-variants", default="", help="the variants for the bodies after the first (default: --variants)"
    )
    parser.add_argument("--body-tasks", type=int, help="tasks a run for the bodies after the first (default: --tasks)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    body_variants = [v.strip() for v in args.body_variants.split(",") if v.strip()] or variants
    bodies = [b.strip() for b in args.bodies.split(",") if b.strip()]
    if unknown := [v for v in variants + body_variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose among {list(VARIANTS)}")
    if unknown := [b for b in bodies if b not in BODIES]:
        parser.error(f"unknown bodies {unknown}; choose among {list(BODIES)}")

    ensure_database()
    import django

    django.setup()
    results = [measure(bodies[0], variants, args.tasks, args.repeat)]
    for body in bodies[1:]:
        results.append(measure(body, body_variants, args.body_tasks or args.tasks, args.repeat))
    statements = statements_per_execution()
    if len(results) > 1:
        print("ratio to plain Celery, end to end (drain; paired), by body:")
        for result in results:
            cells = [
                f"{v} {r['ratio']} ({r['drain_ratio']}; paired {r['paired_ratio']})"
                for v, r in result["median"].items()
                if v != "plain"
            ]
            print(f"  {result['body']:<8} " + "; ".join(cells))
        print()
    print("SQL statements per execution (in-process count):", json.dumps(statements))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bodies": results, "statements": statements}, indent=2))


if __name__ == "__main__":
    main()
