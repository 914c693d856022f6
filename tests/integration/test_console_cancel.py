"""Cancelling from the console stops work that is queued or already running on a real worker."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from taskplatform import submit
from taskplatform.models import Execution
from tests.helpers import state_of, tally, wait_for
from tests.testapp.models import Effect, EffectRaw

pytestmark = pytest.mark.django_db(transaction=True)


def cancel(execution: Execution, seen: str, action: str = "cancel") -> None:
    if not User.objects.filter(username="root").exists():
        User.objects.create_superuser("root", password="pw")
    client = Client()
    client.login(username="root", password="pw")
    client.post(
        "/admin/taskplatform/execution/",
        {"action": action, "_selected_action": [execution.pk], "confirm": "yes", "reason": "wrong customer",
         f"expected_{execution.pk}": seen},
    )  # fmt: skip


@pytest.mark.scenario(17)
def test_cancelling_a_running_execution_stops_its_body_and_its_write_back(
    workers: Any, open_gate: Any, figures: Any
) -> None:
    worker = workers.start(concurrency=1)
    execution = submit("testapp.effect", kwargs={"gate": "cancel-me"})
    wait_for(lambda: state_of(execution.pk) == "RUNNING", timeout=60, what="the body to start")
    wait_for(lambda: EffectRaw.objects.filter(key=execution.idempotency_key).exists(), timeout=30, what="started")
    pid = EffectRaw.objects.get(key=execution.idempotency_key).pid
    cancel(execution, "RUNNING")
    assert state_of(execution.pk) == "CANCELLED"
    # The revoke terminates the pool child running the body (Celery replaces it).
    wait_for(lambda: pid not in {c.pid for c in worker.pool_children()}, timeout=30, what="the body's process to end")
    open_gate("cancel-me:1")  # had the body survived, it would now write its effect
    assert not Effect.objects.filter(key=execution.idempotency_key).exists()
    assert state_of(execution.pk) == "CANCELLED"
    figures.record(**tally([execution]), state=state_of(execution.pk))


@pytest.mark.scenario(17)
def test_cancelling_a_queued_execution_means_it_never_runs(workers: Any, figures: Any) -> None:
    """No worker is up when the cancel is made, so no worker ever saw a revoke: the first
    worker that starts gets the message and only the ledger's state stops it."""
    execution = submit("testapp.effect", kwargs={})
    cancel(execution, "PENDING")
    assert state_of(execution.pk) == "CANCELLED"
    workers.start(concurrency=1)  # the message is delivered now: revoked, or absorbed by the ledger
    probe = submit("testapp.effect", kwargs={})  # a later task runs, so the worker did consume
    wait_for(lambda: state_of(probe.pk) == "SUCCEEDED", timeout=60, what="a later task")
    assert not EffectRaw.objects.filter(key=execution.idempotency_key).exists()
    assert state_of(execution.pk) == "CANCELLED"
    figures.record(**tally([execution]), state=state_of(execution.pk))


def test_marking_a_running_execution_failed_stops_its_body(workers: Any, open_gate: Any) -> None:
    """Otherwise "mark failed" then "retry now" could run two bodies at once."""
    worker = workers.start(concurrency=1)
    execution = submit("testapp.effect", kwargs={"gate": "fail-me"})
    wait_for(lambda: EffectRaw.objects.filter(key=execution.idempotency_key).exists(), timeout=60, what="started")
    pid = EffectRaw.objects.get(key=execution.idempotency_key).pid
    cancel(execution, "RUNNING", action="mark_failed")
    assert state_of(execution.pk) == "FAILED"
    wait_for(lambda: pid not in {c.pid for c in worker.pool_children()}, timeout=30, what="the body's process to end")
    open_gate("fail-me:1")
    assert not Effect.objects.filter(key=execution.idempotency_key).exists()
