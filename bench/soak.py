"""The soak (issue 13): N executions through real processes, faults injected throughout, a raw oracle.

    .venv/bin/python bench/soak.py --executions 1000000 --plot docs/img/soak.png \\
        --json var/soak/soak.json --markdown var/soak/soak.md

What runs, all started (and stopped, by PID) by this process:

* its own ``redis-server`` on ``--redis-port`` (6390; 0 picks a free port), no persistence;
* the soak database ``--database`` (``taskplatform_soak``), dropped, created and migrated;
* 2 ``celery worker`` processes (prefork, ``--concurrency`` 2 each) and 2 ``celery beat``
  processes on ``taskplatform.beat.LockedScheduler``, with ``bench.benchapp.soak.settings``;
* ``--producers`` producer processes (this script with ``--producer I``), each submitting
  executions of ``soak.atomic`` and ``soak.plain`` with the public API: ``--single-share`` of
  them by ``taskplatform.submit()``, the rest by ``taskplatform.submit_many()`` in batches of
  ``--batch``. One body in ten fails its first attempt and retries (backoff up to 6 s with full
  jitter: a retry longer than 3 s is parked in the ledger). A producer records each key once the
  call returned (a file per producer), retries a call the database refused (same keys, same
  arguments), and keeps the broker's queue under ``--max-backlog`` messages;
* ``--interval-jobs`` jobs every 10 s and ``--cron-jobs`` jobs every minute (``* * * * *``),
  one in ten failing the first attempt of each slot, misfire policy ``catch_up``: their slots
  are the rest of the executions. Producers stop once submissions plus slots reach N; then the
  beats are stopped and the soak waits (``--drain-timeout``) for every execution to succeed.

Faults, on a schedule by progress (each kind ``--fault-cycles`` times, between 10 % and 85 % of
N; default one cycle per 150,000 executions): ``worker_kill`` (SIGKILL of a worker's process
group, restarted 2 s later), ``child_kill`` (SIGKILL of one pool child; Celery replaces it),
``beat_kill`` (SIGKILL of the beat leader; a new beat 2 s later), ``beat_stop`` (SIGSTOP of the
leader for the beat lease + 4 s, then SIGCONT), ``redis_restart`` (SIGKILL of redis-server,
started again empty) and ``pg_terminate`` (``pg_terminate_backend`` of every connection to the
soak database, none other).

The oracle: ``soak_soakeffect`` (and ``soak_soakstart``) have no unique constraint. The checks:

* **0 lost** — every recorded key has a ledger row, every row SUCCEEDED and left at least one
  effect, every row is a recorded key or a beat slot, and every job's slots are all there: each
  point of its grid (interval: anchor + k x 10 s; cron: each minute) from the first publication
  of any slot to ``SLOT_MARGIN`` s before the beats were stopped has its row (a slot is read
  from the key ``<job>@<slot UTC>``), and no slot is off its grid.
* **atomic** — exactly one effect per key of ``soak.atomic``.
* **non-atomic re-runs** — a key of ``soak.plain`` with more than one effect ran again; every
  effect that is not the recorded success's (a fencing token other than the row's) is an earlier
  attempt's, and must be *explained* by a fault: written by a process the soak SIGKILLed (a
  worker's group or a pool child) at most ``KILL_EXPLAINS`` s before the kill (the lease, a
  renewal's third of it and a retry pause: an attempt whose effect is older than that at the
  kill had its success recorded, or its lease had run out, before the kill), or within
  ``EXPLAIN_BEFORE`` s before the start to
  ``EXPLAIN_AFTER`` s after the end of a Redis restart or a PostgreSQL termination (a worker that
  loses the broker terminates its running tasks: Celery's
  ``worker_cancel_long_running_tasks_on_connection_loss``; a cut connection can lose a success
  write). Beat faults explain nothing: a beat runs no body. Two effects under one token are never
  explained.
* **exits** — a process that exits is replaced (as a supervisor would); a worker that exits
  within ``EXIT_WINDOW`` s of a Redis restart or a PostgreSQL termination is reported as
  explained (kombu acks on the lost broker connection and raises in the worker's main
  process); any other exit fails the soak.
* **faults** — every planned fault happened: none skipped (no leader found, no pool child) and
  none left when the load ended; after each beat fault a surviving beat led within
  ``FAILOVER_LIMIT`` s.
* **RSS flat** — no process above ``--rss-ceiling-mib``; and every process that lived
  ``RSS_JUDGED_AFTER`` s (or half of the load, if less) past its warm-up ends within
  ``max(RSS_GROWTH x baseline, RSS_SLACK_MIB)`` of its baseline (its RSS after a warm-up of
  ``max(30 s, 10 %)`` of the load). Pool processes, replaced after
  kills and broker losses, are judged together per worker (the highest child RSS in the last
  fifth of the load against the highest in the fifth after the warm-up), and only in a load of
  ``--rss-min-seconds`` (600) or more: each retried attempt makes Celery build a
  ``billiard.einfo.ExceptionInfo`` whose code objects copy ``co_positions()`` (Python 3.11), about
  1.5 MB of garbage in reference cycles, so a pool process climbs to a plateau near 300 MiB over
  its first several hundred retries, which a short run does not reach.

Exit status 0 only if every check passed. ``--plot`` (matplotlib, imported only then) draws
successes per second over time with the faults marked, and every process's RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SETTINGS = "bench.benchapp.soak.settings"
QUEUE = "celery"
PG_SERVER = "postgres://postgres@127.0.0.1:5432"
FAULT_KINDS = ("worker_kill", "pg_terminate", "beat_kill", "child_kill", "redis_restart", "beat_stop")
#: Faults that can interrupt a body between its effect and its recorded success.
EXPLAINING_WINDOWS = ("redis_restart", "pg_terminate")
EXPLAIN_BEFORE = 5.0
EXPLAIN_AFTER = 2.0
#: How long before its process's SIGKILL an effect may have been written for the kill to explain
#: its re-run. A pool process hands a finished body's success to its recorder thread and runs the
#: next body; the recorder retries a write the database refused until the lease is certainly lost
#: (the lease, 10 s in the soak's settings, from its last renewal, renewed every third of it, and a
#: retry pause of 1 s). So at a kill, one success may be in flight and the next body's effect
#: written: each at most about 10 + 10/3 + 1 s old. Older, and its success was recorded or its
#: lease had run out before the kill: the kill does not explain it.
KILL_EXPLAINS = 15.0
#: The latest a surviving beat may take the lead after a beat fault (the lease is 6 s; the
#: target is 10 s with defaults, on a machine the soak keeps busy).
FAILOVER_LIMIT = 15.0
#: A process's RSS is judged flat or not once it has lived this long after its warm-up (or half
#: the load, if less): workers and redis-server are replaced by the faults, so at 1,000,000
#: executions none lives through half of the load.
RSS_JUDGED_AFTER = 300.0
#: A worker exit this long after a broker restart or a database termination (or during it)
#: is explained by it (``exits_explained``): found by the liveness check, run every second.
EXIT_WINDOW = 15.0
#: The beat's lease (settings default) and how long past it a stopped leader stays stopped.
BEAT_LEASE = 6.0
BEAT_STOP_SECONDS = BEAT_LEASE + 4.0
RESTART_AFTER = 2.0
INTERVAL_EVERY = 10
CRON_EVERY = 60
#: How long the load runs on once its estimate of executions reached N, for the slots actually
#: published to catch up (two failovers and a minute's cron slots).
STOP_GRACE = 2 * FAILOVER_LIMIT + CRON_EVERY
RSS_GROWTH = 0.25
RSS_SLACK_MIB = 25.0
SLOT_MARGIN = 5.0
#: Checks whose figure must be 0.
ZERO_CHECKS = (
    "keys_recorded_twice", "lost_no_row", "not_succeeded", "succeeded_without_effect", "rows_not_accounted",
    "effects_without_row", "atomic_duplicate_effects", "slots_missing", "slots_off_grid",
    "plain_reruns_unexplained",
)  # fmt: skip


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


def poll(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def fails_first(key: str) -> bool:
    """One key in ten fails its first attempt (deterministic, so a re-submission matches)."""
    return zlib.crc32(key.encode()) % 10 == 0


# --- producer processes ----------------------------------------------------------------------------


def producer_main(args: argparse.Namespace) -> int:
    """One producer: submit until the stop file appears (or ``--executions`` keys), recording keys."""
    import django

    django.setup()
    import redis
    from django.db import InterfaceError, OperationalError, connection

    from taskplatform import submit, submit_many

    workdir = Path(args.workdir)
    stop = workdir / "stop"
    index = args.producer
    rng = random.Random(index)
    broker = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"], socket_timeout=2, socket_connect_timeout=2)
    counts = Counter[str]()
    # ``--single-share`` is a share of keys: the share of calls that submit one key is larger.
    share = args.single_share
    single_call_share = share * args.batch / (1 - share + share * args.batch) if share < 1 else 1.0
    seq = 0
    batch_no = 0

    def backlog_ok() -> bool:
        try:
            return int(broker.llen(QUEUE)) < args.max_backlog
        except redis.RedisError:
            return False  # the broker is restarting: wait for it

    def patiently(call: Callable[[], Any]) -> Any:
        """``call`` until the database takes it (a terminated connection is retried)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                return call()
            except (OperationalError, InterfaceError):
                connection.close()
                if time.monotonic() > deadline:
                    raise
                counts["db_retries"] += 1
                time.sleep(0.2)

    with (workdir / f"producer-{index}.keys").open("a") as out:
        while not stop.exists() and seq < args.executions:
            while not backlog_ok() and not stop.exists():
                time.sleep(0.05)  # pacing, not synchronisation: the workers drain the queue
            if stop.exists():
                break
            if rng.random() < single_call_share:
                key = f"p{index}-{seq}"
                task = "soak.atomic" if seq % 2 == 0 else "soak.plain"
                kwargs = {"n": seq, "fail": fails_first(key)}
                patiently(partial(submit, task, kwargs=kwargs, idempotency_key=key))
                out.write(f"{key},{task[5:]},submit\n")
                seq += 1
                counts["submit"] += 1
            else:
                task = "soak.atomic" if batch_no % 2 == 0 else "soak.plain"
                batch_no += 1
                keys = [f"p{index}-{n}" for n in range(seq, min(seq + args.batch, args.executions))]
                items = [
                    {"kwargs": {"n": seq + i, "fail": fails_first(k)}, "idempotency_key": k} for i, k in enumerate(keys)
                ]
                patiently(partial(submit_many, task, items))
                out.write("".join(f"{k},{task[5:]},submit_many\n" for k in keys))
                seq += len(keys)
                counts["submit_many"] += len(keys)
            out.flush()
    print(json.dumps({"producer": index, **counts}), flush=True)
    return 0


