"""The reference jobs, through a real worker: order time-out close, inventory sync against a
local stub service, sharded payment reconciliation."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, date, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from taskplatform import submit
from taskplatform.models import Execution, JobDefinition
from tasks.models import Order, Payment, StockItem
from tests.helpers import event_kinds, state_of, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_overdue_orders_are_closed_once_each_by_overlapping_sweeps(workers: Any) -> None:
    workers.start(concurrency=4)
    old, recent = timezone.now() - timedelta(minutes=45), timezone.now() - timedelta(minutes=5)
    Order.objects.bulk_create(
        [
            Order(number="A1", created_at=old),
            Order(number="A2", created_at=old),
            Order(number="P1", created_at=old, status=Order.Status.PAID),
            Order(number="R1", created_at=recent),
        ]
    )
    sweeps = [submit("tasks.close_unpaid_orders", kwargs={"max_age_minutes": 30}) for _ in range(2)]
    closes = Execution.objects.filter(task_name="tasks.close_order")
    wait_for(
        lambda: (
            all(state_of(s.pk) == "SUCCEEDED" for s in sweeps)
            and closes.count() == 2
            and not closes.exclude(state="SUCCEEDED").exists()
        ),
        timeout=60,
        what="both sweeps and the closes",
    )
    assert dict(Order.objects.values_list("number", "status")) == {
        "A1": "closed",
        "A2": "closed",
        "P1": "paid",
        "R1": "pending",
    }
    assert sorted(closes.values_list("idempotency_key", flat=True)) == ["close-order:A1", "close-order:A2"]
    submitted = [Execution.objects.get(pk=s.pk).result["submitted"] for s in sweeps]  # type: ignore[index]
    assert sum(submitted) == 2  # the second sweep found the same orders and submitted nothing new


class StubWarehouse:
    """A local HTTP service answering ``POST /stock`` from a script: "503", "timeout", "200", "400"."""

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.requests.append(
                    {
                        "key": self.headers.get("Idempotency-Key"),
                        "token": self.headers.get("X-Fencing-Token"),
                        "body": json.loads(body),
                    }
                )
                action = stub.script.pop(0) if stub.script else "200"
                if action == "timeout":
                    time.sleep(2)  # the client gave up after its timeout; this is the slow server
                    action = "200"
                try:
                    self.send_response(int(action))
                    self.end_headers()
                    self.wfile.write(b"{}")
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> StubWarehouse:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stock() -> None:
    StockItem.objects.bulk_create([StockItem(sku="SKU-1", quantity=5), StockItem(sku="SKU-2", quantity=0)])


def sync_job() -> JobDefinition:
    return JobDefinition.objects.create(
        slug="inventory-sync", task="tasks.sync_inventory", kwargs={"timeout_seconds": 0.5},
        backoff_base_seconds=1, backoff_max_seconds=1, jitter=False,
    )  # fmt: skip


def test_inventory_sync_retries_5xx_and_timeouts_with_the_same_idempotency_key(workers: Any, stock: None) -> None:
    with StubWarehouse(["503", "timeout", "200"]) as stub:
        workers.start(concurrency=2, env={"INVENTORY_SERVICE_URL": stub.url})
        execution = submit(sync_job())
        wait_for(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="the sync to succeed")
    execution.refresh_from_db()
    assert execution.attempts == 3
    assert [r["key"] for r in stub.requests] == [execution.idempotency_key] * 3
    assert [r["token"] for r in stub.requests] == ["1", "2", "3"]
    assert stub.requests[-1]["body"] == {"items": [{"sku": "SKU-1", "quantity": 5}, {"sku": "SKU-2", "quantity": 0}]}
    assert event_kinds(execution.pk).count("retry_scheduled") == 2


def test_inventory_sync_fails_at_once_on_a_4xx(workers: Any, stock: None) -> None:
    with StubWarehouse(["400"]) as stub:
        workers.start(concurrency=2, env={"INVENTORY_SERVICE_URL": stub.url})
        execution = submit(sync_job())
        wait_for(lambda: state_of(execution.pk) == "FAILED", timeout=60, what="the sync to fail")
    execution.refresh_from_db()
    assert execution.attempts == 1 and len(stub.requests) == 1
    assert "HTTP 400" in execution.last_error


def test_reconciliation_shards_retry_independently_and_a_rerun_resumes(workers: Any) -> None:
    workers.start(concurrency=4)
    day, other = date(2026, 11, 28), date(2026, 11, 27)
    Payment.objects.bulk_create(
        [Payment(reference=f"p{i}", amount_cents=100 + i, settled_on=day) for i in range(40)]
        + [Payment(reference=f"q{i}", amount_cents=100, settled_on=other) for i in range(5)]
    )
    bad = Payment.objects.get(reference="p7")
    Payment.objects.filter(pk=bad.pk).update(amount_cents=-1)  # a mismatch until "the provider" corrects it
    job = JobDefinition.objects.create(
        slug="recon", task="tasks.reconcile_payments", kwargs={"shards": 4, "day": day.isoformat()}
    )
    parent = submit(job)
    shards = Execution.objects.filter(task_name="tasks.reconcile_payment_shard")
    failing_key = f"reconcile:{day}:{bad.pk % 4}/4"

    def three_done_one_retrying() -> bool:
        states = dict(shards.values_list("idempotency_key", "state"))
        others = [s for k, s in states.items() if k != failing_key]
        return len(states) == 4 and others == ["SUCCEEDED"] * 3 and states[failing_key] == "RETRYING"

    wait_for(three_done_one_retrying, timeout=60, what="three shards done while the fourth retries")
    assert state_of(parent.pk) == "SUCCEEDED"
    Payment.objects.filter(pk=bad.pk).update(amount_cents=107)
    failing = shards.get(idempotency_key=failing_key)
    wait_for(lambda: state_of(failing.pk) == "SUCCEEDED", timeout=60, what="the failing shard's retry")

    assert not Payment.objects.filter(settled_on=day, reconciled_at__isnull=True).exists()
    assert not Payment.objects.filter(settled_on=other, reconciled_at__isnull=False).exists()
    for payment in Payment.objects.filter(settled_on=day):
        assert payment.reconciled_by == f"reconcile:{day}:{payment.pk % 4}/4"

    rerun = submit(job, idempotency_key="recon-rerun")  # a resume, or an operator re-running the day
    wait_for(lambda: state_of(rerun.pk) == "SUCCEEDED", timeout=60, what="the re-run")
    assert Execution.objects.get(pk=rerun.pk).result == {"day": day.isoformat(), "shards": 4, "submitted": 0}
    assert shards.count() == 4


def test_reconciliation_defaults_to_the_day_before_its_slot_in_its_time_zone(workers: Any) -> None:
    workers.start(concurrency=2)
    job = JobDefinition.objects.create(
        slug="recon-slot", task="tasks.reconcile_payments", kwargs={"shards": 1, "timezone_name": "Europe/Berlin"}
    )
    # 2026-03-29 00:30 UTC is 02:30 CEST on the 29th (the spring-forward day): yesterday is the 28th.
    execution = submit(job, idempotency_key="recon-slot@x", slot=datetime(2026, 3, 29, 0, 30, tzinfo=UTC))
    wait_for(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="the run")
    assert Execution.objects.get(pk=execution.pk).result["day"] == "2026-03-28"  # type: ignore[index]


def test_the_reference_schedules_are_installed_with_explicit_time_zones(settings: Any) -> None:
    settings.INVENTORY_SERVICE_URL = ""
    call_command("setup_reference_jobs")
    call_command("setup_reference_jobs")  # idempotent
    jobs = {j.slug: j for j in JobDefinition.objects.select_related("periodic_task__crontab")}
    assert set(jobs) == {"close-unpaid-orders", "inventory-sync", "payment-reconciliation"}
    recon = jobs["payment-reconciliation"].periodic_task
    assert recon is not None and recon.crontab is not None
    assert (recon.crontab.minute, recon.crontab.hour, str(recon.crontab.timezone)) == ("30", "2", "Europe/Berlin")
    assert jobs["payment-reconciliation"].misfire_policy == "catch_up"
    assert not jobs["inventory-sync"].enabled  # paused until INVENTORY_SERVICE_URL is configured
