"""``python manage.py taskplatform <command>``: operations from the shell."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count
from django.utils import timezone

from ...backends import get_lock_backend
from ...conf import platform_settings
from ...core.rescuer import run_rescuer
from ...domain.states import STATE_DOCS, TRANSITIONS, State
from ...models import BeatProcess, Execution, SchedulerFence
from ...scheduling.table import ScheduleTable


class Command(BaseCommand):
    help = "Platform operations: status, rescue, states."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        status = sub.add_parser(
            "status", help="Beat leader, lease and followers; due and late slots; executions per state."
        )
        status.add_argument("--json", action="store_true", help="Machine-readable output.")
        sub.add_parser("rescue", help="Run one rescuer pass now.")
        sub.add_parser("states", help="Print the states and transitions table (Markdown).")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        if action == "rescue":
            self.stdout.write(json.dumps(run_rescuer().as_dict()))
        elif action == "states":
            self.stdout.write(states_markdown())
        elif action == "status":
            data = status_data()
            if options["json"]:
                self.stdout.write(json.dumps(data, indent=2, default=str))
            else:
                self.stdout.write(status_text(data))


def status_data() -> dict[str, Any]:
    """The beat's leadership and schedule, counts per state, and rows the rescuer should see."""
    now = timezone.now()
    counts = {row["state"]: row["n"] for row in Execution.objects.values("state").annotate(n=Count("id"))}
    return {
        "beat": beat_status(now),
        "executions": {state.value: counts.get(state.value, 0) for state in State},
        "dead_letters": counts.get(State.FAILED.value, 0),
        "expired_leases": Execution.objects.lease_expired(now).count(),
        "overdue_unclaimed": Execution.objects.overdue(now).count(),
    }


def states_markdown() -> str:
    """The canonical state table as Markdown (``docs/reference/states.md``)."""
    lines = ["| state | meaning |", "|---|---|"]
    lines += [f"| `{state.value}` | {STATE_DOCS[state]} |" for state in State]
    lines += ["", "| from | to | transition | performed by | meaning |", "|---|---|---|---|---|"]
    for tr in TRANSITIONS:
        actors = ", ".join(sorted(a.value for a in tr.actors))
        lines.append(f"| `{tr.source.value}` | `{tr.target.value}` | {tr.name} | {actors} | {tr.doc} |")
    return "\n".join(lines) + "\n"


def beat_status(now: datetime) -> dict[str, Any]:
    """Who leads the beat (as the lock backend and the fence say), who follows, what is due."""
    from celery import current_app

    conf = platform_settings()
    lock: dict[str, Any] = {"name": conf.beat_lock_name, "backend": conf.beat_lock_alias}
    try:
        backend = get_lock_backend(conf.beat_lock_alias)
        lock["backend"] = f"{conf.beat_lock_alias} ({type(backend).__name__})"
        info = backend.inspect(conf.beat_lock_name)
        if info is not None:
            lock.update(holder=info.owner, fencing_token=info.token, expires_at=info.expires_at)
            remaining = info.ttl_remaining_seconds
            if remaining is None and info.expires_at is not None:
                remaining = (info.expires_at - now).total_seconds()
            lock["ttl_remaining_seconds"] = round(remaining, 1) if remaining is not None else None
    except Exception as exc:  # an unreachable lock server is itself the status to report
        lock["error"] = str(exc)
    fence = SchedulerFence.objects.filter(name=conf.beat_lock_name).first()
    processes = [
        {
            "identity": p.identity,
            "role": "leader" if p.is_leader else ("stopped" if p.stopped_at else "follower"),
            "last_seen_seconds_ago": round((now - p.last_seen_at).total_seconds(), 1),
            "fencing_token": p.fencing_token or None,
            "lease_expires_at": p.lease_expires_at,
            "published": p.published,
            "started_at": p.started_at,
        }
        for p in BeatProcess.objects.filter(lock_name=conf.beat_lock_name)
        if p.stopped_at is None or (now - p.stopped_at).total_seconds() < 3600
    ]
    table = ScheduleTable(conf, current_app)
    table.load(now, first=True)
    upcoming = []
    late = []
    for name, entry in sorted(table.entries.items()):
        cursor = table.cursors.get(name, now)
        slot = entry.next_slot(cursor)
        if slot is None or not entry.active:
            continue
        lateness = (now - slot).total_seconds()
        item = {"entry": name, "slot": slot, "policy": entry.policy.value}
        if lateness > conf.beat_tick_seconds * 2:
            late.append({**item, "late_seconds": round(lateness, 1)})
        else:
            upcoming.append(item)
    upcoming.sort(key=lambda item: str(item["slot"]))
    return {
        "lock": lock,
        "leader": lock.get("holder"),
        "fence": {"leader": fence.leader, "fencing_token": fence.fencing_token} if fence else None,
        "processes": processes,
        "entries": len(table.entries),
        "broken_entries": table.broken,
        "next_due": upcoming[:10],
        "late": late,
    }


def status_text(data: dict[str, Any]) -> str:
    beat = data["beat"]
    lock = beat["lock"]
    lines = [f"beat lock {lock['name']} on {lock['backend']}"]
    if "error" in lock:
        lines.append(f"  lock backend unreachable: {lock['error']}")
    elif lock.get("holder"):
        lines.append(
            f"  leader {lock['holder']}  token {lock.get('fencing_token')}  "
            f"expires in {lock.get('ttl_remaining_seconds') or 0:.1f} s"
        )
    else:
        lines.append("  no leader")
    for p in beat["processes"]:
        lines.append(f"  {p['role']:<8} {p['identity']}  last seen {p['last_seen_seconds_ago']} s ago")
    lines.append(f"schedule: {beat['entries']} entries, {len(beat['late'])} late")
    for item in beat["late"]:
        lines.append(f"  LATE {item['entry']} slot {item['slot']:%Y-%m-%dT%H:%M:%SZ} ({item['late_seconds']} s)")
    for item in beat["next_due"]:
        lines.append(f"  next {item['entry']} at {item['slot']:%Y-%m-%dT%H:%M:%SZ}")
    for name, problem in beat["broken_entries"].items():
        lines.append(f"  BROKEN {name}: {problem}")
    lines.append("executions: " + ", ".join(f"{k} {v}" for k, v in data["executions"].items()))
    lines.append(
        f"dead letters {data['dead_letters']}, expired leases {data['expired_leases']}, "
        f"overdue unclaimed {data['overdue_unclaimed']}"
    )
    return "\n".join(lines) + "\n"
