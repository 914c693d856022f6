"""End-to-end throughput of a no-op task, four ways, on the same worker settings, in one run.

    .venv/bin/python bench/run.py [--tasks 20000] [--repeat 1] [--variants plain,dcr,once,ledger]

Every variant runs one real ``celery worker`` (Redis broker, prefork, concurrency 2,
``acks_late``, prefetch 1, connection reuse on). Two figures per variant:

* end to end: this process publishes the tasks while the worker consumes; the clock runs
  from the first publication until the broker holds no queued or unacknowledged message;
* drain: the queue is filled first, then the worker starts consuming; worker-side cost only.

Also reported: the ratio to plain Celery, the publish rate, the PostgreSQL transactions
per task (``pg_stat_database``, end-to-end run) and the SQL statements per task (counted
in-process on the same code path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

VARIANTS = {
    "plain": "plain Celery (no result backend)",
    "dcr": "Celery + django-celery-results (PostgreSQL)",
    "dcr_default": "Celery + django-celery-results, out of the box (no CELERY_DB_REUSE_MAX)",
    "once": "Celery + celery-once (Redis lock)",
    "ledger": "taskplatform IdempotentTask + submit() (PostgreSQL ledger)",
}


def ensure_database() -> None:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'taskplatform_bench'").fetchone():
            conn.execute("CREATE DATABASE taskplatform_bench")
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
        cwd=ROOT,
        check=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings"},
    )


def reset_state() -> None:
    import redis
    from django.conf import settings
    from django.db import connection

    redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()
    redis.Redis.from_url(settings.BENCH_ONCE_REDIS_URL).flushdb()
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE taskplatform_executionevent, taskplatform_execution, django_celery_results_taskresult "
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
    name = f"bench-{variant}@%h"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "config", "worker", "-P", "prefork", "-c", "2",
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


def _broker() -> Any:
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def queue_length() -> int:
    return int(_broker().llen("bench"))


def drained() -> bool:
    r = _broker()
    return r.llen("bench") == 0 and r.hlen("unacked") == 0


def publisher(variant: str) -> Any:
    from bench.benchapp import tasks as t
    from taskplatform import submit

    if variant == "ledger":
        return lambda i: submit(t.ledger_noop, [i])
    task = {"plain": t.plain_noop, "dcr": t.dcr_noop, "dcr_default": t.dcr_noop, "once": t.once_noop}[variant]
    return task.delay


def verify(variant: str, n: int) -> str:
    from django_celery_results.models import TaskResult

    from taskplatform.models import Execution

    if variant == "ledger":
        done = Execution.objects.filter(state="SUCCEEDED").count()
        return f"{done}/{n} executions SUCCEEDED"
    if variant.startswith("dcr"):
        return f"{TaskResult.objects.filter(status='SUCCESS').count()}/{n} results stored"
    return "broker drained"


def run_variant(variant: str, n: int) -> dict[str, Any]:
    """End to end (publishing while the worker consumes), then drain-only (queue prefilled)."""
    from celery import current_app

    reset_state()
    worker, name = start_worker(variant)
    try:
        publish = publisher(variant)
        publish(-1)  # warm-up: imports, connections
        wait_drained(60)
        reset_state()
        tx_before = pg_transactions()
        cpu_before = cpu_snapshot(worker.pid)
        start = time.perf_counter()
        for i in range(n):
            publish(i)
        published = time.perf_counter()
        wait_drained(600)
        end = time.perf_counter()
        cpu = cpu_per_task(cpu_before, cpu_snapshot(worker.pid), n)
        time.sleep(1.2)  # let PostgreSQL flush its statistics
        tx = pg_transactions() - tx_before - 2
        check = verify(variant, n)

        # Drain-only: the worker stops consuming, the queue is filled, then consumption resumes.
        reset_state()
        current_app.control.cancel_consumer("bench", destination=[name], reply=True, timeout=5)
        for i in range(n):
            publish(i)
        queued = queue_length()
        if queued != n:
            raise RuntimeError(f"drain run invalid: {queued} of {n} messages queued before consuming resumed")
        drain_start = time.perf_counter()
        current_app.control.add_consumer("bench", destination=[name], reply=True, timeout=5)
        wait_drained(600)
        drain_end = time.perf_counter()
    finally:
        stop_worker(worker)
    return {
        "variant": variant,
        "tasks": n,
        "seconds": round(end - start, 3),
        "tasks_per_second": round(n / (end - start), 1),
        "publish_per_second": round(n / (published - start), 1),
        "drain_per_second": round(n / (drain_end - drain_start), 1),
        "pg_transactions_per_task": round(tx / n, 2),
        "cpu_us_per_task": cpu,
        "check": check,
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


def cpu_snapshot(worker_pid: int) -> dict[str, dict[int, int]]:
    """CPU ticks per live process, grouped: this process (the producer), the worker (main and
    pool processes), PostgreSQL (every server process) and Redis."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            stats[int(entry)] = stat
    worker = {worker_pid} | {pid for pid, (_, ppid, _) in stats.items() if ppid == worker_pid}
    groups: dict[str, dict[int, int]] = {"producer": {}, "worker": {}, "postgres": {}, "redis": {}}
    for pid, (name, _, ticks) in stats.items():
        if pid == os.getpid():
            groups["producer"][pid] = ticks
        elif pid in worker:
            groups["worker"][pid] = ticks
        elif name == "postgres":
            groups["postgres"][pid] = ticks
        elif name == "redis-server":
            groups["redis"][pid] = ticks
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
    reset_state()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per variant (interleaved); the median is kept")
    parser.add_argument("--variants", default="plain,dcr,once,ledger")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    ensure_database()
    import django

    django.setup()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_no in range(args.repeat):
        for variant in variants:
            result = run_variant(variant, args.tasks)
            runs[variant].append(result)
            print(f"round {round_no + 1}: {json.dumps(result)}", flush=True)

    metrics = ("tasks_per_second", "drain_per_second", "publish_per_second", "pg_transactions_per_task")
    best = {v: {**rs[-1], **{m: statistics.median(r[m] for r in rs) for m in metrics}} for v, rs in runs.items()}
    base = best.get("plain", {}).get("tasks_per_second")
    statements = statements_per_execution()

    print()
    print(
        f"{args.tasks} no-op tasks per run, medians of {args.repeat}; Redis broker, prefork -c 2, acks_late, prefetch 1"
    )
    drain_base = best.get("plain", {}).get("drain_per_second")
    print(f"{'variant':<64} {'e2e/s':>7} {'vs plain':>8} {'drain/s':>8} {'vs plain':>8} {'publish/s':>9} {'PG tx':>6}")
    for v in variants:
        r = best[v]
        ratio = f"{r['tasks_per_second'] / base:.2f}" if base else "-"
        drain_ratio = f"{r['drain_per_second'] / drain_base:.2f}" if drain_base else "-"
        spread = ", ".join(str(x["tasks_per_second"]) for x in runs[v])
        print(
            f"{VARIANTS[v]:<64} {r['tasks_per_second']:>7} {ratio:>8} {r['drain_per_second']:>8} {drain_ratio:>8} "
            f"{r['publish_per_second']:>9} {r['pg_transactions_per_task']:>6}   e2e runs [{spread}]; {r['check']}"
        )
    print()
    print("SQL statements per execution (in-process count):", json.dumps(statements))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "median": best, "statements": statements}, indent=2))


if __name__ == "__main__":
    main()
