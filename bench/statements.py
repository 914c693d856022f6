"""The plain ``.delay()`` path's ledger statements, against cheaper forms of them, in one process.

    .venv/bin/python bench/statements.py [--blocks 8] [--per-block 1000]

Each task is what a worker's pool process commits for it on the ``.delay()`` path: the row
created already claimed (``ledger.create_claimed``), and the success (``ledger.succeed``).
Variants, in alternating blocks (A B C …, then … C B A, …):

* ``separate``: the two as two prepared statements in autocommit, two durable commits: what a
  pool process that is not busy commits (its parked success written by the recorder thread,
  ``worker/recorder.py``), and what every task committed before successes rode with claims;
* ``carried``: the steady state of a busy pool process: each claim's statement carries the
  previous task's success, one durable commit a task;
* ``no_events``: ``carried`` without the event rows (the event CTEs emptied): what writing no
  history on the happy path would save;
* ``two_indexes``: as ``no_events``, into a copy of the execution table with only its primary
  key and its idempotency key indexed: what the other indexes cost on top;
* ``partial_indexes``: as ``no_events``, into a copy of the execution table with every index
  of the real one, but with those whose rows a happy path passes through made partial: the
  job's (``job_id IS NOT NULL``), ``(state, due_at)`` (``due_at IS NOT NULL``: a claim clears
  it), ``(state, finished_at)`` (``finished_at IS NOT NULL``) and ``(state, lease_expires_at)``
  (``state = 'RUNNING'``), compared with ``no_events`` (which writes into the real, older
  table: part of a difference may be the fresh copy's). The first two spare both of a
  claimed-then-succeeded row's entries, the last two one each (the insert's or the update's);
* ``floor``: ``bench/benchapp/bodies.py``'s ``two_commits``, a one-row insert and an update by
  key into a three-column table, the floor variant's two commits in ``bench/run.py``.

Reported per task: the median and minimum wall time of the blocks, and the medians of this
process's CPU and of its PostgreSQL backend's CPU (``/proc``). Nothing else should run: the
wall times are round trips and WAL flushes. The copy of the table is dropped at the end.
Uses ``bench/settings.py``'s database (created and migrated here, as ``bench/run.py`` does).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

#: The copy of the execution table the ``two_indexes`` variant writes into.
LEAN_TABLE = "bench_statements_execution"
#: The copy the ``partial_indexes`` variant writes into.
PARTIAL_TABLE = "bench_statements_partial"
VARIANTS = ("separate", "carried", "no_events", "two_indexes", "partial_indexes", "floor")
#: ``partial_indexes``' table's indexes beyond its primary key and key: the real table's, with
#: the four a claimed-then-succeeded row passes through made partial.
PARTIAL_INDEXES = (
    "(idempotency_key varchar_pattern_ops)",
    "(job_id) WHERE job_id IS NOT NULL",
    "(created_at)",
    "(state, due_at) WHERE due_at IS NOT NULL",
    "(state, finished_at) WHERE finished_at IS NOT NULL",
    "(state, lease_expires_at) WHERE state = 'RUNNING'",
    "(trigger, id)",
    "(job_id, id) WHERE state = 'WAITING'",
    "(waiting_on_limit, id) WHERE state = 'WAITING'",
    "(task_name, id) WHERE state = 'WAITING'",
)


def _without_events(sql: str) -> str:
    """One of ``core/_pg.py``'s hot statements with its event CTEs (``ev``, ``s_ev``) emptied:
    each becomes a ``SELECT`` of its parameters, which nothing reads, so the statement binds
    the same parameters in the same order and inserts no event."""

    def emptied(match: re.Match[str]) -> str:
        params = re.findall(r"%(?:\(\w+\))?s(?:::\w+)?", match.group(2))
        return f"), {match.group(1)} AS (SELECT {', '.join(params) or '1'})"

    lean = re.sub(r"\),\s*((?:s_)?ev) AS \((.*?FROM [su])\s*\)", emptied, sql, flags=re.S)
    assert "INSERT INTO" not in lean.replace("INSERT INTO " + '"taskplatform_execution"', ""), lean
    return lean


@contextmanager
def _statements(variant: str) -> Iterator[None]:
    """The ledger's hot statements replaced, for the time of a block, by ``variant``'s forms."""
    from django.db import connection

    from taskplatform.core import _pg

    original = _pg._create_claimed_sql
    claim = {carrying: original(carrying) for carrying in (False, True)}
    succeed_sql = _pg._succeed_sql()
    if variant in ("no_events", "two_indexes", "partial_indexes"):
        claim = {c: (_without_events(sql), fields, order) for c, (sql, fields, order) in claim.items()}
        succeed_sql = _without_events(succeed_sql)
    copy = {"two_indexes": LEAN_TABLE, "partial_indexes": PARTIAL_TABLE}.get(variant)
    if copy:
        table = connection.ops.quote_name("taskplatform_execution")
        claim = {c: (sql.replace(table, copy), fields, order) for c, (sql, fields, order) in claim.items()}
        succeed_sql = succeed_sql.replace(table, copy)
    saved = _pg._create_claimed_sql, _pg._succeed_sql
    _pg._create_claimed_sql = lambda carrying: claim[carrying]  # type: ignore[assignment]
    _pg._succeed_sql = lambda: succeed_sql  # type: ignore[assignment]
    try:
        yield
    finally:
        _pg._create_claimed_sql, _pg._succeed_sql = saved  # type: ignore[assignment]


WORKER = "bench@host:1:statements"


def _create_claimed(i: int, carried: object = None) -> object:
    from django.utils import timezone

    from taskplatform.core import ledger
    from taskplatform.core.types import NewExecution

    spec = NewExecution(
        idempotency_key=f"bench-statements:{uuid.uuid4().hex}", task_name="bench.noop", args=[i], kwargs={}
    )
    claim = ledger.create_claimed(
        spec,
        worker=WORKER,
        celery_task_id=uuid.uuid4().hex,
        lease_seconds=300,
        started_at=timezone.now(),
        carried=carried,  # type: ignore[arg-type]
    )
    assert claim is not None
    return claim


def _separate(i: int) -> None:
    from taskplatform.core import ledger

    claim = _create_claimed(i)
    ledger.succeed(claim.execution, claim.token, None, worker=WORKER, data={"duration_ms": 0.0})  # type: ignore[attr-defined]


class _Carried:
    """Each claim carries the success of the one before (the last success of a block is
    written alone, outside the measured loop's count: one statement in ``per_block``)."""

    def __init__(self) -> None:
        self.previous: object = None

    def __call__(self, i: int) -> None:
        from django.utils import timezone

        from taskplatform.core.types import FinishedAttempt

        claim = _create_claimed(i, self.previous)
        if self.previous is not None:
            assert self.previous.written, "the carried success was refused"  # type: ignore[attr-defined]
        execution = claim.execution  # type: ignore[attr-defined]
        self.previous = FinishedAttempt(execution.pk, claim.token, None, WORKER, {"duration_ms": 0.0}, timezone.now())  # type: ignore[attr-defined]


def _backend_cpu(pid: int) -> float:
    """Seconds of CPU the PostgreSQL backend ``pid`` has used (``bench/run.py``'s reading of ``/proc``)."""
    from bench.run import _proc_stat

    stat = _proc_stat(pid)
    assert stat is not None, f"PostgreSQL backend {pid} is gone"
    return stat[2] / os.sysconf("SC_CLK_TCK")


def block(variant: str, n: int, backend: int) -> tuple[float, float, float]:
    """``n`` tasks of ``variant``: wall, client CPU and server CPU per task, in µs."""
    from bench.benchapp.bodies import two_commits

    run: Callable[[int], None] = {"floor": two_commits, "separate": _separate}.get(variant) or _Carried()
    with _statements(variant):
        wall, client, server = time.perf_counter(), time.process_time(), _backend_cpu(backend)
        for i in range(n):
            run(i)
        wall, client = time.perf_counter() - wall, time.process_time() - client
        server = _backend_cpu(backend) - server
    return wall / n * 1e6, client / n * 1e6, server / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8, help="blocks of each variant, alternating")
    parser.add_argument("--per-block", type=int, default=1000, help="tasks a block")
    args = parser.parse_args()

    from bench.run import ensure_database

    ensure_database()
    import django

    django.setup()
    from django.db import connection

    with connection.cursor() as cur:
        for copy in (LEAN_TABLE, PARTIAL_TABLE):
            cur.execute(f"DROP TABLE IF EXISTS {copy}")
            cur.execute(
                f"CREATE TABLE {copy} (LIKE taskplatform_execution INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                f"INCLUDING IDENTITY)"
            )
            cur.execute(f"ALTER TABLE {copy} ADD PRIMARY KEY (id), ADD UNIQUE (idempotency_key)")
        for index in PARTIAL_INDEXES:
            cur.execute(f"CREATE INDEX ON {PARTIAL_TABLE} {index}")
        cur.execute("SELECT pg_backend_pid()")
        (backend,) = cur.fetchone()
    results: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    try:
        for variant in VARIANTS:  # warm: connections, prepared statements, caches
            block(variant, 200, backend)
        for b in range(args.blocks):
            for variant in VARIANTS if b % 2 == 0 else VARIANTS[::-1]:
                results[variant].append(block(variant, args.per_block, backend))
    finally:
        with connection.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS {LEAN_TABLE}, {PARTIAL_TABLE}")
            tables = "taskplatform_executionevent, taskplatform_execution, benchapp_benchfloor"
            cur.execute(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
    print(f"{args.blocks} alternating blocks of {args.per_block} tasks (created claimed, succeeded), µs a task")
    print(f"{'variant':<16}{'wall median':>12}{'wall min':>10}{'client CPU':>12}{'server CPU':>12}")
    for variant, rows in results.items():
        wall = [r[0] for r in rows]
        print(
            f"{variant:<16}{statistics.median(wall):>12.0f}{min(wall):>10.0f}"
            f"{statistics.median(r[1] for r in rows):>12.0f}{statistics.median(r[2] for r in rows):>12.0f}"
        )


if __name__ == "__main__":
    main()