def classify_reruns(
    rows: list[tuple[Any, ...]], windows: list[tuple[str, float, float]], killed_at: dict[int, list[float]]
) -> dict[str, Any]:
    """Explain the plain effects of keys with more than one: ``rows`` are (key, fencing token,
    pid, when written in seconds from the start of the load, the row's final token) in key order;
    ``windows`` (kind, from, to) the faults that can cut an attempt between its effect and its
    success; ``killed_at`` when the soak SIGKILLed each pid it killed (a pid may be reused).

    The effect under the row's final token, alone under it, is the recorded success. Any other is
    an earlier attempt's: explained when a window holds its time, or when its process was killed
    within ``KILL_EXPLAINS`` s after it was written (the moment is taken just before the signal
    is sent, hence the second of slack). Two effects under one token are never explained: one
    attempt's body ran twice."""
    tokens: dict[str, Counter[int]] = defaultdict(Counter)
    for key, token, _pid, _at, _final in rows:
        tokens[key][token] += 1
    explained: Counter[str] = Counter()
    unexplained = []
    keys = set()
    for key, token, pid, at, final in rows:
        keys.add(key)
        if token == final and tokens[key][token] == 1:
            continue  # the attempt whose success was recorded
        why = None
        if tokens[key][token] == 1:
            if any(killed - KILL_EXPLAINS <= at <= killed + 1.0 for killed in killed_at.get(pid, ())):
                why = "process killed"
            else:
                why = next((kind for kind, lo, hi in windows if lo <= at <= hi), None)
        if why:
            explained[why] += 1
        else:
            unexplained.append({"key": key, "token": token, "pid": pid, "at": round(at, 2), "final_token": final})
    return {
        "keys": len(keys),
        "extra_runs": sum(explained.values()) + len(unexplained),
        "explained": dict(explained),
        "unexplained": unexplained[:50],
    }


