"""``python manage.py taskplatform <command>``: operations from the shell."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count
from django.utils import timezone

from ...models import Execution
from ...rescuer import run_rescuer
from ...states import STATE_DOCS, TRANSITIONS, State


class Command(BaseCommand):
    help = "Platform operations: status, rescue, states."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        status = sub.add_parser("status", help="Executions per state, dead letters, stale rows.")
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
                self.stdout.write(json.dumps(data, indent=2))
            else:
                for key, value in data.items():
                    self.stdout.write(f"{key}: {value}")


def status_data() -> dict[str, Any]:
    """Counts per state, dead letters and rows the rescuer should be looking at."""
    now = timezone.now()
    counts = {row["state"]: row["n"] for row in Execution.objects.values("state").annotate(n=Count("id"))}
    return {
        "executions": {state.value: counts.get(state.value, 0) for state in State},
        "dead_letters": counts.get(State.FAILED.value, 0),
        "expired_leases": Execution.objects.filter(state=State.RUNNING, lease_expires_at__lt=now).count(),
        "overdue_unclaimed": Execution.objects.filter(
            state__in=(State.PENDING, State.RETRYING), due_at__lt=now
        ).count(),
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
