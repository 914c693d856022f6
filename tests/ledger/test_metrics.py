"""``/metrics``: the ledger's state, recent events and the beat, for Prometheus, behind auth."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from taskplatform import submit
from taskplatform.core.publisher import HEADER_EXECUTION
from taskplatform.models import BeatProcess, Execution, ExecutionEvent, JobDefinition, SchedulerFence
from taskplatform.observability.metrics import first_event_id_since
from tests.testapp.tasks import effect, fatal

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]

TOKEN = "metrics-token-for-tests"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def scrape(settings: Any) -> Any:
    settings.TASKPLATFORM_METRICS_TOKEN = TOKEN

    def get() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert response.status_code == 200
        return samples(response.content.decode())

    return get


def test_metrics_need_the_token_or_a_staff_session(settings: Any) -> None:
    settings.TASKPLATFORM_METRICS_TOKEN = TOKEN
    assert Client().get("/metrics").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    User.objects.create_user("user", password="pw")
    staff_user = User.objects.create_user("staff", password="pw", is_staff=True)
    member = Client()
    member.login(username="user", password="pw")
    assert member.get("/metrics").status_code == 401
    staff = Client()
    staff.login(username="staff", password="pw")
    assert staff.get("/metrics").status_code == 401  # staff, but no permission to view executions
    staff_user.user_permissions.add(Permission.objects.get(codename="view_execution"))
    assert staff.get("/metrics").status_code == 200
    assert Client().get("/metrics", HTTP_AUTHORIZATION=f"bearer {TOKEN}").status_code == 200  # scheme case
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer ünïcode").status_code == 401  # not a 500
    settings.TASKPLATFORM_METRICS_TOKEN = ""
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401


def test_states_events_and_dead_letters_are_counted(scrape: Any) -> None:
    job = JobDefinition.objects.create(slug="count-me", task="testapp.effect")
    ok = submit(job, on_commit=False)
    effect.apply(task_id=ok.celery_task_id, headers={HEADER_EXECUTION: ok.pk})
    effect.apply(task_id="duplicate", headers={HEADER_EXECUTION: ok.pk})  # absorbed
    bad = submit("testapp.fatal", on_commit=False)
    fatal.apply(task_id=bad.celery_task_id, headers={HEADER_EXECUTION: bad.pk})
    submit("testapp.effect", on_commit=False)  # left PENDING

    m = scrape()
    assert m[("taskplatform_executions", (("job", "count-me"), ("state", "SUCCEEDED")))] == 1
    assert m[("taskplatform_executions", (("job", ""), ("state", "FAILED")))] == 1
    assert m[("taskplatform_executions", (("job", ""), ("state", "PENDING")))] == 1
    assert m[("taskplatform_dead_letters", ())] == 1
    assert m[("taskplatform_leases", (("status", "live"),))] == 0
    assert m[("taskplatform_leases", (("status", "expired"),))] == 0
    assert m[("taskplatform_events_window", (("kind", "claimed"),))] == 2
    assert m[("taskplatform_events_window", (("kind", "dead_lettered"),))] == 1
    assert m[("taskplatform_events_window", (("kind", "already_finished"),))] == 1
    assert m[("taskplatform_events_window", (("kind", "retry_scheduled"),))] == 0


def test_counts_come_from_the_maintenance_snapshot_while_it_is_fresh_and_say_how_old(scrape: Any) -> None:
    """At a million executions, counting per state on every page and scrape cost 0.2-0.3 s
    (bench/console.py): the maintenance holder counts every interval instead; readers use that
    snapshot while it is fresh (three intervals) and say how old it is, else count live."""
    from taskplatform.console.overview import overview
    from taskplatform.models import CountsSnapshot

    job = JobDefinition.objects.create(slug="snap", task="testapp.effect")
    for _ in range(2):
        submit(job, on_commit=False)
    snapshot = CountsSnapshot.take()
    submit(job, on_commit=False)  # after the snapshot: not in it

    view = overview()
    assert (view.counts["PENDING"], view.counted_at) == (2, snapshot.taken_at)
    assert view.counts_max_age == 30  # the bound the landing page states beside the time
    m = scrape()
    assert m[("taskplatform_executions", (("job", "snap"), ("state", "PENDING")))] == 2
    assert 0 <= m[("taskplatform_counts_age_seconds", ())] < 30

    stale = timezone.now() - timedelta(seconds=3 * 10 + 1)  # three intervals (10 s by default) and more
    CountsSnapshot.objects.filter(pk=snapshot.pk).update(taken_at=stale)
    live = overview()
    assert (live.counts["PENDING"], live.counted_at) == (3, None)
    m = scrape()
    assert m[("taskplatform_executions", (("job", "snap"), ("state", "PENDING")))] == 3
    assert m[("taskplatform_counts_age_seconds", ())] == 0


def test_the_event_window_excludes_older_events(scrape: Any) -> None:
    execution = submit("testapp.effect", on_commit=False)
    effect.apply(task_id=execution.celery_task_id, headers={HEADER_EXECUTION: execution.pk})
    ExecutionEvent.objects.update(at=timezone.now() - timedelta(hours=1))
    assert first_event_id_since(timezone.now() - timedelta(minutes=5)) is None
    assert scrape()[("taskplatform_events_window", (("kind", "claimed"),))] == 0
    newer = submit("testapp.effect", on_commit=False)
    effect.apply(task_id=newer.celery_task_id, headers={HEADER_EXECUTION: newer.pk})
    first_new = ExecutionEvent.objects.filter(execution_id=newer.pk).order_by("id").first()
    assert first_new is not None
    assert first_event_id_since(timezone.now() - timedelta(minutes=5)) == first_new.pk
    assert scrape()[("taskplatform_events_window", (("kind", "claimed"),))] == 1


def test_the_beat_leader_and_publication_lateness(scrape: Any) -> None:
    now = timezone.now()
    SchedulerFence.objects.create(name="taskplatform.beat", fencing_token=7, leader="host:1#abc#def")
    for identity, leading in (("host:1#abc", True), ("host:2#xyz", False)):
        BeatProcess.objects.create(
            identity=identity, lock_name="taskplatform.beat", is_leader=leading, started_at=now, last_seen_at=now
        )
    for i, late_ms in enumerate([10, 20, 30, 900]):
        Execution.objects.create(idempotency_key=f"slot-{i}", task_name="testapp.effect", trigger="beat")
        Execution.objects.filter(idempotency_key=f"slot-{i}").update(
            scheduled_for=now - timedelta(milliseconds=late_ms), created_at=now
        )
    m = scrape()
    assert m[("taskplatform_beat_leader", (("identity", "host:1#abc#def"),))] == 1
    assert m[("taskplatform_beat_fencing_token", ())] == 7
    assert m[("taskplatform_beat_processes", (("role", "leader"),))] == 1
    assert m[("taskplatform_beat_processes", (("role", "follower"),))] == 1
    assert m[("taskplatform_beat_publications_window", ())] == 4
    assert m[("taskplatform_beat_publication_lateness_seconds", (("quantile", "0.5"),))] == pytest.approx(0.03)
    assert m[("taskplatform_beat_publication_lateness_seconds", (("quantile", "1.0"),))] == pytest.approx(0.9)
