"""The console and /metrics at a million executions: p50/p95 of each page, in PostgreSQL.

    .venv/bin/python bench/console.py [--executions 1000000] [--events-per 5] [--requests 20]
                                      [--writers N] [--prune-seconds S]

Fills a database of its own (``taskplatform_console``; kept between runs when it already
holds the asked volume) with executions in every state over 30 days, 100 job definitions and
``--events-per`` events an execution, then requests each page ``--requests`` times through
Django's test client, logged in as a superuser (``/metrics`` with its bearer token), and
reports p50 and p95 in milliseconds. The issue's target: every page under 300 ms at p95.
``--writers N``: meanwhile N processes write to the ledger as workers do (create, claim,
succeed), flat out. ``--prune-seconds S``: then ``ledger.prune`` for S seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/taskplatform_console")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
os.environ.setdefault("TASKPLATFORM_METRICS_TOKEN", "bench-console-token")

#: States and their share of the rows (per 1,000): mostly finished work, a realistic backlog.
MIX = (("SUCCEEDED", 900), ("FAILED", 30), ("CANCELLED", 20), ("PENDING", 20), ("RETRYING", 20), ("RUNNING", 10))
JOBS = 100
DAYS = 30


def ensure_database() -> None:
    import psycopg
    from django.conf import settings
    from psycopg import sql

    db = settings.DATABASES["default"]
    with psycopg.connect(dbname="postgres", host=db["HOST"], user=db["USER"], autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]]).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db["NAME"])))
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, check=True)


def fill(executions: int, events_per: int) -> None:
    """``executions`` rows in the mix above, created over the last 30 days, and their events."""
    from django.db import connection

    from taskplatform.models import Execution, JobDefinition

    if Execution.objects.count() >= executions:
        print(f"keeping the {Execution.objects.count():,} executions already there")
        return
    started = time.monotonic()
    with connection.cursor() as cur:
        cur.execute("TRUNCATE taskplatform_executionevent, taskplatform_execution RESTART IDENTITY CASCADE")
        JobDefinition.objects.all().delete()
        JobDefinition.objects.bulk_create(
            JobDefinition(slug=f"job-{i:03d}", task="tasks.ping", description="console bench") for i in range(JOBS)
        )
        first_job = JobDefinition.objects.order_by("id").values_list("id", flat=True).first()
        cases = []
        bound = 0
        for state, share in MIX:
            bound += share
            cases.append(f"WHEN g %% 1000 < {bound} THEN '{state}'")
        state = f"(CASE {' '.join(cases)} END)"
        cur.execute(
            f"""
            INSERT INTO taskplatform_execution (
                idempotency_key, task_name, args, kwargs, queue, priority, trigger, state, attempts,
                fencing_token, lease_expires_at, worker, celery_task_id, scheduled_for, due_at, publish_count,
                created_at, updated_at, started_at, finished_at, result, last_error, last_traceback, job_id,
                max_attempts, trace_context)
            SELECT 'console:' || g, 'tasks.ping', '[]', '{{}}', '', NULL,
                   (ARRAY['api', 'beat', 'celery', 'view'])[g %% 4 + 1], s.state, 1 + (g %% 3), 1 + (g %% 3),
                   CASE WHEN s.state = 'RUNNING'
                        THEN now() + (CASE WHEN g %% 2 = 0 THEN 60 ELSE -60 END) * interval '1 second' END,
                   'vm:' || (g %% 50), md5(g::text), NULL,
                   CASE WHEN s.state IN ('PENDING', 'RETRYING') THEN now() + ((g %% 7) - 3) * interval '1 minute' END,
                   1, c.created, c.created, c.created + interval '1 second',
                   CASE WHEN s.state IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN c.created + interval '2 seconds' END,
                   CASE WHEN s.state = 'SUCCEEDED' THEN '{{"ok": true}}'::jsonb END,
                   CASE WHEN s.state = 'FAILED' THEN 'tasks.TransientError: boom' ELSE '' END,
                   CASE WHEN s.state = 'FAILED' THEN 'Traceback (most recent call last): ...' ELSE '' END,
                   CASE WHEN g %% 3 = 0 THEN NULL ELSE {first_job} + (g %% {JOBS}) END, NULL, ''
            FROM generate_series(1, %s) AS g,
                 LATERAL (SELECT {state} AS state) AS s,
                 LATERAL (SELECT now() - ({DAYS} * 86400.0 * (%s - g) / %s) * interval '1 second' AS created) AS c
            """,
            [executions, executions, executions],
        )
        cur.execute(
            """
            INSERT INTO taskplatform_executionevent (
                execution_id, at, kind, from_state, to_state, attempt, fencing_token, actor, reason, data)
            SELECT e.id, e.created_at + k * interval '1 second',
                   (ARRAY['claimed', 'retry_scheduled', 'claimed', 'retry_scheduled', 'succeeded'])[k %% 5 + 1],
                   'PENDING', 'RUNNING', 1 + k / 2, 1 + k / 2, e.worker, '', '{}'
            FROM taskplatform_execution AS e, generate_series(0, %s - 1) AS k
            """,
            [events_per],
        )
        cur.execute("ANALYZE taskplatform_execution")
        cur.execute("ANALYZE taskplatform_executionevent")
    seconds = time.monotonic() - started
    print(f"filled {executions:,} executions and {executions * events_per:,} events in {seconds:.0f} s")


def created_since(days: int | None = None, month: bool = False) -> str:
    """A query of the admin's created filter (``DateFieldListFilter``): since the start of today,
    of the past ``days`` days, or of this month, up to the start of tomorrow (UTC; Django's own
    links use the site's zone and end this month's at the next month's first day: the same rows
    here)."""
    from datetime import UTC, datetime, timedelta
    from urllib.parse import urlencode

    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    since = today.replace(day=1) if month else today - timedelta(days=days or 0)
    return urlencode({"created_at__gte": str(since), "created_at__lt": str(today + timedelta(days=1))})


def pages() -> list[tuple[str, str]]:
    """The console's pages the issue names: the landing page, the executions list under each of
    its filters (every value of each), an execution's page, ``/metrics``; and the list's last
    pages and its other ordering."""
    from taskplatform.models import Execution, JobDefinition, State, Trigger

    one = Execution.objects.filter(state="FAILED").order_by("-id").values_list("id", flat=True).first()
    job = JobDefinition.objects.order_by("id").values_list("id", flat=True).first()
    base = "/admin/taskplatform/execution/"
    return [
        ("admin landing page (overview)", "/admin/"),
        ("executions list", base),
        ("executions: page 500", f"{base}?p=500"),
        ("executions: oldest first", f"{base}?o=1"),  # column 1: the id (0 is the actions' checkbox)
        ("executions: dead letters", f"{base}?dead_letter=yes"),
        ("executions: stuck", f"{base}?stuck=yes"),
        *((f"executions: state {state}", f"{base}?state__exact={state}") for state in State.values),
        *((f"executions: trigger {trigger}", f"{base}?trigger__exact={trigger}") for trigger in Trigger.values),
        ("executions: one job", f"{base}?job__id__exact={job}"),
        ("executions: created today", f"{base}?{created_since(0)}"),
        ("executions: created, past 7 days", f"{base}?{created_since(7)}"),
        ("executions: created this month", f"{base}?{created_since(month=True)}"),
        ("executions: search a key", f"{base}?q=console:999999"),
        ("an execution's page", f"{base}{one}/change/"),
        ("/metrics", "/metrics"),
    ]


def measure(requests: int) -> list[tuple[str, float, float, int]]:
    from django.contrib.auth.models import User
    from django.test import Client

    admin, _ = User.objects.get_or_create(username="console-bench", defaults={"is_staff": True, "is_superuser": True})
    client = Client()
    client.force_login(admin)
    token = os.environ["TASKPLATFORM_METRICS_TOKEN"]
    # The maintenance holder's count (every TASKPLATFORM_COUNTS_INTERVAL_SECONDS), as it would
    # run beside the console: taken here between pages when due, timed on its own.
    from taskplatform.conf import platform_settings
    from taskplatform.models import CountsSnapshot

    interval = platform_settings().counts_interval_seconds
    counted: list[float] = []
    taken_at = float("-inf")

    def maintain() -> None:
        nonlocal taken_at
        if time.monotonic() - taken_at >= interval:
            start = time.perf_counter()
            CountsSnapshot.take()
            counted.append((time.perf_counter() - start) * 1000)
            taken_at = time.monotonic()

    results = []
    for label, url in pages():
        maintain()
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if url == "/metrics" else {}
        client.get(url, **headers)  # warm: templates, the plan cache
        timings = []
        status = 0
        for _ in range(requests):
            start = time.perf_counter()
            response = client.get(url, **headers)
            timings.append((time.perf_counter() - start) * 1000)
            status = response.status_code
        timings.sort()
        p95 = timings[max(0, round(0.95 * len(timings)) - 1)]
        results.append((label, statistics.median(timings), p95, status))
        maintain()
        print(f"{label:<34} p50 {statistics.median(timings):8.1f} ms   p95 {p95:8.1f} ms   HTTP {status}", flush=True)
    median = statistics.median(counted)
    print(f"the maintenance holder's count, every {interval} s: {median:.0f} ms (median of {len(counted)})")
    return results


def write_loop(stop_file: Path) -> None:
    """A worker's writes to the ledger, as fast as one process makes them, until ``stop_file``
    exists: an execution created, claimed and succeeded (three commits, a row and its events),
    then its count printed (``--writers``: the pages measured while the ledger is written)."""
    import uuid

    from taskplatform.core import ledger

    done = 0
    started = time.monotonic()
    prefix = uuid.uuid4().hex[:8]
    while not stop_file.exists():
        execution, _ = ledger.create(
            ledger.NewExecution(idempotency_key=f"writer:{prefix}:{done}", task_name="tasks.ping", args=[], kwargs={})
        )
        claim = ledger.claim(execution, worker="bench:1", celery_task_id="m", lease_seconds=60, max_attempts=3)
        ledger.succeed(claim.execution, claim.token, None, worker="bench:1", data={})
        done += 1
    print(f"{done} {time.monotonic() - started:.3f}", flush=True)


def writers_running(n: int) -> tuple[list[subprocess.Popen[str]], Path]:
    stop_file = Path(f"/tmp/console-bench-stop-{os.getpid()}")
    stop_file.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--write-loop", str(stop_file)]
    procs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    return procs, stop_file


def writers_stopped(procs: list[subprocess.Popen[str]], stop_file: Path) -> float:
    """Stop the writers; the executions they completed a second, together."""
    stop_file.touch()
    rate = 0.0
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        done, seconds = out.split()
        rate += int(done) / float(seconds)
    stop_file.unlink(missing_ok=True)
    return rate


def prune_rate(seconds: float) -> tuple[float, float]:
    """Pruning at this volume: ``ledger.prune`` batch after batch, as the maintenance holder
    runs it, for ``seconds`` (the oldest third of the rows are past the cutoff); executions and
    events deleted a second. Deletes rows: the next run fills the database again."""
    from datetime import timedelta

    from django.utils import timezone

    from taskplatform.core import ledger
    from taskplatform.models import ExecutionEvent

    cutoff = timezone.now() - timedelta(days=DAYS * 2 // 3)
    events_before = ExecutionEvent.objects.count()
    pruned = batches = 0
    started = time.perf_counter()
    took: list[float] = []
    while time.perf_counter() - started < seconds:
        t = time.perf_counter()
        n = ledger.prune(cutoff)
        took.append((time.perf_counter() - t) * 1000)
        pruned += n
        batches += 1
        if n == 0:
            break
    elapsed = time.perf_counter() - started
    events = events_before - ExecutionEvent.objects.count()
    took.sort()
    print(
        f"pruning: {pruned:,} executions and {events:,} events in {elapsed:.1f} s "
        f"({pruned / elapsed:,.0f} executions/s); {batches} batches, p50 {statistics.median(took):.0f} ms, "
        f"max {took[-1]:.0f} ms a batch"
    )
    return pruned / elapsed, events / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executions", type=int, default=1_000_000)
    parser.add_argument("--events-per", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--prune-seconds", type=float, default=0, help="then measure pruning for this long (deletes rows)"
    )
    parser.add_argument(
        "--writers", type=int, default=0, help="processes writing to the ledger while the pages are measured"
    )
    parser.add_argument("--write-loop", type=Path, help=argparse.SUPPRESS)  # a writer's own process
    options = parser.parse_args()
    import django

    django.setup()
    if options.write_loop:
        write_loop(options.write_loop)
        return
    from django.conf import settings

    settings.ALLOWED_HOSTS = ["testserver"]
    ensure_database()
    fill(options.executions, options.events_per)
    procs, stop_file = writers_running(options.writers)
    try:
        results = measure(options.requests)
    finally:
        if procs:
            rate = writers_stopped(procs, stop_file)
            print(f"meanwhile {len(procs)} writers completed {rate:,.0f} executions a second (3 commits each)")
    over = [label for label, _p50, p95, _s in results if p95 >= 300]
    summary = f"{len(results) - len(over)} of {len(results)} pages under 300 ms at p95"
    print(f"\n{summary}; over: {over}" if over else f"\n{summary}")
    failed = [(label, status) for label, _p50, _p95, status in results if status != 200]
    if failed:  # a redirect or an error page is fast and proves nothing
        raise SystemExit(f"pages that did not answer 200: {failed}")
    if options.prune_seconds:
        prune_rate(options.prune_seconds)


if __name__ == "__main__":
    main()
