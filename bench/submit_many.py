"""Submission rate from one process into the ledger and the Redis broker, and into a peer's queue, one run.

    .venv/bin/python bench/submit_many.py [--n 10000] [--loop-n N] [--rounds 3]
        [--variants many,loop,celery,procrastinate]

* ``many``: ``taskplatform.submit_many()`` of N no-op executions in one call (multi-row
  ``INSERT … ON CONFLICT DO NOTHING`` statements, then one kombu publish batch after commit);
* ``loop``: a loop of ``taskplatform.submit()``, one execution per call (autocommit);
* ``celery``: a loop of plain Celery ``apply_async()`` of a no-op task (no ledger at all);
* ``procrastinate``: Procrastinate's ``batch_defer()`` of N no-op jobs in one call (the bench
  app's job, through its Django contrib app, on the same database): one
  ``procrastinate_defer_jobs_v1`` statement, committed on return (autocommit). Its jobs sit in
  PostgreSQL, which is its queue: the peer's equivalent of "in the broker".

For the Celery-backed variants the clock runs from the first call until the last of the N
messages is in the broker's list (checked with ``LLEN``); no worker runs, so nothing is
consumed meanwhile. For ``procrastinate`` it runs from the call until it returns; the jobs
are then counted (``todo`` on queue ``bench``), off the clock. ``--loop-n`` runs the two
loops on fewer executions (a rate per second either way) to keep a run short. The queue, the
ledger tables and Procrastinate's tables are emptied before every run; every variant is
warmed up once on a few executions first. Rounds are interleaved (many, loop, celery,
procrastinate, many, …) and the median of the rounds is printed, with the ``many`` run split
into its ledger part (the rows inserted) and its broker part (commit and publication), and
the ratio of ``many`` to ``procrastinate`` (both one call for N).

It uses the benchmark settings (``bench/settings.py``: ``DATABASE_URL`` and
``CELERY_BROKER_URL`` from the environment, the ``bench`` queue, sent-events off); the
database must be migrated (``manage.py migrate`` with ``DJANGO_SETTINGS_MODULE=bench.settings``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

QUEUE = "bench"
#: The variants that submit all N in one call; the others loop, over ``--loop-n`` if given.
ONE_CALL = ("many", "procrastinate")


def reset() -> None:
    """Empty the broker's queue, the ledger and Procrastinate's jobs.

    Not ``bench/run.py``'s ``reset_state()``: that one flushes whole Redis databases, the
    once-lock's among them (``BENCH_ONCE_REDIS_URL``), which this script never uses.
    """
    import redis
    from django.conf import settings
    from django.db import connection

    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(QUEUE)
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE taskplatform_executionevent, taskplatform_execution, procrastinate_events, procrastinate_jobs "
            "RESTART IDENTITY CASCADE"
        )


def procrastinate_queued() -> int:
    """Jobs waiting on the bench app's Procrastinate queue (what ``batch_defer`` inserted)."""
    from django.db import connection

    from bench.benchapp.jobs import QUEUE as JOB_QUEUE

    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo' AND queue_name = %s", [JOB_QUEUE])
        return int(cur.fetchone()[0])


def wait_queued(n: int, timeout: float = 120) -> None:
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    deadline = time.monotonic() + timeout
    while client.llen(QUEUE) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {client.llen(QUEUE)} of {n} messages reached the broker")
        time.sleep(0.001)


def run(variant: str, n: int) -> dict[str, float]:
    from django.db import transaction

    from bench.benchapp import tasks as t
    from bench.benchapp.jobs import JOBS
    from taskplatform import submit, submit_many

    reset()
    figures: dict[str, float] = {}
    cpu = time.process_time()
    start = time.perf_counter()
    if variant == "many":
        with transaction.atomic():
            result = submit_many(t.ledger_noop, [{"args": [i]} for i in range(n)])
            figures["ledger_s"] = time.perf_counter() - start
        assert result.created_count == n
    elif variant == "loop":
        for i in range(n):
            submit(t.ledger_noop, [i])
    elif variant == "celery":
        for i in range(n):
            t.plain_noop.apply_async((i,))
    elif variant == "procrastinate":
        ids = JOBS["noop"].batch_defer(*({"i": i} for i in range(n)))
        figures["total_s"] = time.perf_counter() - start
        figures["cpu_us"] = (time.process_time() - cpu) / n * 1e6
        queued = procrastinate_queued()
        if len(ids) != n or queued != n:
            raise RuntimeError(f"batch_defer of {n} jobs returned {len(ids)} ids, {queued} jobs queued")
    else:
        raise ValueError(variant)
    if variant != "procrastinate":
        wait_queued(n)
        figures["total_s"] = time.perf_counter() - start
        figures["cpu_us"] = (time.process_time() - cpu) / n * 1e6  # this process's CPU per execution
    figures["per_s"] = n / figures["total_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--loop-n", type=int, default=0, help="executions for the two loops (default: --n)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="many,loop,celery,procrastinate")
    options = parser.parse_args()

    import django

    django.setup()
    import config.celery_app  # noqa: F401  (the Celery app the deployment configures)

    variants = options.variants.split(",")
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for variant in variants:  # warm-up: connections, imports, task registry, each path's first call
        run(variant, min(options.n, 500))
    for _round in range(options.rounds):
        for variant in variants:
            runs[variant].append(run(variant, options.n if variant in ONE_CALL else options.loop_n or options.n))
    reset()

    labels = {
        "many": "submit_many() (one call)",
        "loop": "submit() loop",
        "celery": "Celery apply_async() loop (no ledger)",
        "procrastinate": "Procrastinate batch_defer() (one call)",
    }
    loop_n = options.loop_n or options.n
    print(f"N = {options.n} (loops: {loop_n}), {options.rounds} interleaved rounds, median (rounds)")
    for variant in variants:
        rates = [r["per_s"] for r in runs[variant]]
        cpu_us = statistics.median(r["cpu_us"] for r in runs[variant])
        line = (
            f"{labels[variant]:<40} {statistics.median(rates):>9,.0f} executions/s "
            f"({', '.join(f'{x:,.0f}' for x in rates)}); {cpu_us:.0f} µs of this process's CPU each"
        )
        if variant == "many":
            ledger = statistics.median(r["ledger_s"] for r in runs[variant])
            total = statistics.median(r["total_s"] for r in runs[variant])
            line += f"\n{'':<40} ledger {ledger:.2f} s, broker {total - ledger:.2f} s of {total:.2f} s"
        print(line)
    if "many" in runs and "procrastinate" in runs:
        many = statistics.median(r["per_s"] for r in runs["many"])
        peer = statistics.median(r["per_s"] for r in runs["procrastinate"])
        print(f"{'many / procrastinate':<40} {many / peer:>9.2f}x (medians)")
    load: Any = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