def slow_failovers(failovers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The beat faults after which no surviving beat led within ``FAILOVER_LIMIT`` s."""
    return [f for f in failovers if f["new_leader_after_s"] is None or f["new_leader_after_s"] > FAILOVER_LIMIT]


# --- the processes the soak starts -----------------------------------------------------------------


@dataclass
class Proc:
    """A process this soak started (its own session: signals go to its group)."""

    role: str
    popen: subprocess.Popen[bytes]
    started: float
    expected_exit: bool = False
    stopped: bool = False  # SIGSTOPped by a fault, not yet continued

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def group_pids(self) -> list[int]:
        import psutil

        try:
            return [self.pid, *(c.pid for c in psutil.Process(self.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            return [self.pid]

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = 20) -> None:
        """SIGCONT if stopped, SIGTERM, then SIGKILL of the group after ``timeout``."""
        self.expected_exit = True
        if self.stopped:
            self.kill_group(signal.SIGCONT)
            self.stopped = False
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=timeout)
        self.kill_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the load started
    end: float
    target: str = ""
    pids: list[int] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


class Database:
    """A raw psycopg connection that reconnects once when the soak's own faults cut it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: Any = None

    def _connect(self) -> Any:
        import psycopg

        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
        return self.conn

    def rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        import psycopg

        for attempt in range(3):
            try:
                with self._connect().cursor() as cur:
                    cur.execute(sql, params)
                    return list(cur.fetchall()) if cur.description else []
            except psycopg.OperationalError:
                with contextlib.suppress(Exception):
                    self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def value(self, sql: str, params: Any = None) -> Any:
        return self.rows(sql, params)[0][0]

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()


# --- the soak --------------------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n = args.executions
        self.workdir = Path(args.workdir).resolve()
        self.port = args.redis_port or free_port()
        self.db_name = args.database
        self.db_url = f"{PG_SERVER}/{self.db_name}"
        self.broker_url = f"redis://127.0.0.1:{self.port}/0"
        self.procs: list[Proc] = []
        self.redis: Proc | None = None
        self.workers: dict[int, Proc] = {}
        self.beats: list[Proc] = []
        self.producers: list[Proc] = []
        self.generation: Counter[str] = Counter()
        self.faults: list[Fault] = []
        self.killed_at: dict[int, list[float]] = defaultdict(list)  # pid -> when the soak SIGKILLed it
        self.not_injected: list[str] = []
        self.pending: list[tuple[float, str, Callable[[], None]]] = []
        self.unexpected_exits: list[dict[str, Any]] = []
        self.rss: dict[int, dict[str, Any]] = {}  # pid -> {"role", "samples": [(t, rss)]}
        self.leaders: list[tuple[float, int | None]] = []
        self.t0 = 0.0  # wall time.time() at the start of the load
        self.key_offsets: dict[int, int] = {}
        self.keys_recorded = 0
        self.db: Database | None = None
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": args.settings,
            "DATABASE_URL": self.db_url,
            "CELERY_BROKER_URL": self.broker_url,
            "DJANGO_SECRET_KEY": os.environ.get("DJANGO_SECRET_KEY") or f"soak-{random.getrandbits(128):x}",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        }

    # --- set-up ----------------------------------------------------------------------------------

    def rel(self) -> float:
        return time.time() - self.t0

    def create_database(self) -> None:
        import psycopg

        with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.db_name}"')
        os.environ.update({k: self.env[k] for k in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "CELERY_BROKER_URL")})
        os.environ["DJANGO_SECRET_KEY"] = self.env["DJANGO_SECRET_KEY"]
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        self.db = Database(self.db_url)

    def drop_database(self) -> None:
        import psycopg
        from django.db import connections

        connections.close_all()
        if self.db is not None:
            self.db.close()
        with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')

    def spawn(self, role: str, cmd: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> Proc:
        self.generation[role] += 1
        name = f"{role}.{self.generation[role]}"
        out = (self.workdir / f"{name}.out").open("wb")
        popen = subprocess.Popen(
            cmd, cwd=cwd, env=env or self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()
        proc = Proc(role=name, popen=popen, started=time.time())
        self.procs.append(proc)
        return proc

    def start_redis(self) -> None:
        self.redis = self.spawn(
            "redis",
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
        )  # fmt: skip
        poll(lambda: port_open(self.port), 10, f"redis-server on port {self.port}")

    def start_worker(self, slot: int) -> None:
        role = f"worker{slot}"
        name = f"{role}.{self.generation[role] + 1}"
        cmd = [
            sys.executable, "-m", "celery", "-A", "config", "worker", "-P", "prefork", "-c", str(self.args.concurrency),
            "-Q", QUEUE, "-n", f"soak-{name}@%h", "--without-mingle", "--without-gossip", "--without-heartbeat",
            "--loglevel", "WARNING", "-f", str(self.workdir / f"{name}.log"),
        ]  # fmt: skip
        self.workers[slot] = self.spawn(role, cmd)

    def start_beat(self) -> None:
        index = len(self.beats) + 1
        cmd = [
            sys.executable, "-m", "celery", "-A", "config", "beat", "-S", "taskplatform.beat.LockedScheduler",
            "--loglevel", "WARNING", "-f", str(self.workdir / f"beat.{index}.log"), "--pidfile=",
            "-s", str(self.workdir / f"beat-{index}-schedule"),
        ]  # fmt: skip
        self.beats.append(self.spawn("beat", cmd, cwd=self.workdir))

    def start_producer(self, index: int) -> None:
        a = self.args
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--producer", str(index), "--workdir", str(self.workdir),
            "--executions", str(self.n), "--batch", str(a.batch), "--single-share", str(a.single_share),
            "--max-backlog", str(a.max_backlog),
        ]  # fmt: skip
        self.producers.append(self.spawn("producer", cmd))

    def create_jobs(self) -> list[dict[str, Any]]:
        """The scheduled jobs: ``--interval-jobs`` every 10 s (anchors spread over the 10 s) and
        ``--cron-jobs`` every minute; every tenth fails the first attempt of each slot."""
        from taskplatform import schedule_job
        from taskplatform.models import JobDefinition

        anchor = datetime(2020, 1, 1, tzinfo=UTC)
        jobs = []
        for i in range(self.args.interval_jobs + self.args.cron_jobs):
            interval = i < self.args.interval_jobs
            task = "soak.atomic" if i % 2 == 0 else "soak.plain"
            slug = f"soak-{'every10s' if interval else 'cron'}-{i}"
            job = JobDefinition.objects.create(
                slug=slug, task=task, kwargs={"n": i, "fail": i % 10 == 3}, misfire_policy="catch_up"
            )
            if interval:
                start = anchor + timedelta(seconds=i % INTERVAL_EVERY)
                schedule_job(job, every_seconds=INTERVAL_EVERY, start=start)
                jobs.append({"id": job.pk, "slug": slug, "every": INTERVAL_EVERY, "anchor": start.timestamp()})
            else:
                schedule_job(job, cron="* * * * *")
                jobs.append({"id": job.pk, "slug": slug, "every": CRON_EVERY, "anchor": anchor.timestamp()})
        return jobs

    # --- observation ---------------------------------------------------------------------------

    def count_keys(self) -> int:
        for i in range(len(self.producers)):
            path = self.workdir / f"producer-{i}.keys"
            if not path.exists():
                continue
            offset = self.key_offsets.get(i, 0)
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self.keys_recorded += chunk[:end].count(b"\n")
            self.key_offsets[i] = offset + end
        return self.keys_recorded

    def queue_length(self) -> int | str:
        import redis

        try:
            return int(redis.Redis.from_url(self.broker_url, socket_timeout=1).llen(QUEUE))
        except redis.RedisError:
            return "unreachable"

    def slots_estimate(self, since: float) -> int:
        elapsed = max(0.0, time.time() - since)
        return int(self.args.interval_jobs * elapsed / INTERVAL_EVERY + self.args.cron_jobs * elapsed / CRON_EVERY)

    def slots_published(self) -> int:
        assert self.db is not None
        return int(self.db.rows("SELECT count(*) FROM taskplatform_execution WHERE trigger = 'beat'")[0][0])

    def leader_pid(self) -> int | None:
        assert self.db is not None
        rows = self.db.rows("SELECT leader FROM taskplatform_schedulerfence WHERE name = 'taskplatform.beat'")
        if not rows or not rows[0][0]:
            return None
        try:
            return int(rows[0][0].split("#")[0].rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return None

    def our_leader(self) -> Proc | None:
        pid = self.leader_pid()
        return next((b for b in self.beats if b.pid == pid and b.alive() and not b.stopped), None)

    def sample_rss(self) -> None:
        import psutil

        now = self.rel()
        tracked: list[tuple[str, int]] = [("soak", os.getpid())]
        for proc in self.procs:
            if not proc.alive():
                continue
            tracked.append((proc.role, proc.pid))
            if proc.role.startswith("worker"):
                with contextlib.suppress(psutil.NoSuchProcess):
                    tracked += [(f"{proc.role}/child", c.pid) for c in psutil.Process(proc.pid).children()]
        for role, pid in tracked:
            try:
                process = psutil.Process(pid)
                rss = process.memory_info().rss
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            entry = self.rss.setdefault(pid, {"role": role, "samples": []})
            entry["samples"].append((round(now, 1), rss))
            entry["cpu_seconds"] = round(times.user + times.system, 1)

    def check_liveness(self) -> None:
        for proc in self.procs:
            if proc.expected_exit or proc.alive() or proc.role.startswith("producer"):
                continue
            proc.expected_exit = True
            code = proc.popen.returncode
            self.unexpected_exits.append({"role": proc.role, "pid": proc.pid, "code": code, "at": round(self.rel(), 1)})
            log(f"{proc.role} (pid {proc.pid}) exited unexpectedly with {code}; replacing it")
            if proc.role.startswith("worker"):
                self.start_worker(int(proc.role[6:].split(".")[0]))
            elif proc.role.startswith("beat"):
                self.start_beat()
            elif proc.role.startswith("redis"):
                self.start_redis()

    # --- faults ---------------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str]]:
        cycles = self.args.fault_cycles if self.args.fault_cycles is not None else max(1, round(self.n / 150_000))
        kinds = [k for _ in range(cycles) for k in FAULT_KINDS]
        if not kinds:
            return []
        span = len(kinds) - 1 or 1
        return [(0.10 + 0.75 * i / span if len(kinds) > 1 else 0.5, kind) for i, kind in enumerate(kinds)]

    def inject(self, kind: str, cycle: int) -> None:
        at = self.rel()
        fault = Fault(kind=kind, at=round(at, 2), end=round(at, 2))
        if kind in ("worker_kill", "child_kill"):
            slot = 1 + cycle % 2
            worker = self.workers[slot]
            if kind == "worker_kill":
                fault.pids = worker.group_pids()
                worker.expected_exit = True
                worker.kill_group(signal.SIGKILL)
                fault.target = worker.role
                self.later(RESTART_AFTER, f"restart worker{slot}", lambda: self.start_worker(slot))
            else:
                children = worker.group_pids()[1:]
                if not children:
                    fault.detail["skipped"] = "no pool child"
                else:
                    victim = random.Random(int(at)).choice(children)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
                    fault.pids = [victim]
                    fault.target = f"{worker.role}/child"
            for pid in fault.pids:
                self.killed_at[pid].append(at)
        elif kind in ("beat_kill", "beat_stop"):
            leader = self.wait_leader(10)
            if leader is None:
                fault.detail["skipped"] = "no leader identified within 10 s"
            else:
                fault.target, fault.pids = leader.role, [leader.pid]
                fault.detail["leader_before"] = leader.pid
                fault.detail["signalled_at"] = round(self.rel(), 2)  # finding the leader took time
                if kind == "beat_kill":
                    leader.expected_exit = True
                    leader.kill_group(signal.SIGKILL)
                    self.later(RESTART_AFTER, "start a beat", self.start_beat)
                else:
                    leader.kill_group(signal.SIGSTOP)
                    leader.stopped = True
                    fault.end = round(at + BEAT_STOP_SECONDS, 2)

                    def resume(leader: Proc = leader) -> None:
                        leader.kill_group(signal.SIGCONT)
                        leader.stopped = False

                    self.later(BEAT_STOP_SECONDS, f"SIGCONT {leader.role}", resume)
        elif kind == "redis_restart":
            assert self.redis is not None
            old = self.redis
            fault.pids, fault.target = [old.pid], old.role
            old.expected_exit = True
            old.kill_group(signal.SIGKILL)
            old.popen.wait(timeout=10)
            self.start_redis()
            fault.end = round(self.rel(), 2)
        elif kind == "pg_terminate":
            import psycopg

            with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5) as conn:
                row = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (self.db_name,),
                ).fetchone()
            fault.detail["connections_terminated"] = int(row[0]) if row else 0
            fault.end = round(self.rel(), 2)
        self.faults.append(fault)
        log(f"fault {kind} at {at:.1f} s: {fault.target or ''} {fault.pids or ''} {fault.detail or ''}")

    def wait_leader(self, timeout: float) -> Proc | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.our_leader()
            if leader is not None:
                return leader
            time.sleep(0.2)
        return None

    def later(self, delay: float, what: str, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + delay, what, action))

    def run_pending(self, force: bool = False) -> None:
        now = time.monotonic()
        due = [p for p in self.pending if force or p[0] <= now]
        self.pending = [p for p in self.pending if p not in due]
        for _when, _what, action in sorted(due, key=lambda p: p[0]):
            action()

    def watch_leader(self) -> None:
        pid = self.leader_pid()
        if not self.leaders or self.leaders[-1][1] != pid:
            self.leaders.append((round(self.rel(), 2), pid))

    def await_failovers(self) -> None:
        """Before the beats stop: watch the lead until every beat fault has a successor, or
        ``FAILOVER_LIMIT`` s have passed since it (a fault near the end of the load)."""
        while True:
            self.watch_leader()
            open_ = [f for f in self.failovers() if f["new_leader_after_s"] is None]
            if not open_ or all(self.rel() - f["at"] > FAILOVER_LIMIT for f in open_):
                return
            time.sleep(0.2)

    # --- the run ---------------------------------------------------------------------------------

    def run(self) -> int:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for old in self.workdir.glob("*"):
            if old.is_file():
                old.unlink()
        wall_start = time.time()
        try:
            return self._run(wall_start)
        finally:
            self.cleanup()

    def _run(self, wall_start: float) -> int:
        log(f"database {self.db_name}, redis port {self.port}, workdir {self.workdir}")
        self.create_database()
        jobs = self.create_jobs()
        self.start_redis()
        for slot in (1, 2):
            self.start_worker(slot)
        self.t0 = time.time()
        for _ in range(2):
            self.start_beat()
        beats_started = time.time()
        for i in range(self.args.producers):
            self.start_producer(i)
        plan = self.schedule()
        log(f"load: {self.n:,} executions, {len(plan)} faults planned, {len(jobs)} scheduled jobs")
        next_rss = next_leader = next_report = 0.0
        rss_every = max(2.0, min(10.0, self.n / 100_000))
        last_report = (time.monotonic(), 0)
        stop_file = self.workdir / "stop"
        fault_index = 0
        estimate_reached = 0.0
        while True:
            keys = self.count_keys()
            progress = keys + self.slots_estimate(beats_started)
            mono = time.monotonic()
            # The estimate paces the faults; the stop is judged on the slots actually published
            # (a failover's gap or a late first slot leaves the estimate ahead of them), for at
            # most ``STOP_GRACE`` s after the estimate got there: a load whose workers and beats
            # are wedged ends, and the report says what fell short, rather than run on forever.
            if progress >= self.n:
                estimate_reached = estimate_reached or mono
                if keys + self.slots_published() >= self.n:
                    break
                if mono - estimate_reached > STOP_GRACE:
                    log(f"load stopped {STOP_GRACE:.0f} s after the estimate reached {self.n:,}: slots fell behind it")
                    break
            if all(not p.alive() for p in self.producers):
                break
            while fault_index < len(plan) and progress >= plan[fault_index][0] * self.n:
                self.inject(plan[fault_index][1], fault_index // len(FAULT_KINDS))
                fault_index += 1
            self.run_pending()
            self.check_liveness()
            if mono >= next_rss:
                self.sample_rss()
                next_rss = mono + rss_every
            if mono >= next_leader:
                self.watch_leader()
                next_leader = mono + 0.5
            if mono >= next_report:
                rate = (keys - last_report[1]) / max(1e-9, mono - last_report[0])
                log(
                    f"{self.rel():7.1f} s: {keys:,} keys recorded (+slots ~{progress - keys:,}), {rate:,.0f} keys/s, "
                    f"queue {self.queue_length()}"
                )
                last_report = (mono, keys)
                next_report = mono + 10
            time.sleep(0.2)
        stop_file.touch()
        for fault_kind in [k for _f, k in plan[fault_index:]]:
            log(f"fault {fault_kind} not injected: the load ended first")
            self.not_injected.append(fault_kind)
        for producer in self.producers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                producer.popen.wait(timeout=120)
        producer_codes = {p.role: p.popen.poll() for p in self.producers}
        self.run_pending(force=True)
        self.check_liveness()
        self.await_failovers()
        t_stop = time.time()
        for beat in self.beats:
            beat.stop()
        load_end = self.rel()
        log(f"load done at {load_end:.1f} s; beats stopped; draining")
        drained = self.drain()
        drain_end = self.rel()
        self.sample_rss()
        for proc in self.procs:
            if proc.role.startswith("worker"):
                proc.stop()
        result = self.analyse(jobs, t_stop, load_end, drain_end, drained, producer_codes)
        result["wall_seconds"] = round(time.time() - wall_start, 1)
        self.report(result)
        return 0 if result["passed"] else 1

    def drain(self) -> bool:
        assert self.db is not None
        deadline = time.monotonic() + self.args.drain_timeout
        next_rss = 0.0
        while time.monotonic() < deadline:
            rows = dict(
                self.db.rows(
                    "SELECT state, count(*) FROM taskplatform_execution WHERE state <> 'SUCCEEDED' GROUP BY state"
                )
            )
            if not rows:
                return True
            if rows.get("FAILED"):
                log(f"{rows['FAILED']} execution(s) dead-lettered: the drain stops")
                return False
            self.check_liveness()
            if time.monotonic() >= next_rss:
                self.sample_rss()
                next_rss = time.monotonic() + 5
            time.sleep(1)
        return False

    def cleanup(self) -> None:
        self.pending.clear()
        for proc in reversed(self.procs):
            if proc.alive() or proc.stopped:
                proc.stop(timeout=10)
        if self.args.drop_after and self.db_name:
            with contextlib.suppress(Exception):
                self.drop_database()

    # --- the checks ------------------------------------------------------------------------------

    def analyse(
        self,
        jobs: list[dict[str, Any]],
        t_stop: float,
        load_end: float,
        drain_end: float,
        drained: bool,
        producer_codes: dict[str, int | None],
    ) -> dict[str, Any]:
        assert self.db is not None
        db = self.db
        db.rows("DROP TABLE IF EXISTS soak_submitted")
        db.rows("CREATE UNLOGGED TABLE soak_submitted (key text, task text, way text)")
        with db._connect().cursor() as cur:
            with cur.copy("COPY soak_submitted (key, task, way) FROM STDIN WITH (FORMAT csv)") as copy:
                for path in sorted(self.workdir.glob("producer-*.keys")):
                    with path.open("rb") as f:
                        while chunk := f.read(1 << 20):
                            copy.write(chunk)
            cur.execute("CREATE INDEX ON soak_submitted (key)")
            cur.execute("ANALYZE soak_submitted")
        q = db.value
        ways = dict(db.rows("SELECT way, count(*) FROM soak_submitted GROUP BY way"))
        submitted = sum(ways.values())
        total = q("SELECT count(*) FROM taskplatform_execution")
        by_trigger = dict(db.rows("SELECT trigger, count(*) FROM taskplatform_execution GROUP BY trigger"))
        states = dict(db.rows("SELECT state, count(*) FROM taskplatform_execution GROUP BY state"))
        checks: dict[str, Any] = {}
        checks["producers_exited_0"] = all(code == 0 for code in producer_codes.values())
        checks["keys_recorded_twice"] = q(
            "SELECT count(*) FROM (SELECT key FROM soak_submitted GROUP BY key HAVING count(*) > 1) d"
        )
        checks["lost_no_row"] = q(
            "SELECT count(*) FROM soak_submitted s WHERE NOT EXISTS "
            "(SELECT 1 FROM taskplatform_execution e WHERE e.idempotency_key = s.key)"
        )
        checks["not_succeeded"] = total - states.get("SUCCEEDED", 0)
        checks["succeeded_without_effect"] = q(
            "SELECT count(*) FROM taskplatform_execution e WHERE e.state = 'SUCCEEDED' AND NOT EXISTS "
            "(SELECT 1 FROM soak_soakeffect f WHERE f.key = e.idempotency_key)"
        )
        checks["rows_not_accounted"] = q(
            "SELECT count(*) FROM taskplatform_execution e WHERE e.trigger <> 'beat' AND NOT EXISTS "
            "(SELECT 1 FROM soak_submitted s WHERE s.key = e.idempotency_key)"
        )
        checks["effects_without_row"] = q(
            "SELECT count(*) FROM soak_soakeffect f WHERE NOT EXISTS "
            "(SELECT 1 FROM taskplatform_execution e WHERE e.idempotency_key = f.key)"
        )
        checks["atomic_duplicate_effects"] = q(
            "SELECT count(*) FROM (SELECT key FROM soak_soakeffect WHERE task = 'atomic' "
            "GROUP BY key HAVING count(*) > 1) d"
        )
        slots = self.check_slots(jobs, t_stop)
        checks.update({f"slots_{k}": v for k, v in slots.items() if k != "expected"})
        reruns = self.explain_reruns()
        checks["plain_reruns_unexplained"] = len(reruns["unexplained"])
        rss = self.rss_summary(load_end)
        checks["rss_not_flat"] = [r["process"] for r in rss if r["flat"] is False]
        # A worker whose broker connection broke (a Redis restart) can die of it: kombu acks on a
        # lost connection and raises in the worker's main process. A supervisor restarts it, as
        # the soak does; such an exit is reported as explained, not hidden. Any other is a failure.
        broke = [(f.kind, f.at, f.end + EXIT_WINDOW) for f in self.faults if f.kind in EXPLAINING_WINDOWS]
        explained, unexplained = [], []
        for exit_ in self.unexpected_exits:
            why = next(
                (kind for kind, lo, hi in broke if exit_["role"].startswith("worker") and lo <= exit_["at"] <= hi), None
            )
            (explained if why else unexplained).append({**exit_, **({"explained_by": why} if why else {})})
        checks["exits_explained"] = explained
        checks["unexpected_exits"] = unexplained
        checks["drained"] = drained
        # Every planned fault must have happened: a skipped one (no leader, no pool child) or one
        # the load ended before proves nothing about its kind.
        checks["faults_not_injected"] = [
            *self.not_injected,
            *(f"{f.kind} ({f.detail['skipped']})" for f in self.faults if "skipped" in f.detail),
        ]
        failovers = self.failovers()
        checks["failovers_slow"] = slow_failovers(failovers)
        zero = [k for k in ZERO_CHECKS if checks[k] != 0]
        listed = ("unexpected_exits", "rss_not_flat", "faults_not_injected", "failovers_slow")
        passed = checks["producers_exited_0"] and drained and not zero and not any(checks[k] for k in listed)
        checks["failed"] = [
            *zero,
            *(["producers_exited_0"] if not checks["producers_exited_0"] else []),
            *(["drained"] if not drained else []),
            *(k for k in listed if checks[k]),
        ]
        events = dict(db.rows("SELECT kind, count(*) FROM taskplatform_executionevent GROUP BY kind"))
        parked = q(
            "SELECT count(*) FROM taskplatform_executionevent WHERE kind = 'retry_scheduled' "
            "AND (data->>'parked_in_ledger')::boolean"
        )
        planned_failures = q("SELECT count(*) FROM soak_soakstart WHERE fails")
        throughput = self.throughput(drain_end)
        # Starts are recorded for planned failures and attempts after the first: an atomic key's
        # attempts beyond its planned retry are restarts (an attempt cut by a fault).
        atomic_restarts = q(
            "SELECT coalesce(sum(n - planned), 0) FROM (SELECT key, count(*) FILTER (WHERE NOT fails) AS n, "
            "count(*) FILTER (WHERE fails) AS planned FROM soak_soakstart WHERE task = 'atomic' GROUP BY key) d"
        )
        return {
            "executions_target": self.n,
            "executions": total,
            "submitted": {"total": submitted, **ways},
            "slots": by_trigger.get("beat", 0),
            "slots_expected": slots["expected"],
            "jobs": {"every_10s": self.args.interval_jobs, "every_minute": self.args.cron_jobs},
            "by_trigger": by_trigger,
            "states": states,
            "load_seconds": round(load_end, 1),
            "drain_seconds": round(drain_end - load_end, 1),
            "executions_per_second": round(total / max(1e-9, throughput["last_success"]), 1),
            "throughput": throughput,
            "faults": [vars(f) for f in self.faults],
            "fault_counts": dict(Counter(f.kind for f in self.faults if "skipped" not in f.detail)),
            "failovers": failovers,
            "leaders": self.leaders,
            "planned_failures": planned_failures,
            "retries_parked_in_ledger": parked,
            "events": events,
            "plain_reruns": reruns,
            "atomic_restarts": atomic_restarts,
            "rss": rss,
            "checks": checks,
            "passed": bool(passed),
            "t0_epoch": self.t0,
            "config": {k: v for k, v in vars(self.args).items() if k not in ("producer", "plot", "json", "markdown")}
            | {"redis_port": self.port},
        }

    def check_slots(self, jobs: list[dict[str, Any]], t_stop: float) -> dict[str, int]:
        assert self.db is not None
        # The slot is the key's (``<job>@<slot UTC>``): ``scheduled_for`` moves with a retry's due time.
        per_job: dict[int, list[float]] = defaultdict(list)
        for job_id, key in self.db.rows(
            "SELECT job_id, idempotency_key FROM taskplatform_execution WHERE trigger = 'beat'"
        ):
            per_job[job_id].append(datetime.fromisoformat(key.rsplit("@", 1)[1]).timestamp())
        # Owed: every grid point from the first publication of any slot (the first leader's
        # start) to SLOT_MARGIN s before the beats were stopped.
        first_publication = self.db.value(
            "SELECT extract(epoch FROM min(created_at))::float FROM taskplatform_execution WHERE trigger = 'beat'"
        )
        begin = first_publication if first_publication is not None else t_stop
        end = t_stop - SLOT_MARGIN
        missing = off_grid = expected = 0
        for job in jobs:
            every, anchor = job["every"], job["anchor"]
            k0 = -(-(begin - anchor) // every)  # the first grid point at or after ``begin``
            grid = {round(anchor + k * every, 3) for k in range(int(k0), int((end - anchor) // every) + 1)}
            got = per_job.get(job["id"], [])
            have = {round(s, 3) for s in got}
            expected += len(grid)
            missing += len(grid - have)
            off_grid += sum(1 for s in got if abs((s - anchor) / every - round((s - anchor) / every)) > 1e-6)
        return {"expected": expected, "missing": missing, "off_grid": off_grid}

    def explain_reruns(self) -> dict[str, Any]:
        """Every plain effect whose fencing token is not the row's (the recorded success) is a re-run's
        earlier attempt; it must be explained by a fault (see the module's docstring)."""
        assert self.db is not None
        rows = self.db.rows(
            "SELECT f.key, f.fencing_token, f.pid, f.at - %s, e.fencing_token FROM soak_soakeffect f "
            "JOIN taskplatform_execution e ON e.idempotency_key = f.key "
            "WHERE f.task = 'plain' AND f.key IN "
            "(SELECT key FROM soak_soakeffect WHERE task = 'plain' GROUP BY key HAVING count(*) > 1) "
            "ORDER BY f.key, f.fencing_token",
            (self.t0,),
        )
        windows = [
            (f.kind, f.at - EXPLAIN_BEFORE, f.end + EXPLAIN_AFTER) for f in self.faults if f.kind in EXPLAINING_WINDOWS
        ]
        return classify_reruns(rows, windows, self.killed_at)

    def failovers(self) -> list[dict[str, Any]]:
        out = []
        for fault in self.faults:
            if fault.kind not in ("beat_kill", "beat_stop") or not fault.pids:
                continue
            victim = fault.pids[0]
            signalled = fault.detail.get("signalled_at", fault.at)
            after = next((t for t, pid in self.leaders if t >= signalled and pid not in (None, victim)), None)
            out.append(
                {
                    "kind": fault.kind,
                    "at": signalled,
                    "new_leader_after_s": round(after - signalled, 1) if after else None,
                }
            )
        return out

    def rss_summary(self, load_end: float) -> list[dict[str, Any]]:
        """RSS per process; ``flat`` (None: not judged) as the module's docstring says."""
        warm = max(30.0, 0.10 * load_end)
        judge_children = load_end >= self.args.rss_min_seconds
        mib = 1 << 20
        out = []
        for pid, entry in sorted(self.rss.items(), key=lambda item: (item[1]["role"], item[0])):
            samples = entry["samples"]
            if not samples:
                continue
            start_t = samples[0][0]
            baseline = next((s for s in samples if s[0] >= start_t + warm), None)
            last = samples[-1]
            peak = max(s[1] for s in samples)
            child = entry["role"].endswith("/child")
            flat: bool | None = None
            if peak / mib > self.args.rss_ceiling_mib:
                flat = False
            elif baseline is not None and last[0] - baseline[0] >= min(0.5 * load_end, RSS_JUDGED_AFTER) and not child:
                growth = (last[1] - baseline[1]) / mib
                flat = growth <= max(RSS_GROWTH * baseline[1] / mib, RSS_SLACK_MIB)
            out.append(
                {
                    "process": f"{entry['role']} (pid {pid})",
                    "role": entry["role"],
                    "pid": pid,
                    "from_s": start_t,
                    "to_s": last[0],
                    "first_mib": round(samples[0][1] / mib, 1),
                    "baseline_mib": round(baseline[1] / mib, 1) if baseline else None,
                    "last_mib": round(last[1] / mib, 1),
                    "max_mib": round(peak / mib, 1),
                    "flat": flat,
                    "cpu_seconds": entry.get("cpu_seconds"),
                    "samples": samples,
                }
            )
        if judge_children:
            out += self.pool_envelopes(warm, load_end)
        return out

    def pool_envelopes(self, warm: float, load_end: float) -> list[dict[str, Any]]:
        """Each worker's pool processes taken together (children are replaced after kills and
        broker losses): the highest child RSS in the last fifth of the load against the highest
        in the fifth after the warm-up."""
        mib = 1 << 20
        out = []
        for slot in sorted({e["role"].split(".")[0] for e in self.rss.values() if e["role"].endswith("/child")}):
            samples = [s for e in self.rss.values() if e["role"].startswith(f"{slot}.") and e["role"].endswith("/child")
                       for s in e["samples"]]  # fmt: skip
            early = [v for t, v in samples if warm <= t <= warm + 0.2 * load_end]
            late = [v for t, v in samples if 0.8 * load_end <= t <= load_end]
            if not early or not late:
                continue
            a, b = max(early) / mib, max(late) / mib
            out.append(
                {
                    "process": f"{slot} pool (every child, highest)", "role": f"{slot}/pool", "pid": 0,
                    "from_s": warm, "to_s": load_end, "first_mib": None, "baseline_mib": round(a, 1),
                    "last_mib": round(b, 1), "max_mib": round(max(v for _t, v in samples) / mib, 1),
                    "flat": b - a <= max(RSS_GROWTH * a, RSS_SLACK_MIB), "cpu_seconds": None, "samples": [],
                }
            )  # fmt: skip
        return out

    def throughput(self, drain_end: float) -> dict[str, Any]:
        assert self.db is not None
        bucket = max(1, round(drain_end / 150))
        rows = self.db.rows(
            "SELECT floor((extract(epoch FROM finished_at) - %s) / %s)::int AS b, count(*) "
            "FROM taskplatform_execution WHERE state = 'SUCCEEDED' GROUP BY b ORDER BY b",
            (self.t0, bucket),
        )
        series = [(b * bucket, n / bucket) for b, n in rows]
        last = (rows[-1][0] + 1) * bucket if rows else 0
        rates = [r for _t, r in series]
        return {
            "bucket_seconds": bucket,
            "series": series,
            "last_success": last,
            "median_per_second": round(statistics.median(rates), 1) if rates else 0,
            "p10_per_second": round(sorted(rates)[len(rates) // 10], 1) if rates else 0,
        }

    # --- output ----------------------------------------------------------------------------------

    def report(self, result: dict[str, Any]) -> None:
        args = self.args
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        if args.plot:
            plot(result, Path(args.plot))
        text = markdown(result, args)
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(text)
        print(text, flush=True)
        log("PASSED" if result["passed"] else "FAILED")


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    c = result["checks"]
    reruns = result["plain_reruns"]
    faults = ", ".join(f"{k} {v}" for k, v in sorted(result["fault_counts"].items()))
    failovers = [f["new_leader_after_s"] for f in result["failovers"]]
    lines = [
        f"Soak of {result['executions']:,} executions ({result['submitted'].get('submit', 0):,} by `submit()`, "
        f"{result['submitted'].get('submit_many', 0):,} by `submit_many()`, {result['slots']:,} beat slots of "
        f"{sum(result['jobs'].values())} jobs), {result['wall_seconds']:,.0f} s in all: "
        f"load {result['load_seconds']:,.0f} s, drain {result['drain_seconds']:,.0f} s; "
        f"{result['executions_per_second']:,.0f} executions/s overall "
        f"(median of {result['throughput']['bucket_seconds']} s buckets "
        f"{result['throughput']['median_per_second']:,.0f}/s). **{'PASSED' if result['passed'] else 'FAILED'}**.",
        "",
        "| check | result |",
        "|---|---|",
        f"| faults injected | {faults} |",
        f"| beat failover (s) | {', '.join(str(f) for f in failovers) or '-'} |",
        f"| lost (recorded keys without a row, rows not SUCCEEDED, successes without an effect) | "
        f"{c['lost_no_row']}, {c['not_succeeded']}, {c['succeeded_without_effect']} |",
        f"| beat slots owed (grid from the first publication to 5 s before the beats stopped) / missing / "
        f"off the grid | {result['slots_expected']:,} / {c['slots_missing']} / {c['slots_off_grid']} |",
        f"| atomic keys with more than one effect | {c['atomic_duplicate_effects']} |",
        f"| atomic bodies started again (rolled back, one effect) | {result['atomic_restarts']} |",
        f"| non-atomic re-runs (keys / extra runs) | {reruns['keys']} / {reruns['extra_runs']} |",
        f"| … explained | {', '.join(f'{k} {v}' for k, v in sorted(reruns['explained'].items())) or '-'}; "
        f"unexplained {len(reruns['unexplained'])} |",
        f"| planned first-attempt failures / retries parked in the ledger | "
        f"{result['planned_failures']:,} / {result['retries_parked_in_ledger']:,} |",
        f"| process exits: explained by a broker or database fault / unexpected | "
        f"{len(c.get('exits_explained', []))} / {len(c['unexpected_exits'])} |",
        "",
        "| process | RSS first (MiB) | after warm-up | last | max | flat | CPU s |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    load = result["load_seconds"]
    for r in result["rss"]:
        lived = r["to_s"] - r["from_s"] >= 0.5 * load
        if not lived and r["role"].endswith("/child"):
            continue  # pool children replaced after a kill or a broker loss: in the JSON
        flat = {True: "yes", False: "**no**", None: "not judged" if lived else "(short-lived)"}[r["flat"]]
        figures = " | ".join(str(r[k] or "-") for k in ("first_mib", "baseline_mib", "last_mib", "max_mib"))
        lines.append(f"| {r['process']} | {figures} | {flat} | {r['cpu_seconds']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True, height_ratios=[3, 2])
    series = result["throughput"]["series"]
    top.plot([t for t, _ in series], [r for _, r in series], color="black", linewidth=1, label="succeeded /s")
    colours = {
        "worker_kill": "tab:red", "child_kill": "tab:orange", "beat_kill": "tab:purple", "beat_stop": "tab:pink",
        "redis_restart": "tab:blue", "pg_terminate": "tab:green",
    }  # fmt: skip
    seen = set()
    for fault in result["faults"]:
        if "skipped" in fault["detail"]:
            continue
        for axis in (top, bottom):
            axis.axvline(fault["at"], color=colours[fault["kind"]], linewidth=1, alpha=0.8,
                         label=fault["kind"] if axis is top and fault["kind"] not in seen else None)  # fmt: skip
        if fault["end"] > fault["at"] + 1:
            top.axvspan(fault["at"], fault["end"], color=colours[fault["kind"]], alpha=0.12)
        seen.add(fault["kind"])
    top.axvline(result["load_seconds"], color="grey", linestyle="--", linewidth=1, label="load ends, drain")
    top.set_ylabel(f"executions succeeded /s ({result['throughput']['bucket_seconds']} s buckets)")
    top.set_title(
        f"Soak: {result['executions']:,} executions, {sum(result['fault_counts'].values())} faults, "
        f"{'passed' if result['passed'] else 'FAILED'}"
    )
    top.legend(loc="lower left", fontsize=8, ncol=4)
    top.grid(alpha=0.3)
    for r in result["rss"]:
        samples = r["samples"]
        if len(samples) < 2:
            continue
        bottom.plot([t for t, _ in samples], [v / (1 << 20) for _, v in samples], linewidth=0.8)
    bottom.set_ylabel("RSS per process (MiB)")
    bottom.set_xlabel("seconds since the load started")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--executions", type=int, default=1_000_000, help="executions in all (submissions + slots)")
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2, help="pool processes of each of the 2 workers")
    p.add_argument("--batch", type=int, default=100, help="keys per submit_many() call")
    p.add_argument("--single-share", type=float, default=0.1, help="share of keys submitted by submit()")
    p.add_argument("--max-backlog", type=int, default=400, help="producers wait while the queue holds this many")
    p.add_argument("--interval-jobs", type=int, default=200, help="jobs every 10 s")
    p.add_argument("--cron-jobs", type=int, default=100, help="jobs every minute")
    p.add_argument("--fault-cycles", type=int, default=None, help="each fault kind this often (default N/150,000)")
    p.add_argument("--drain-timeout", type=float, default=300)
    p.add_argument("--rss-ceiling-mib", type=float, default=450, help="no process may exceed this RSS")
    p.add_argument(
        "--rss-min-seconds", type=float, default=600, help="pool processes are judged flat only in a load this long"
    )
    p.add_argument("--database", default="taskplatform_soak")
    p.add_argument("--redis-port", type=int, default=6390, help="0: a free port")
    p.add_argument("--workdir", default="/tmp/soak-work", help="logs, producers' key files")
    p.add_argument("--drop-after", action="store_true", help="drop the soak database at the end")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--plot", help="PNG of throughput and RSS over time (needs matplotlib)")
    p.add_argument("--markdown", help="write the summary tables here")
    p.add_argument("--settings", default=SETTINGS, help="Django settings of every process (a variant of the soak's)")
    p.add_argument(
        "--recheck", metavar="JSON",
        help="judge a finished run again by this script's rules: its JSON result, its database (still there, "
        "--database) and its load's start (--t0, epoch seconds, for a result written before t0_epoch was)",
    )  # fmt: skip
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    p.add_argument("--producer", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def recheck(args: argparse.Namespace) -> int:
    """The checks that do not need the processes, from a finished run's result and database:
    its re-runs explained by the faults it recorded, the planned faults all injected, its
    failovers, its processes' RSS. Prints them as JSON; exit status 0 if all hold."""
    result = json.loads(Path(args.recheck).read_text())
    defaults = parse([])
    for name, value in result["config"].items():  # the run's own settings, unless given here
        if hasattr(args, name) and getattr(args, name) == getattr(defaults, name, None):
            setattr(args, name, value)
    args.executions = result["executions_target"]
    if args.t0 is None and "t0_epoch" not in result:
        raise SystemExit("this result predates t0_epoch: give the load's start with --t0 (epoch seconds)")
    soak = Soak(args)
    soak.t0 = args.t0 if args.t0 is not None else result["t0_epoch"]
    soak.db = Database(soak.db_url)
    soak.faults = [Fault(**fault) for fault in result["faults"]]
    for fault in soak.faults:
        if fault.kind in ("worker_kill", "child_kill"):
            for pid in fault.pids:
                soak.killed_at[pid].append(fault.at)
    soak.rss = {
        r["pid"]: {"role": r["role"], "samples": r["samples"], "cpu_seconds": r["cpu_seconds"]}
        for r in result["rss"]
        if r["pid"]
    }
    planned = Counter(kind for _at, kind in soak.schedule())
    injected = Counter(f.kind for f in soak.faults if "skipped" not in f.detail)
    reruns = soak.explain_reruns()
    rss = soak.rss_summary(result["load_seconds"])
    checks = {
        "plain_reruns": {k: v for k, v in reruns.items() if k != "unexplained"},
        "plain_reruns_unexplained": reruns["unexplained"],
        "faults_not_injected": sorted((planned - injected).elements()),
        "failovers_slow": slow_failovers(result["failovers"]),
        "rss_judged": sum(1 for r in rss if r["flat"] is not None),
        "rss_not_flat": [r["process"] for r in rss if r["flat"] is False],
    }
    print(json.dumps(checks, indent=2))
    listed = ("plain_reruns_unexplained", "faults_not_injected", "failovers_slow", "rss_not_flat")
    return 1 if any(checks[k] for k in listed) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS)
    if args.producer is not None:
        return producer_main(args)
    if args.recheck:
        return recheck(args)
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not on PATH")
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
