"""Where a worker's time goes per task: py-spy on a real ``celery worker`` draining a queue.

    .venv/bin/python bench/profile.py [--variant ledger] [--tasks 4000] [--top 25]

The queue is filled first (the worker's consumer paused), then py-spy samples every pool
process while the worker drains it. Reported: the share of samples in each layer (Celery
and kombu, Django, the database driver, the ledger, the body, idle waiting on a socket) and
the hottest functions by own time. ``--variant`` is one of ``bench/run.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

#: (layer, path fragment) in the order they are tried against a sample's innermost frame file.
LAYERS = (
    ("waiting: pool process for work", "billiard/connection.py"),
    ("waiting: PostgreSQL reply", "psycopg/connection.py"),
    ("waiting: threads (lease keeper, timers)", "Condition.wait"),
    ("waiting: broker socket", "eventio.py"),
    ("postgres driver", "psycopg"),
    ("redis driver", "redis/"),
    ("taskplatform", "taskplatform/"),
    ("django", "django/"),
    ("kombu", "kombu/"),
    ("billiard", "billiard/"),
    ("celery", "celery/"),
    ("logging", "logging/"),
    ("json", "json/"),
)


def layer_of(frame: str) -> str:
    for name, fragment in LAYERS:
        if fragment in frame:
            return name
    return "other (stdlib, body)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="ledger")
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument(
        "--on-cpu", action="store_true", help="sample running threads only (default: waiting ones too, py-spy --idle)"
    )
    args = parser.parse_args()

    import django

    django.setup()
    from celery import current_app

    from bench import run

    run.ensure_database()
    run.reset_state()
    worker, name = run.start_worker(args.variant)
    try:
        publish = run.publisher(args.variant)
        publish(-1)
        run.wait_drained(60)
        run.reset_state()
        current_app.control.cancel_consumer("bench", destination=[name], reply=True, timeout=5)
        for i in range(args.tasks):
            publish(i)
        out = Path(tempfile.mkdtemp()) / "profile.txt"
        print(f"py-spy output: {out}")
        spy = subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(worker.pid), "--subprocesses",
             "--rate", str(args.rate), "--format", "raw", "--output", str(out), "--nonblocking",
             *([] if args.on_cpu else ["--idle"])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)  # py-spy attaches; not synchronisation of the system under test
        start = time.perf_counter()
        current_app.control.add_consumer("bench", destination=[name], reply=True, timeout=5)
        run.wait_drained(600)
        seconds = time.perf_counter() - start
        spy.send_signal(2)
        spy.wait(60)
    finally:
        run.stop_worker(worker)

    report(out, args.variant, args.tasks, seconds, args.top)


#: Inclusive markers: the share of a pool process's samples spent under each of these frames.
MARKERS = (
    ("task, as Celery traces it", "trace_task (celery/app/trace.py"),
    ("  the ledger's claim", "_claim_patiently (taskplatform"),
    ("  the body", "benchapp/tasks.py"),
    ("  the ledger's success mark", "_record_success (taskplatform"),
    ("  waiting for PostgreSQL's reply", "wait (psycopg/connection.py"),
    ("idle, waiting for the next task", "_recv (billiard/connection.py"),
)


def report(out: Path, variant: str, tasks: int, seconds: float, top: int) -> None:
    """Summarise py-spy's raw stacks: samples per process role, then, for the pool processes'
    main threads, the share under each marker and the hottest frames by own samples."""
    roles: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    layers: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        pool = len(frames) > 1 and frames[1].startswith("process ")
        thread = "_bootstrap (threading.py" in stack
        role = ("pool process" if pool else "worker main process") + (", other threads" if thread else "")
        roles[role] += n
        if role != "pool process":
            continue
        for label, marker in MARKERS:
            if marker in stack:
                inclusive[label] += n
        layers[layer_of(frames[-1])] += n
        own[frames[-1]] += n
    pool_samples = roles["pool process"] or 1
    print(f"{variant}: {tasks} tasks drained in {seconds:.2f} s ({tasks / seconds:.0f}/s)")
    print("\nsamples by process role:")
    for role, n in roles.most_common():
        print(f"  {role:<40} {n:>7}")
    print("\npool processes, main thread: share of samples under each frame")
    for label, _marker in MARKERS:
        print(f"  {label:<40} {100 * inclusive[label] / pool_samples:5.1f} %")
    print("\npool processes, main thread: share of samples by layer of the innermost frame")
    for name, n in layers.most_common():
        print(f"  {name:<40} {100 * n / pool_samples:5.1f} %")
    print(f"\npool processes, main thread: top {top} frames by own samples")
    for frame, n in own.most_common(top):
        print(f"  {100 * n / pool_samples:5.1f} %  {frame}")


if __name__ == "__main__":
    main()
