"""Beat schedulers compared in one run: start-up, tick cost, lateness, failover.

    .venv/bin/python bench/beat.py [--jobs 1000,10000] [--seconds 30] [--failover-wait 60]

Schedulers: django-celery-beat's ``DatabaseScheduler`` (dcb), celery-redbeat's
``RedBeatScheduler`` (redbeat) and ``taskplatform.beat.LockedScheduler`` (locked).

1. **Load.** For each scheduler and job count N: N entries due every 60 s, spread evenly
   over the minute (N/60 publications per second are needed). The scheduler runs in this
   process, driven as ``celery beat`` drives it (``tick()``, then sleep the interval it
   returns), for ``--seconds``. Reported: start-up (construction and first tick; for ``locked``
   also the time to its first committed batch of slots, "1st pub"), CPU used
   per wall second, mean and p99 time of a tick, publications per second against the
   rate needed (counted on the broker), and for ``locked`` the publication lateness
   (ledger ``created_at - scheduled_for``, p50/p99).
2. **Failover.** Two real ``celery beat`` processes, one 1-second entry; SIGKILL the leader;
   the time until the survivor's first publication, and how many of the slots of the next
   ``--failover-wait`` seconds reached the broker. redbeat with its defaults and tuned
   (lock 10 s, loop 5 s, DESIGN.md §6), locked with its defaults. Also two dcb beats side
   by side (no lock): how many messages per slot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

SCHEDULERS = {
    "dcb": "django_celery_beat.schedulers:DatabaseScheduler",
    "redbeat": "redbeat.RedBeatScheduler",
    "locked": "taskplatform.beat.LockedScheduler",
}
QUEUE = "bench"


def broker() -> Any:
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def published() -> int:
    return int(broker().llen(QUEUE))


def reset() -> None:
    import redis
    from django.conf import settings
    from django.db import connection

    broker().flushdb()
    redis.Redis.from_url(settings.CELERY_REDBEAT_REDIS_URL).flushdb()
    _MADE.clear()  # the schedule rows ``schedule_of`` made are truncated below
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE taskplatform_executionevent, taskplatform_execution, taskplatform_jobdefinition, "
            "taskplatform_schedulecursor, taskplatform_schedulerfence, taskplatform_beatprocess, "
            "taskplatform_locklease, django_celery_beat_periodictask, django_celery_beat_intervalschedule, "
            "django_celery_beat_crontabschedule "
            "RESTART IDENTITY CASCADE"
        )


#: ``--mix``: the scale issue's schedule of 100,000 jobs: a tenth every minute, the rest every
#: 10 minutes, hourly, or daily crons spread over six IANA zones (LockedScheduler only).
MIX_ZONES = ("UTC", "Europe/Berlin", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "America/Sao_Paulo")


def schedule_of(i: int, n: int, interval: Any, mix: bool, made: dict[Any, Any] | None = None) -> dict[str, Any]:
    """Entry ``i``'s schedule: ``interval`` (every 60 s), or with ``mix`` the mixed schedule
    (``made`` keeps the schedule rows created so far)."""
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule

    if not mix or i % 10 == 0:
        return {"interval": interval}
    made = _MADE if made is None else made
    kind = i % 3
    if kind < 2:
        every = (600, 3600)[kind]
        if every not in made:
            made[every] = IntervalSchedule.objects.create(every=every, period=IntervalSchedule.SECONDS)
        return {"interval": made[every]}
    zone = MIX_ZONES[i % len(MIX_ZONES)]
    key = (zone, (i // 7) % 60, (i // 11) % 24)
    if key not in made:
        made[key] = CrontabSchedule.objects.create(minute=str(key[1]), hour=str(key[2]), timezone=zone)
    return {"crontab": made[key]}


_MADE: dict[Any, Any] = {}


def needed_per_second(n: int, mix: bool) -> float:
    """Publications a second the schedule asks for, on average (``schedule_of``'s periods)."""
    if not mix:
        return n / 60
    per_second = {0: 1 / 600, 1: 1 / 3600, 2: 1 / 86400}
    return sum(1 / 60 if i % 10 == 0 else per_second[i % 3] for i in range(n))


def populate(kind: str, n: int, every: int, mix: bool = False) -> None:
    """``n`` entries due every ``every`` seconds, spread evenly over one period (``mix``: the
    mixed schedule of ``schedule_of``)."""
    from celery import current_app
    from celery.schedules import schedule
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from taskplatform.models import JobDefinition

    now = datetime.now(UTC)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    offsets = [timedelta(seconds=every * i / n) for i in range(n)]
    if kind == "redbeat":
        from redbeat import RedBeatSchedulerEntry

        for i, offset in enumerate(offsets):
            RedBeatSchedulerEntry(
                f"e{i}", "bench.plain_noop", schedule(every), args=[i], app=current_app,
                last_run_at=now - offset,
            ).save()  # fmt: skip
        return
    interval = IntervalSchedule.objects.create(every=every, period=IntervalSchedule.SECONDS)
    if kind == "dcb":
        PeriodicTask.objects.bulk_create(
            PeriodicTask(
                name=f"e{i}", task="bench.plain_noop", args=json.dumps([i]), interval=interval,
                last_run_at=now - offset,
            )
            for i, offset in enumerate(offsets)
        )  # fmt: skip
        return
    jobs = JobDefinition.objects.bulk_create(
        JobDefinition(slug=f"j{i}", task="bench.ledger_noop", args=[i]) for i in range(n)
    )
    tasks = PeriodicTask.objects.bulk_create(
        PeriodicTask(
            name=f"job:j{i}", task="taskplatform.trigger_job", args=json.dumps([f"j{i}"]),
            start_time=epoch + offset, **schedule_of(i, n, interval, mix),
        )
        for i, offset in enumerate(offsets)
    )  # fmt: skip
    for job, task in zip(jobs, tasks, strict=True):
        job.periodic_task = task
    JobDefinition.objects.bulk_update(jobs, ["periodic_task"], batch_size=1000)


def settle() -> None:
    """Vacuum and analyse what ``populate`` wrote, as on a database that has lived with its
    schedule: otherwise autovacuum works through the fresh tables while the run is measured
    (the start-up of 100,000 entries varied from 4.5 to 6.4 s with it)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cur:
        for table in ("django_celery_beat_periodictask", "taskplatform_jobdefinition",
                      "django_celery_beat_crontabschedule", "django_celery_beat_intervalschedule"):  # fmt: skip
            cur.execute(f"VACUUM (ANALYZE) {table}")


def build(kind: str) -> Any:
    from celery import current_app
    from celery.utils.imports import symbol_by_name

    scheduler = symbol_by_name(SCHEDULERS[kind])(app=current_app)
    if kind == "redbeat":  # what celery beat's beat_init signal does: take redbeat's lock
        from redbeat.schedulers import acquire_distributed_beat_lock

        acquire_distributed_beat_lock(sender=SimpleNamespace(scheduler=scheduler))
    return scheduler


def lateness_of_ledger(since: datetime) -> dict[str, float]:
    """Publication lateness (``created_at - scheduled_for``) of the slots published from
    ``since`` on (the end of the start-up), as earlier runs reported it; and ``due_*``: of the
    slots due from ``since`` on. The two differ by the start-up's tail: slots due during the
    start-up's first tick that a later tick published."""
    from django.db import connection

    result: dict[str, float] = {}
    for prefix, column in (("", "created_at"), ("due_", "scheduled_for")):
        with connection.cursor() as cur:
            cur.execute(
                "SELECT EXTRACT(EPOCH FROM created_at - scheduled_for) FROM taskplatform_execution "
                f"WHERE {column} >= %s ORDER BY 1",
                [since],
            )
            values = [float(r[0]) for r in cur.fetchall()]
        if values:
            result[f"{prefix}lateness_p50_s"] = round(values[len(values) // 2], 3)
            result[f"{prefix}lateness_p99_s"] = round(values[min(len(values) - 1, int(len(values) * 0.99))], 3)
            result[f"{prefix}lateness_max_s"] = round(values[-1], 3)
    return result


def wait_for_boundary(through: float, lead: float = 25.0) -> datetime:
    """Sleep until ``lead`` seconds before the next multiple of ``through`` seconds (UTC) that
    is at least ``lead`` away, and return that boundary: a run started then spans it."""
    now = time.time()
    boundary = (now // through + 1) * through
    if boundary - now < lead:
        boundary += through
    time.sleep(max(0.0, boundary - lead - time.time()))
    return datetime.fromtimestamp(boundary, UTC)


#: ``--start``: how the measured LockedScheduler starts. ``cold``: a first start on a schedule no
#: leader ran (no cursor); ``restart``: another leader ran first until every cursor was written,
#: then stopped cleanly; ``last-run``: a site switching from django-celery-beat's
#: ``DatabaseScheduler``, every entry with a ``last_run_at`` 30 s back and no cursor.
STARTS = ("cold", "restart", "last-run")


def prepare_start(start: str) -> None:
    """Bring the schedule ``populate`` wrote to the state ``start`` names (``STARTS``)."""
    from django_celery_beat.models import PeriodicTask

    from taskplatform.models import ScheduleCursor

    if start == "last-run":
        PeriodicTask.objects.update(last_run_at=datetime.now(UTC) - timedelta(seconds=30))
    elif start == "restart":
        first = build("locked")
        deadline = time.monotonic() + 120
        entries = PeriodicTask.objects.count()
        while ScheduleCursor.objects.count() < entries and time.monotonic() < deadline:
            time.sleep(max(0.0, first.tick() or 0.0))
        first.close()  # a clean stop: the lease is released


def run_load(
    kind: str, n: int, seconds: float, mix: bool = False, through: float = 0, start: str = "cold"
) -> dict[str, Any]:
    reset()
    _MADE.clear()
    populate(kind, n, every=60, mix=mix)
    settle()
    if kind == "locked" and start != "cold":
        prepare_start(start)
    boundary = wait_for_boundary(through) if through else None
    t0, m0 = time.perf_counter(), time.monotonic()
    scheduler = build(kind)
    interval = scheduler.tick()
    startup = time.perf_counter() - t0
    # LockedScheduler: from construction to its first committed batch of slots (the rest of the
    # first tick publishes the other batches of its backlog).
    first_at = getattr(getattr(scheduler, "stats", None), "first_published_at", None)
    published_at_start = published()
    started_wall = datetime.now(UTC)
    ticks: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    deadline = wall0 + seconds
    while time.perf_counter() < deadline:
        if interval and interval > 0:
            time.sleep(min(interval, max(0.0, deadline - time.perf_counter())))
        s = time.perf_counter()
        interval = scheduler.tick()
        ticks.append(time.perf_counter() - s)
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    count = published() - published_at_start
    scheduler.close()
    ticks.sort()
    result = {
        "scheduler": kind,
        "jobs": n,
        "startup_s": round(startup, 3),
        "first_publication_s": round(first_at - m0, 3) if first_at is not None else None,
        "cpu_per_wall_s": round(cpu / wall, 3),
        "ticks": len(ticks),
        "tick_mean_ms": round(1000 * statistics.fmean(ticks), 3) if ticks else None,
        "tick_p99_ms": round(1000 * ticks[min(len(ticks) - 1, int(len(ticks) * 0.99))], 3) if ticks else None,
        "published_per_s": round(count / wall, 1),
        "needed_per_s": round(needed_per_second(n, mix), 1),
        "mix": mix,
    }
    if boundary is not None:
        result["through"] = boundary.isoformat()
    if kind == "locked":
        result["start"] = start
    if kind == "locked":
        result.update(lateness_of_ledger(started_wall))
    return result


# --- failover ------------------------------------------------------------------------------------


def start_beat(kind: str, workdir: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = workdir / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "beat", "-S", SCHEDULERS[kind], "--loglevel", "INFO",
         "-f", str(log), "--pidfile=", "-s", str(workdir / f"{name}-schedule")],
        cwd=ROOT, env={**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings", **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    return proc, log


def wait(predicate: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    return None


def leader_of(kind: str, beats: list[tuple[subprocess.Popen[bytes], Path]]) -> subprocess.Popen[bytes] | None:
    if kind == "locked":
        from taskplatform.models import SchedulerFence

        fence = SchedulerFence.objects.first()
        pid = int(fence.leader.split("#")[0].rsplit(":", 1)[1]) if fence and fence.leader else None
        return next((p for p, _log in beats if p.pid == pid), None)
    return next((p for p, log in beats if log.exists() and "Acquired lock" in log.read_text(errors="replace")), None)


def warm(log: Path) -> bool:
    """Whether a LockedScheduler follower logged its schedule table built."""
    return log.exists() and "has the schedule table built" in log.read_text(errors="replace")


def lost_minute_slots(n: int, start: datetime, end: datetime) -> tuple[int, int]:
    """Of the every-minute entries of ``populate(..., every=60, mix=True)`` (``j{i}``, i a
    multiple of 10, anchored at ``60 * i / n`` s past the minute): the slots due in
    ``[start, end)``, and how many of them have no execution in the ledger."""
    from taskplatform.models import Execution

    expected = set()
    minute = start.replace(second=0, microsecond=0) - timedelta(minutes=1)
    while minute < end:
        for i in range(0, n, 10):
            slot = minute + timedelta(seconds=60 * i / n)
            if start <= slot < end:
                expected.add((f"j{i}", slot))
        minute += timedelta(minutes=1)
    rows = Execution.objects.filter(scheduled_for__gte=start, scheduled_for__lt=end, job__isnull=False)
    found = {(slug, slot) for slug, slot in rows.values_list("job__slug", "scheduled_for")}
    return len(expected), len(expected - found)


def messages_per_execution() -> tuple[int, int, int]:
    """The queue's messages (nothing consumes it) against the ledger's beat rows: how many
    executions have more than one message (a doubled slot), how many messages those extra ones
    are, and how many rows have no message (a commit whose publication the kill cut: the
    rescuer republishes those, and none runs here)."""
    from taskplatform.core.publisher import HEADER_EXECUTION
    from taskplatform.models import Execution

    counts: dict[int, int] = {}
    chunk = 5000
    for start in range(0, published(), chunk):
        for raw in broker().lrange(QUEUE, start, start + chunk - 1):
            execution = json.loads(raw).get("headers", {}).get(HEADER_EXECUTION)
            if execution is not None:
                counts[int(execution)] = counts.get(int(execution), 0) + 1
    doubled = [n for n in counts.values() if n > 1]
    rows = set(Execution.objects.filter(job__isnull=False).values_list("pk", flat=True))
    return len(doubled), sum(n - 1 for n in doubled), len(rows - counts.keys())


def run_failover(kind: str, label: str, env: dict[str, str], wait_s: float, jobs: int = 1) -> dict[str, Any]:
    """SIGKILL of the leader: the time to the survivor's first publication. ``jobs`` > 1 (locked
    only): the mixed schedule of that many jobs, the follower's table built before the kill,
    and the every-minute jobs' slots from the kill to 30 s after the first publication checked
    against the ledger (none lost); every slot of every job, before and after the kill, checked
    for a second message (none doubled)."""
    reset()
    if jobs > 1:
        populate(kind, jobs, every=60, mix=True)
    else:
        populate(kind, 1, every=1)
    with tempfile.TemporaryDirectory() as tmp:
        beats = [start_beat(kind, Path(tmp), f"b{i}", env) for i in range(2)]
        try:
            if not wait(lambda: published() >= 3, 120):
                return {"scheduler": label, "error": "no publications within 120 s"}
            leader = wait(lambda: leader_of(kind, beats), 10)
            if leader is None:
                return {"scheduler": label, "error": "leader not identified"}
            if jobs > 1 and not wait(lambda: any(warm(log) for p, log in beats if p is not leader), 120):
                return {"scheduler": label, "error": "the follower's table was not built within 120 s"}
            os.kill(leader.pid, signal.SIGKILL)
            killed = time.perf_counter()
            killed_at = datetime.now(UTC)
            before = published()
            resumed = wait(lambda: published() > before and time.perf_counter(), wait_s)
            failover = round(resumed - killed, 2) if resumed else None
            end = killed + (failover or 0) + (30 if jobs > 1 else 10)
            time.sleep(max(0.0, end - time.perf_counter()))
            window = time.perf_counter() - killed
            count = published() - before
        finally:
            for proc, _log in beats:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
    if jobs > 1:
        # The ledger's rows up to 5 s before the check: later slots may still be on their way.
        due, lost = lost_minute_slots(jobs, killed_at, killed_at + timedelta(seconds=window - 5))
        doubled, extra, unpublished = messages_per_execution()
        return {
            "scheduler": label,
            "jobs": jobs,
            "failover_s": failover if failover is not None else f"> {wait_s:g} (none)",
            "every_minute_slots_due": due,
            "lost": lost,
            "slots_doubled": doubled,
            "extra_messages": extra,
            "rows_without_message": unpublished,
        }
    return {
        "scheduler": label,
        "failover_s": failover if failover is not None else f"> {wait_s:g} (none)",
        "slots_in_window": int(window),
        "published_in_window": count,
    }


def run_duplicates_without_lock(seconds: float = 10) -> dict[str, Any]:
    """Two django-celery-beat beats side by side, one 1-second entry: messages per slot."""
    reset()
    populate("dcb", 1, every=1)
    with tempfile.TemporaryDirectory() as tmp:
        beats = [start_beat("dcb", Path(tmp), f"d{i}", {}) for i in range(2)]
        try:
            wait(lambda: published() >= 2, 60)
            before = published()
            time.sleep(seconds)
            count = published() - before
        finally:
            for proc, _log in beats:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"scheduler": "dcb x2 (no lock)", "messages_per_slot": round(count / seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="1000,10000")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--schedulers", default="dcb,redbeat,locked")
    parser.add_argument("--failover-wait", type=float, default=60)
    parser.add_argument("--skip-failover", action="store_true")
    parser.add_argument(
        "--failover-jobs", type=int, default=0,
        help="also the failover of locked with this many jobs of the mixed schedule (their slots checked)",
    )  # fmt: skip
    parser.add_argument(
        "--start", choices=STARTS, default="cold",
        help="how LockedScheduler starts: a first start, a restart after a leader wrote every cursor, or a "
        "switch from DatabaseScheduler (every entry with a last_run_at)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    parser.add_argument("--mix", action="store_true", help="the mixed schedule (schedule_of), locked only")
    parser.add_argument(
        "--through", type=float, default=0,
        help="start each load run 25 s before the next multiple of this many seconds (UTC), so it spans it: "
        "600 takes in the burst of the mix's 10-minute jobs, 3600 the hourly ones too",
    )  # fmt: skip
    args = parser.parse_args()

    from run import ensure_database  # bench/run.py

    ensure_database()
    import django

    django.setup()
    import logging

    logging.getLogger("taskplatform").setLevel(logging.WARNING)
    logging.getLogger("celery").setLevel(logging.WARNING)

    kinds = [k.strip() for k in args.schedulers.split(",") if k.strip()]
    loads = []
    for n in (int(x) for x in args.jobs.split(",")):
        for kind in kinds:
            mix = args.mix and kind == "locked"
            result = run_load(kind, n, args.seconds, mix=mix, through=args.through, start=args.start)
            loads.append(result)
            print(json.dumps(result), flush=True)
    failovers = []
    if not args.skip_failover:
        fast = {"BENCH_REDBEAT_LOCK_TIMEOUT": "10", "BENCH_BEAT_MAX_LOOP_INTERVAL": "5"}
        for kind, label, env in [
            ("locked", "locked (defaults)", {}),
            ("redbeat", "redbeat (defaults)", {}),
            ("redbeat", "redbeat (lock 10 s, loop 5 s)", fast),
        ]:
            if kind in kinds:
                result = run_failover(kind, label, env, args.failover_wait)
                failovers.append(result)
                print(json.dumps(result), flush=True)
        if args.failover_jobs and "locked" in kinds:
            result = run_failover("locked", "locked (defaults)", {}, args.failover_wait, jobs=args.failover_jobs)
            failovers.append(result)
            print(json.dumps(result), flush=True)
        if "dcb" in kinds:
            failovers.append(run_duplicates_without_lock())
            print(json.dumps(failovers[-1]), flush=True)

    print()
    print(f"Load: N entries due every 60 s, spread over the minute; {args.seconds:g} s per run, in-process")
    header = (
        f"{'scheduler':<9} {'jobs':>6} {'start-up s':>10} {'1st pub s':>9} {'CPU/s':>6} {'tick mean ms':>12} "
        f"{'tick p99 ms':>11} {'pub/s':>7} {'needed/s':>8} {'late p99 s':>10} {'due p99 s':>9}"
    )
    print(header)
    for r in loads:
        print(
            f"{r['scheduler']:<9} {r['jobs']:>6} {r['startup_s']:>10} {r['first_publication_s'] or '-'!s:>9} "
            f"{r['cpu_per_wall_s']:>6} "
            f"{r['tick_mean_ms']!s:>12} {r['tick_p99_ms']!s:>11} {r['published_per_s']:>7} {r['needed_per_s']:>8} "
            f"{r.get('lateness_p99_s', '-')!s:>10} {r.get('due_lateness_p99_s', '-')!s:>9}"
        )
    by = {(r["scheduler"], r["jobs"]): r for r in loads}
    for n in sorted({r["jobs"] for r in loads}):
        base = by.get(("dcb", n))
        for kind in ("redbeat", "locked"):
            r = by.get((kind, n))
            if base and r and base["cpu_per_wall_s"]:
                print(
                    f"  {kind} vs dcb at {n}: CPU x{r['cpu_per_wall_s'] / base['cpu_per_wall_s']:.2f}, "
                    f"throughput x{r['published_per_s'] / max(base['published_per_s'], 0.1):.2f}"
                )
    if failovers:
        print()
        print("Failover: 2 beats, one 1-second entry, SIGKILL of the leader")
        for r in failovers:
            print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"load": loads, "failover": failovers}, indent=2))


if __name__ == "__main__":
    main()
