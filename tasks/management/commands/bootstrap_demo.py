"""Create the demo superuser (random password, printed), the demo job definitions, the
README's coupon campaign (``winter``), and one order whose flow is compensated (its coupon
campaign, ``spring``, is sold out): the admin's Flows page shows it refunded and released."""

from __future__ import annotations

import secrets
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from taskplatform import submit_flow
from taskplatform.jobs import define_job
from taskplatform.models import JobDefinition
from tasks.models import Campaign, StockItem
from tasks.tasks import ORDER_FLOW


class Command(BaseCommand):
    help = "Create the demo superuser and job definitions for the embedded profile."

    def handle(self, *args: Any, **options: Any) -> None:
        credentials = settings.VAR_DIR / "demo-credentials.txt"
        user_model = get_user_model()
        if not user_model.objects.filter(username="admin").exists():
            password = secrets.token_urlsafe(12)
            user_model.objects.create_superuser("admin", "admin@example.invalid", password)
            credentials.write_text(f"username: admin\npassword: {password}\n")
            credentials.chmod(0o600)
        if not JobDefinition.objects.filter(slug="demo-ping").exists():
            define_job(
                "demo-ping",
                task="tasks.ping",
                args=["beat"],
                description="Demo: a job that always works.",
                schedule={"every_seconds": 15},
            )
        if not JobDefinition.objects.filter(slug="demo-flaky-sync").exists():
            define_job(
                "demo-flaky-sync",
                task="tasks.flaky_sync",
                kwargs={"failure_rate": 0.6},
                max_attempts=3,
                description="Demo: fails 60 % of the time; retries with backoff, then dead-letters.",
                schedule={"cron": "* * * * *", "timezone_name": "Europe/Berlin"},
            )
        # The README's example request, ``POST /api/coupons/ {"campaign": "winter"}``, must work
        # on a fresh ``make run``.
        Campaign.objects.get_or_create(slug="winter", defaults={"name": "Winter sale (demo)", "stock": 100})
        call_command("setup_reference_jobs", stdout=self.stdout)
        # An order that cannot get its coupon: the flow refunds the payment and releases the stock.
        StockItem.objects.get_or_create(sku="demo-widget", defaults={"quantity": 100})
        Campaign.objects.get_or_create(slug="spring", defaults={"name": "Spring sale (sold out, demo)", "stock": 0})
        admin = user_model.objects.get(username="admin")
        run = submit_flow(ORDER_FLOW, key="order:DEMO-1", input={
            "order": "DEMO-1", "sku": "demo-widget", "quantity": 1, "amount_cents": 1999, "campaign": "spring",
            "user_id": admin.pk,
        })  # fmt: skip
        self.stdout.write(f"demo order flow: {run} (compensated once the worker has run it)")
        self.stdout.write(credentials.read_text() if credentials.exists() else "admin user exists\n")
