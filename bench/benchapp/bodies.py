"""The bodies a benchmark task can run, one function each, shared by every variant.

``bench/run.py --body NAME`` picks one; every variant registers one task per body (the task
name carries the body, ``bench.<variant>_<body>``), so a worker can only run the body the
producer named in the message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: Length of the ``cpu1ms`` busy loop and of the ``io10ms`` sleep (seconds).
CPU_SECONDS = 0.001
IO_SECONDS = 0.01


def noop(i: int) -> int:
    """Nothing: what is measured is the queue's own cost per task."""
    return i


def cpu1ms(i: int) -> int:
    """1 ms of pure-Python CPU (a busy loop, so it holds the GIL like real work would)."""
    end = time.perf_counter() + CPU_SECONDS
    while time.perf_counter() < end:
        pass
    return i


def io10ms(i: int) -> int:
    """10 ms waiting, as for a call to another service: the worker's concurrency is what counts."""
    time.sleep(IO_SECONDS)
    return i


def write(i: int) -> int:
    """One row into a table with no unique constraint: a second run of the same task would
    show as a second row, so ``rows == tasks`` checks effectively-once execution."""
    from bench.benchapp.models import BenchEffect

    BenchEffect.objects.create(i=i)
    return i


def two_commits(i: int) -> None:
    """Two durable commits, each one prepared single-row statement on Django's connection in
    autocommit (an insert, then an update of that row by key): the least a task can spend on
    recording a start and an end in PostgreSQL. The ``floor`` variant runs it after each body,
    so its ratio bounds any design that commits twice a task (see docs/benchmarks.md)."""
    set_state(insert_row(i, "RUNNING"), "SUCCEEDED")


@contextmanager
def _prepared_cursor() -> Iterator[Any]:
    """A psycopg cursor on Django's connection whose statements may be prepared (Django opens
    connections with ``prepare_threshold = None``, which ignores ``prepare=True``); the
    connection's threshold is given back afterwards, so the other variants this process runs
    (the producer's) are not charged psycopg's bookkeeping of every statement."""
    from django.db import connection

    connection.ensure_connection()
    conn = connection.connection
    previous = conn.prepare_threshold
    conn.prepare_threshold = 1_000_000
    try:
        with conn.cursor() as cur:
            yield cur
    finally:
        conn.prepare_threshold = previous


def insert_row(i: int, state: str) -> int:
    """One durable commit of a one-row insert into the floor variants' table; its id.
    ``floor_submit``'s producer commits its row (state PENDING) this way before it publishes,
    as ``submit()`` commits its row."""
    with _prepared_cursor() as cur:
        cur.execute(
            "INSERT INTO benchapp_benchfloor (i, state, created_at) VALUES (%s, %s, now()) RETURNING id",
            (i, state),
            prepare=True,
        )
        (row_id,) = cur.fetchone()
    return int(row_id)


def set_state(row_id: int, state: str) -> None:
    """One durable commit of a one-row update by key (the worker's claim and success in the
    ``floor_submit`` variant)."""
    with _prepared_cursor() as cur:
        cur.execute("UPDATE benchapp_benchfloor SET state = %s WHERE id = %s", (state, row_id), prepare=True)


BODIES: dict[str, Callable[[int], int]] = {"noop": noop, "cpu1ms": cpu1ms, "io10ms": io10ms, "write": write}

#: Bodies that write to the database: the ledger variants run these with ``atomic = True``
#: (the row and the success mark in one transaction), which is how a platform user would.
ATOMIC_BODIES = frozenset({"write"})
