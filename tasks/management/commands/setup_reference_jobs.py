"""``manage.py setup_reference_jobs``: the reference deployment's job definitions and schedules.

Idempotent: run it on every deploy. Existing definitions keep operator edits (only missing
ones are created); schedules are (re)written from here.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from taskplatform.jobs import define_job, define_limit

JOBS: list[dict[str, Any]] = [
    {
        "slug": "close-unpaid-orders",
        "task": "tasks.close_unpaid_orders",
        "kwargs": {"max_age_minutes": 30},
        "misfire_policy": "run_once",
        "description": "Every minute: close orders left unpaid for 30 minutes (one execution per order).",
        "schedule": {"every_seconds": 60},
    },
    {
        "slug": "inventory-sync",
        "task": "tasks.sync_inventory",
        "misfire_policy": "skip",
        "description": "Every 5 minutes: push stock levels to the warehouse service (INVENTORY_SERVICE_URL).",
        "schedule": {"every_seconds": 300},
    },
    {
        "slug": "payment-reconciliation",
        "task": "tasks.reconcile_payments",
        "kwargs": {"shards": 4, "timezone_name": "Europe/Berlin"},
        "misfire_policy": "catch_up",
        "catch_up_window_seconds": 3 * 86_400,
        "description": "Daily 02:30 Berlin time: reconcile yesterday's payments in 4 shards.",
        "schedule": {"cron": "30 2 * * *", "timezone_name": "Europe/Berlin"},
    },
]


class Command(BaseCommand):
    help = "Create the reference jobs (order time-out, inventory sync, payment reconciliation) and their schedules."

    def handle(self, *args: Any, **options: Any) -> None:
        for spec in JOBS:
            spec = dict(spec)
            schedule = spec.pop("schedule")
            slug = spec.pop("slug")
            if slug == "inventory-sync":
                spec["enabled"] = bool(getattr(settings, "INVENTORY_SERVICE_URL", ""))
            job, created = define_job(slug, schedule=schedule, **spec)
            state = "created" if created else "kept"
            self.stdout.write(f"{slug}: {state}, {'enabled' if job.enabled else 'paused'}")
        # The payment provider's reporting API allows 2 concurrent clients and 10 calls a second:
        # a fleet-wide limit, whatever the number of workers (docs/limits.md).
        limit, created = define_limit(
            task="tasks.reconcile_payment_shard", concurrency=2, rate=10, per_seconds=1,
            note="The payment provider's reporting API: 2 clients at once, 10 calls a second.",
        )  # fmt: skip
        self.stdout.write(f"{limit}: {'created' if created else 'kept'}")
