"""The operator console's actions through the Django test client.

For every action: refused without its permission, CSRF enforced, a reason required on a
confirmation page, illegal transitions refused with a message and no change, the audit
record written, and the same form submitted twice acting once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from taskplatform.backends import get_lock_backend
from taskplatform.core import ledger
from taskplatform.domain.states import State
from taskplatform.models import BeatProcess, CountsSnapshot, Execution, ExecutionEvent, JobDefinition, OperatorAction

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]

CHANGELIST = "/admin/taskplatform/execution/"


def make_execution(key: str, state: str) -> Execution:
    execution, _ = ledger.create(
        ledger.NewExecution(idempotency_key=key, task_name="testapp.effect", args=[], kwargs={})
    )
    if state == State.PENDING:
        return execution
    claim = ledger.claim(execution, worker="w:1", celery_task_id="t", lease_seconds=60, max_attempts=1)
    assert claim is not None
    if state == State.FAILED:
        ledger.dead_letter(claim.execution, claim.token, error="boom", traceback="Traceback: boom", worker="w:1")
    elif state == State.SUCCEEDED:
        ledger.succeed(claim.execution, claim.token, {"ok": 1}, worker="w:1", data={})
    execution.refresh_from_db()
    assert execution.state == state
    return execution


def operator(*codenames: str, username: str = "op") -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    perms = Permission.objects.filter(
        content_type__app_label="taskplatform", codename__in=["view_execution", "view_jobdefinition", *codenames]
    )
    user.user_permissions.add(*perms)
    client = Client()
    client.login(username=username, password="pw")
    return client


def act(client: Client, action: str, executions: list[Execution], reason: str | None = None, **extra: str) -> Any:
    data: dict[str, Any] = {"action": action, "_selected_action": [e.pk for e in executions], **extra}
    if reason is not None:
        data.update(confirm="yes", reason=reason)
        for e in executions:
            data.setdefault(f"expected_{e.pk}", e.state)
    return client.post(CHANGELIST, data, follow=True)


def operator_events(execution: Execution) -> list[ExecutionEvent]:
    return list(ExecutionEvent.objects.filter(execution=execution, kind="operator"))


@pytest.mark.parametrize(
    ("action", "codename", "state", "target"),
    [
        ("retry_now", "retry_execution", State.FAILED, State.PENDING),
        ("requeue_dead_letters", "retry_execution", State.FAILED, State.PENDING),
        ("cancel", "cancel_execution", State.PENDING, State.CANCELLED),
        ("mark_failed", "mark_failed_execution", State.RUNNING, State.FAILED),
        ("mark_succeeded", "mark_succeeded_execution", State.FAILED, State.SUCCEEDED),
    ],
)
@pytest.mark.scenario(39)
def test_each_action_needs_its_permission_a_confirmation_and_a_reason_and_is_audited(
    action: str, codename: str, state: str, target: str, figures: Any
) -> None:
    execution = make_execution(f"{action}-1", state)

    without = operator(username="viewer")
    act(without, action, [execution], reason="should not happen")
    execution.refresh_from_db()
    unpermitted = int(execution.state != state) + len(operator_events(execution))
    assert execution.state == state and not operator_events(execution)

    client = operator(codename)
    confirm = act(client, action, [execution])
    assert confirm.status_code == 200 and b'name="reason"' in confirm.content and b"will change" in confirm.content

    no_reason = act(client, action, [execution], reason="  ")
    assert b"A reason is required" in no_reason.content
    execution.refresh_from_db()
    assert execution.state == state

    done = act(client, action, [execution], reason="customer called, ticket 42")
    assert done.status_code == 200 and b"1 execution(s) changed" in done.content
    execution.refresh_from_db()
    assert execution.state == target
    (event,) = operator_events(execution)
    assert (event.actor, event.reason, event.from_state, event.to_state) == (
        "op",
        "customer called, ticket 42",
        state,
        target,
    )

    # The same confirmation submitted again (a double click, a browser resubmit) acts once.
    again = act(client, action, [execution], reason="customer called, ticket 42", **{f"expected_{execution.pk}": state})
    assert b"not changed" in again.content
    assert len(operator_events(execution)) == 1
    figures.record(
        unpermitted_changes=unpermitted,
        audited_actions=len(operator_events(execution)),
        second_submits_acted=len(operator_events(execution)) - 1,
    )


@pytest.mark.scenario(39)
def test_an_illegal_request_is_refused_with_a_message_and_changes_nothing() -> None:
    running = make_execution("running-1", State.RUNNING)
    client = operator("retry_execution")
    confirm = act(client, "retry_now", [running])
    assert b"refused" in confirm.content and b"nothing will change" in confirm.content
    forced = act(client, "retry_now", [running], reason="try anyway")
    assert b"not a legal transition" in forced.content
    running.refresh_from_db()
    assert running.state == State.RUNNING and not operator_events(running)


@pytest.mark.parametrize(
    ("action", "codename", "state", "target"),
    [
        ("cancel", "cancel_execution", State.PENDING, State.CANCELLED),
        ("retry_now", "retry_execution", State.FAILED, State.PENDING),
        ("requeue_dead_letters", "retry_execution", State.FAILED, State.PENDING),
    ],
)
def test_an_action_acts_only_on_the_selected_rows_whatever_expected_fields_are_posted(
    action: str, codename: str, state: str, target: str
) -> None:
    """Selecting row B with a forged ``expected_<A>`` field must not touch A."""
    victim, selected = make_execution(f"{action}-victim", state), make_execution(f"{action}-selected", state)
    client = operator(codename)
    forged = {f"expected_{victim.pk}": f"{state}:{victim.fencing_token}"}
    done = act(client, action, [selected], reason="only the selected one", **forged)
    assert b"1 execution(s) changed" in done.content
    victim.refresh_from_db()
    selected.refresh_from_db()
    assert (victim.state, selected.state) == (state, target)
    assert not operator_events(victim) and len(operator_events(selected)) == 1
    # Only forged fields, for rows not selected: nothing at all changes.
    other = make_execution(f"{action}-other", state)
    only_forged = {"action": action, "_selected_action": [other.pk], "confirm": "yes", "reason": "x", **forged}
    response = client.post(CHANGELIST, only_forged, follow=True)
    assert b"Nothing was selected" in response.content
    victim.refresh_from_db()
    other.refresh_from_db()
    assert (victim.state, other.state) == (state, state)
    assert not operator_events(victim) and not operator_events(other)


def test_odd_expected_fields_are_ignored_not_a_500() -> None:
    pending = make_execution("odd-1", State.PENDING)
    client = operator("cancel_execution")
    from urllib.parse import urlencode

    odd = {"expected_" + "9" * 5000: "PENDING", "expected_\u0661": "PENDING", "expected_-1": "PENDING"}
    form = {"action": "cancel", "_selected_action": pending.pk, "confirm": "yes", "reason": "odd fields", **odd}
    form[f"expected_{pending.pk}"] = "PENDING"
    response = client.post(CHANGELIST, urlencode(form), content_type="application/x-www-form-urlencoded", follow=True)
    assert response.status_code == 200 and b"1 execution(s) changed" in response.content


def test_requeue_dead_letters_leaves_other_selected_rows_alone() -> None:
    dead, done = make_execution("dead-1", State.FAILED), make_execution("done-1", State.SUCCEEDED)
    client = operator("retry_execution")
    confirm = act(client, "requeue_dead_letters", [dead, done])
    assert b"not a dead letter" in confirm.content
    act(client, "requeue_dead_letters", [dead], reason="fixed the gateway config")
    dead.refresh_from_db()
    done.refresh_from_db()
    assert (dead.state, done.state) == (State.PENDING, State.SUCCEEDED)


@pytest.mark.parametrize(
    ("url", "action", "state"),
    [
        (CHANGELIST, "retry_now", State.FAILED),
        (CHANGELIST, "requeue_dead_letters", State.FAILED),
        (CHANGELIST, "cancel", State.PENDING),
        (CHANGELIST, "mark_failed", State.RUNNING),
        (CHANGELIST, "mark_succeeded", State.FAILED),
    ],
)
@pytest.mark.scenario(39)
def test_csrf_is_enforced_on_every_execution_action(url: str, action: str, state: str, figures: Any) -> None:
    execution = make_execution(f"csrf-{action}", state)
    User.objects.create_superuser("root", password="pw")
    browser = Client(enforce_csrf_checks=True)
    browser.login(username="root", password="pw")
    response = browser.post(
        url,
        {"action": action, "_selected_action": [execution.pk], "confirm": "yes", "reason": "x",
         f"expected_{execution.pk}": state},
    )  # fmt: skip
    figures.record(posts_without_token=1, answered_403=int(response.status_code == 403))
    assert response.status_code == 403
    execution.refresh_from_db()
    assert execution.state == state and not operator_events(execution)


@pytest.mark.scenario(39)
def test_csrf_is_enforced_on_job_and_lock_actions() -> None:
    job = JobDefinition.objects.create(slug="csrf-job", task="testapp.effect")
    lease = get_lock_backend().acquire("csrf-lock", 600)
    assert lease is not None
    User.objects.create_superuser("root", password="pw")
    browser = Client(enforce_csrf_checks=True)
    browser.login(username="root", password="pw")
    for action in ("pause", "run_now", "duplicate"):
        form = {"action": action, "_selected_action": [job.pk], "confirm": "yes", "token": "t", "reason": "x"}
        assert browser.post(JOBS, form).status_code == 403
    release = {"alias": "default", "name": "csrf-lock", "confirm": "yes", "reason": "x"}
    assert browser.post("/admin/taskplatform/locklease/force-release/", release).status_code == 403
    job.refresh_from_db()
    assert job.enabled and JobDefinition.objects.count() == 1 and not Execution.objects.exists()
    assert get_lock_backend().inspect("csrf-lock").owner == lease.owner  # type: ignore[union-attr]
    assert not OperatorAction.objects.exists()


def test_duplicate_makes_a_paused_copy_without_schedule_and_audits_it() -> None:
    from taskplatform import schedule_job

    job = JobDefinition.objects.create(slug="sync", task="testapp.effect", kwargs={"seconds": 1}, max_attempts=4)
    schedule_job(job, every_seconds=60)
    client = operator("add_jobdefinition")
    client.post(JOBS, {"action": "duplicate", "_selected_action": [job.pk]})
    copy = JobDefinition.objects.get(slug="sync-copy")
    assert (copy.kwargs, copy.max_attempts, copy.enabled, copy.periodic_task) == ({"seconds": 1}, 4, False, None)
    assert OperatorAction.objects.get(action="duplicate_job").data == {"copy": "sync-copy"}


def test_the_stuck_filter_finds_expired_leases_and_overdue_rows() -> None:

    stuck = make_execution("stuck-1", State.RUNNING)
    Execution.objects.filter(pk=stuck.pk).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
    make_execution("fine-1", State.RUNNING)
    listing = operator().get(CHANGELIST + "?stuck=yes").content
    assert b"stuck-1" in listing and b"fine-1" not in listing


def test_every_reader_of_the_stuck_condition_agrees() -> None:
    """The console's filter and landing page, ``taskplatform status`` and ``/metrics`` count the
    same rows: the condition is written once (``ExecutionQuerySet``)."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from taskplatform.console.overview import overview
    from taskplatform.management.commands.taskplatform import status_data
    from taskplatform.observability.metrics import LedgerCollector

    past, future = timezone.now() - timedelta(minutes=1), timezone.now() + timedelta(minutes=5)
    for key, state, lease, due in [
        ("expired", State.RUNNING, past, None),
        ("live", State.RUNNING, future, None),
        ("overdue", State.PENDING, None, past),
        ("overdue-retry", State.RETRYING, None, past),
        ("waiting", State.PENDING, None, future),
        ("done", State.SUCCEEDED, None, past),
    ]:
        execution = make_execution(f"agree-{key}", State.PENDING if state == State.RETRYING else state)
        Execution.objects.filter(pk=execution.pk).update(state=state, lease_expires_at=lease, due_at=due)
    stuck = {"agree-expired", "agree-overdue", "agree-overdue-retry"}
    assert set(Execution.objects.stuck().values_list("idempotency_key", flat=True)) == stuck
    listing = operator().get(CHANGELIST + "?stuck=yes").content.decode()
    assert {k for k in ("agree-expired", "agree-live", "agree-overdue", "agree-overdue-retry", "agree-waiting",
                        "agree-done") if f">{k}<" in listing} == stuck  # fmt: skip
    assert overview().stuck == 3
    status = status_data()
    assert (status["expired_leases"], status["overdue_unclaimed"]) == (1, 2)
    registry = CollectorRegistry()
    registry.register(LedgerCollector())
    text = generate_latest(registry).decode()
    assert "taskplatform_expired_leases 1.0" in text and "taskplatform_overdue_unclaimed 2.0" in text


def test_search_finds_a_key_by_its_beginning_or_an_execution_by_its_id() -> None:
    """The search a million-row ledger can afford (bench/console.py): the key's beginning
    (its pattern index) or the id, not a substring anywhere in four columns."""
    order = make_execution("order:1234:charge", State.PENDING)
    other = make_execution("refund:1234", State.PENDING)
    client = operator()

    def found(term: str) -> set[str]:
        page = client.get(CHANGELIST, {"q": term}).content.decode()
        return {key for key in ("order:1234:charge", "refund:1234") if f">{key}<" in page}

    assert found("order:12") == {"order:1234:charge"}
    assert found("1234") == set()  # in the middle of both keys: not a beginning
    assert found(str(other.pk)) == {"refund:1234"} and order.pk != other.pk


def test_the_detail_page_shows_the_timeline_and_the_traceback() -> None:
    execution = make_execution("detail-1", State.FAILED)
    client = operator()
    page = client.get(f"{CHANGELIST}{execution.pk}/change/")
    assert page.status_code == 200
    for fragment in (b"tp-timeline", b"claimed", b"dead_lettered", b"Traceback: boom", b"tp-badge"):
        assert fragment in page.content
    listing = client.get(CHANGELIST + "?dead_letter=yes")
    assert b"detail-1" in listing.content


def test_the_timeline_shows_an_attempt_s_error_duration_and_the_next_due_time() -> None:
    execution = make_execution("retrying-1", State.RUNNING)
    ledger.schedule_retry(
        execution, execution.fencing_token, delay_seconds=120, error="GatewayTimeout: 504", traceback="tb",
        worker="w:1", reason="attempt 1 of 3 failed after 12.5 ms",
    )  # fmt: skip
    page = operator().get(f"{CHANGELIST}{execution.pk}/change/").content.decode()
    timeline = page.split("tp-timeline-box")[1]
    assert "retry_scheduled" in timeline and "GatewayTimeout: 504" in timeline
    assert "attempt 1 of 3 failed after 12.5 ms" in timeline and "next attempt due 20" in timeline


# --- jobs ----------------------------------------------------------------------------------------

JOBS = "/admin/taskplatform/jobdefinition/"


def test_pause_resume_are_permissioned_and_audited() -> None:
    job = JobDefinition.objects.create(slug="nightly", task="testapp.effect")
    operator(username="viewer").post(JOBS, {"action": "pause", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert job.enabled
    client = operator("pause_jobdefinition")
    client.post(JOBS, {"action": "pause", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert not job.enabled
    client.post(JOBS, {"action": "resume", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert job.enabled
    assert list(OperatorAction.objects.order_by("id").values_list("action", "target", "user")) == [
        ("pause_job", "job:nightly", "op"),
        ("resume_job", "job:nightly", "op"),
    ]


def test_a_paused_jobs_django_celery_beat_entry_shows_it_paused() -> None:
    """django-celery-beat's pages showed a paused job's entry as enabled: two sources of truth.
    Pausing or resuming in the console flips the entry, as django-celery-beat writes a
    disabled entry (``last_run_at`` cleared, its change mark bumped). The other way does not
    mirror: django-celery-beat disables a one-off entry that ran, which must not pause the job."""
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    from taskplatform.jobs import define_job

    job, _ = define_job("mirrored", task="testapp.effect", schedule={"every_seconds": 60})
    entry = PeriodicTask.objects.get(pk=job.periodic_task_id)
    PeriodicTask.objects.filter(pk=entry.pk).update(last_run_at=timezone.now())
    assert entry.enabled
    changed = PeriodicTasks.last_change()
    client = operator("pause_jobdefinition")
    client.post(JOBS, {"action": "pause", "_selected_action": [job.pk]})
    entry.refresh_from_db()
    assert not entry.enabled, "a paused job's entry still shows as enabled"
    assert entry.last_run_at is None and PeriodicTasks.last_change() != changed
    client.post(JOBS, {"action": "resume", "_selected_action": [job.pk]})
    entry.refresh_from_db()
    assert entry.enabled

    entry.enabled = False  # what django-celery-beat does to a one-off entry that ran
    entry.save()
    job.refresh_from_db()
    assert job.enabled, "django-celery-beat's own disabling paused the job"
    # The other way is shown, and the console's resume switches the entry back on (review of
    # issue 14: the mirror worked one way only, and the console said such a job ran).
    viewer = operator("pause_jobdefinition", "view_jobdefinition", username="viewer")
    assert "its django-celery-beat entry is off" in viewer.get(JOBS).content.decode()
    page = viewer.get(f"{JOBS}{job.pk}/change/").content.decode()
    assert "This job does not run: its django-celery-beat entry is off" in page
    client.post(JOBS, {"action": "resume", "_selected_action": [job.pk]})
    entry.refresh_from_db()
    assert entry.enabled, "resume left the job's entry off"
    assert OperatorAction.objects.filter(action="resume_job", reason__contains="entry was off").count() == 1
    assert "its django-celery-beat entry is off" not in viewer.get(JOBS).content.decode()
    paused, _ = define_job("born-paused", task="testapp.effect", enabled=False, schedule={"every_seconds": 60})
    assert not PeriodicTask.objects.get(pk=paused.periodic_task_id).enabled


def test_resume_never_switches_on_a_one_off_whose_time_has_passed() -> None:
    """Review of issue 14: django-celery-beat's ``DatabaseScheduler`` switches a one-off entry
    off once it ran; "resume" switched it on again, and that scheduler ran it a second time
    (it keys the run on the message, not the slot)."""
    from django_celery_beat.models import PeriodicTask
    from django_celery_beat.schedulers import ModelEntry

    from taskplatform.jobs import define_job

    job, _ = define_job("once", task="testapp.effect", schedule={"at": timezone.now() + timedelta(hours=1)})
    entry = PeriodicTask.objects.get(pk=job.periodic_task_id)
    assert entry.one_off and entry.clocked is not None
    entry.clocked.clocked_time = timezone.now() - timedelta(minutes=5)  # its time came, and it ran:
    entry.clocked.save()
    entry.enabled = False  # what DatabaseScheduler does to a one-off entry that ran
    entry.save()
    client = operator("pause_jobdefinition", "view_jobdefinition")
    assert "its one-off time has passed" in client.get(JOBS).content.decode()
    client.post(JOBS, {"action": "resume", "_selected_action": [job.pk]})
    entry.refresh_from_db()
    assert not entry.enabled, "resume switched a one-off that ran back on"
    assert not ModelEntry(entry).is_due().is_due
    # Paused and resumed the long way round: the entry stays off too.
    client.post(JOBS, {"action": "pause", "_selected_action": [job.pk]})
    client.post(JOBS, {"action": "resume", "_selected_action": [job.pk]})
    entry.refresh_from_db()
    job.refresh_from_db()
    assert job.enabled and not entry.enabled
    assert not OperatorAction.objects.filter(reason__contains="entry was off").exists()


@pytest.mark.scenario(39)
def test_run_now_twice_with_the_same_form_runs_once(figures: Any) -> None:
    job = JobDefinition.objects.create(slug="adhoc", task="testapp.effect")
    client = operator("run_jobdefinition")
    confirm = client.post(JOBS, {"action": "run_now", "_selected_action": [job.pk]})
    assert confirm.status_code == 200
    token = confirm.context["token"]
    form = {"action": "run_now", "_selected_action": [job.pk], "confirm": "yes", "token": token, "reason": "backfill"}
    client.post(JOBS, form)
    client.post(JOBS, form)
    executions = Execution.objects.filter(job=job)
    figures.record(submits=2, executions=executions.count())
    assert executions.count() == 1
    assert executions.get().trigger == "admin" and executions.get().idempotency_key == f"adhoc@admin:{token}"
    assert OperatorAction.objects.filter(action="run_job_now").count() == 1


# --- API tokens ----------------------------------------------------------------------------------

TOKENS = "/admin/tasks/apitoken/"


def test_adding_an_api_token_in_the_admin_generates_a_key_stores_its_hash_and_shows_it_once() -> None:
    from django.contrib.auth.models import Permission

    from tasks.models import ApiToken, hash_token

    client = operator(username="tokens")
    User.objects.get(username="tokens").user_permissions.add(
        *Permission.objects.filter(content_type__app_label="tasks", codename__in=["add_apitoken", "view_apitoken"])
    )
    service = User.objects.create_user("checkout")
    form = client.get(TOKENS + "add/")
    assert form.status_code == 200 and b'name="key_hash"' not in form.content

    keys = []
    for name in ("checkout-service", "reporting"):  # a second add used to be an IntegrityError
        page = client.post(TOKENS + "add/", {"user": service.pk, "name": name})
        assert page.status_code == 200, page.content[:2000]
        assert "no-store" in page["Cache-Control"]
        key = page.context["raw_key"]
        assert len(key) >= 40 and key.encode() in page.content
        token = ApiToken.objects.get(name=name)
        assert token.key_hash == hash_token(key) and key not in token.key_hash
        keys.append(key)
    assert len(set(keys)) == 2 and ApiToken.objects.count() == 2

    # The key works against the API, and it is never shown again.
    assert Client(HTTP_AUTHORIZATION=f"Token {keys[0]}").get("/api/executions/1").status_code == 404
    token = ApiToken.objects.get(name="checkout-service")
    for page in (client.get(TOKENS), client.get(f"{TOKENS}{token.pk}/change/")):
        assert page.status_code == 200 and keys[0].encode() not in page.content


# --- locks ---------------------------------------------------------------------------------------

LOCKS = "/admin/taskplatform/locklease/"


def test_the_locks_page_and_an_audited_force_release() -> None:
    backend = get_lock_backend()
    lease = backend.acquire("stuck-lock", 600, identity="gone-host:1")
    assert lease is not None
    viewer = operator("view_locklease", username="viewer")
    page = viewer.get(LOCKS)
    assert page.status_code == 200 and b"stuck-lock" in page.content and b"gone-host:1" in page.content
    assert b"Force-release" not in page.content
    release = "/admin/taskplatform/locklease/force-release/"
    assert (
        viewer.post(release, {"alias": "default", "name": "stuck-lock", "confirm": "yes", "reason": "x"}).status_code
        == 403
    )

    admin = operator("view_locklease", "force_release_locklease")
    page = admin.get(LOCKS)
    assert b"Force-release" in page.content
    # Leases last seconds: their times are shown to the second.
    info = backend.inspect("stuck-lock")
    assert info is not None and info.expires_at is not None
    shown = timezone.localtime(info.expires_at).strftime("%Y-%m-%d %H:%M:%S")
    assert shown.encode() in page.content, "the lock's expiry is not shown to the second"
    # A force-release with no lock chosen changes nothing and says what to do.
    for no_lock in (admin.get(release), admin.post(release, {"confirm": "yes", "reason": "x"})):
        assert no_lock.status_code == 302 and no_lock["Location"] == LOCKS
    assert backend.inspect("stuck-lock").owner == lease.owner  # type: ignore[union-attr]
    assert "Choose a lock" in str(list(admin.get(LOCKS).context["messages"]))

    admin.post(release, {"alias": "default", "name": "stuck-lock", "confirm": "yes", "reason": ""})
    assert backend.inspect("stuck-lock").owner == lease.owner  # type: ignore[union-attr]
    admin.post(release, {"alias": "default", "name": "stuck-lock", "confirm": "yes", "reason": "host decommissioned"})
    assert backend.inspect("stuck-lock").owner is None  # type: ignore[union-attr]
    (audit,) = OperatorAction.objects.filter(action="force_release_lock")
    assert (audit.user, audit.target, audit.reason) == ("op", "lock:default:stuck-lock", "host decommissioned")
    assert audit.data["holder"] == lease.owner and audit.data["fencing_token"] == lease.token


def test_the_locks_page_shows_the_leaders_lease_to_the_second_and_no_lease_for_a_follower() -> None:
    from taskplatform.conf import platform_settings

    now = timezone.now()
    expires = now + timedelta(seconds=6)
    name = platform_settings().beat_lock_name
    BeatProcess.objects.create(
        identity="beat-a:1#x", lock_name=name, is_leader=True, fencing_token=41, lease_expires_at=expires,
        started_at=now, last_seen_at=now,
    )  # fmt: skip
    BeatProcess.objects.create(identity="beat-b:2#y", lock_name=name, started_at=now, last_seen_at=now)
    page = operator("view_locklease").get(LOCKS)
    assert page.status_code == 200
    rows = page.content.decode().split("<tr>")
    leader = next(r for r in rows if "beat-a:1#x" in r)
    follower = next(r for r in rows if "beat-b:2#y" in r)
    assert "<td>41</td>" in leader and timezone.localtime(expires).strftime("%Y-%m-%d %H:%M:%S") in leader
    assert follower.count(">—</td>") == 2, "a follower's token and expiry cells must say it holds no lease"


# --- the job form ------------------------------------------------------------------------------


def job_form(**overrides: Any) -> dict[str, Any]:
    form = {
        "slug": "reconcile", "description": "", "task": "testapp.effect", "args": "[]", "kwargs": "{}",
        "enabled": "on", "schedule_kind": "cron", "cron": "30 2 * * *", "timezone": "Europe/Berlin",
        "every_seconds": "", "start_0": "", "start_1": "", "run_at_0": "", "run_at_1": "",
        "misfire_policy": "run_once", "catch_up_window_seconds": "", "max_attempts": "", "backoff_base_seconds": "",
        "backoff_max_seconds": "", "jitter": "unknown", "retry_on": "[]", "fatal_errors": "[]", "queue": "",
        "priority": "", "soft_time_limit_seconds": "", "time_limit_seconds": "", "lease_seconds": "",
    }  # fmt: skip
    form.update(overrides)
    return form


def test_one_page_creates_a_job_with_its_cron_schedule_in_a_time_zone() -> None:
    client = operator("add_jobdefinition", "change_jobdefinition")
    page = client.get(JOBS + "add/")
    assert page.status_code == 200 and b"tp-schedule-preview" in page.content
    assert b'<option value="testapp.effect">' in page.content and b'<option value="Europe/Berlin">' in page.content
    response = client.post(JOBS + "add/", job_form(kwargs='{"seconds": 0}'))
    assert response.status_code == 302, response.context["adminform"].form.errors
    job = JobDefinition.objects.select_related("periodic_task__crontab").get(slug="reconcile")
    assert job.kwargs == {"seconds": 0}
    crontab = job.periodic_task.crontab  # type: ignore[union-attr]
    assert (crontab.minute, crontab.hour, str(crontab.timezone)) == ("30", "2", "Europe/Berlin")

    preview = client.get(
        JOBS + "preview/", {"schedule_kind": "cron", "cron": "30 2 * * *", "timezone": "Europe/Berlin"}
    ).json()
    assert preview["ok"] and preview["description"].startswith("At 02:30")
    assert len(preview["next"]) == 5 and all("02:30:00 CE" in t for t in preview["next"])
    bad = client.get(JOBS + "preview/", {"schedule_kind": "cron", "cron": "61 * * * *", "timezone": "UTC"}).json()
    assert not bad["ok"] and "invalid crontab" in bad["error"]

    # Editing the schedule away removes it from django-celery-beat's tables.
    edit = client.post(f"{JOBS}{job.pk}/change/", job_form(schedule_kind="none", cron=""))
    assert edit.status_code == 302
    job.refresh_from_db()
    assert job.periodic_task is None
    from django_celery_beat.models import PeriodicTask

    assert not PeriodicTask.objects.exists()


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        ({"cron": "61 * * * *"}, "cron", "invalid crontab"),
        ({"cron": "* * * *"}, "cron", "5 fields"),
        ({"timezone": "Mars/Olympus"}, "timezone", "Select a valid choice"),
        ({"task": "no.such.task"}, "task", "Select a valid choice"),
        ({"args": "[1, 2"}, "args", "Enter a valid JSON"),
        ({"args": '{"a": 1}'}, "args", "must be a JSON list"),
        ({"kwargs": '{"blob": "' + "x" * 70_000 + '"}'}, "args", "bytes"),
        ({"max_attempts": "-1"}, "max_attempts", "greater than or equal to"),
        ({"max_attempts": "1000"}, "max_attempts", "less than or equal to 100"),
        ({"time_limit_seconds": "9999999"}, "time_limit_seconds", "above a week"),
        ({"schedule_kind": "once", "run_at_0": "2001-01-01", "run_at_1": "00:00:00"}, "run_at", "in the past"),
        ({"schedule_kind": "interval", "every_seconds": "0"}, "every_seconds", "greater than or equal to 1"),
        # Strings that cannot be stored or published (JSON escapes the form's parser accepts).
        ({"args": '["\\ud800"]'}, "args", "the value[0] holds a lone surrogate"),
        ({"kwargs": '{"gate": "\\udfff"}'}, "kwargs", "the value.gate holds a lone surrogate"),
        ({"kwargs": '{"\\ud800": 1}'}, "kwargs", "a key in the value holds a lone surrogate"),
        ({"args": '["a\\u0000b"]'}, "args", "NUL character"),
        ({"args": '"\\ud800"'}, "args", "the value holds a lone surrogate"),  # a JSON string, shown back
        ({"retry_on": '["\\ud800"]'}, "retry_on", "lone surrogate"),
        ({"fatal_errors": '["x\\u0000"]'}, "fatal_errors", "NUL character"),
        # An integer beyond int()'s 4300-digit limit (Django's JSON field let that ValueError out: a 500).
        ({"args": "[" + "9" * 4301 + "]"}, "args", "Enter a valid JSON"),
        ({"fatal_errors": "[" + "9" * 4301 + "]"}, "fatal_errors", "Enter a valid JSON"),
        # Arguments the task's function cannot take: every run would dead-letter.
        ({"args": "[1, 2, 3]"}, "args", "too many positional arguments"),
        ({"kwargs": '{"nope": 1}'}, "kwargs", "unexpected keyword argument 'nope'"),
        ({"args": "[1]", "kwargs": '{"seconds": 2}'}, "kwargs", "multiple values for argument 'seconds'"),
        ({"task": "testapp.fatal", "args": "[1]"}, "args", "too many positional arguments"),
        # A cron field longer than its CrontabSchedule column (SQLite would store it anyway).
        ({"cron": ",".join([f"{m:02d}" for m in range(60)] * 2) + " * * * *"}, "cron", "minute field is 359"),
        ({"cron": "0 " + ",".join(["1"] * 60) + " * * *"}, "cron", "at most 96"),
        ({"cron": "0 0 * * " + ",".join(["mon"] * 20)}, "cron", "day of week field"),
    ],
)
@pytest.mark.scenario(34, 35, 36)
def test_bad_job_input_never_saves_and_says_what_is_wrong(
    overrides: dict[str, str], field: str, fragment: str, figures: Any
) -> None:
    client = operator("add_jobdefinition")
    response = client.post(JOBS + "add/", job_form(**overrides))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert field in errors and fragment in " ".join(errors[field]), errors
    figures.record(refused=1, jobs_saved=JobDefinition.objects.count())
    assert not JobDefinition.objects.exists()


def test_arguments_that_fit_the_task_s_signature_are_accepted() -> None:
    client = operator("add_jobdefinition")
    for slug, args, kwargs in (("pos", "[1.5]", "{}"), ("both", '[0, "g"]', "{}"), ("kw", "[]", '{"gate": "g"}')):
        response = client.post(JOBS + "add/", job_form(slug=slug, args=args, kwargs=kwargs))
        assert response.status_code == 302, response.context["adminform"].form.errors
    assert JobDefinition.objects.count() == 3


def test_a_queue_no_worker_consumes_saves_with_a_warning(settings: Any) -> None:
    client = operator("add_jobdefinition", "change_jobdefinition")
    response = client.post(JOBS + "add/", job_form(queue="nobody-listens"), follow=True)
    assert JobDefinition.objects.get(slug="reconcile").queue == "nobody-listens"
    text = response.content.decode()
    assert "No worker is configured to consume queue" in text and "nobody-listens" in text
    # The default queue, or a queue the configuration declares or routes to: no warning.
    from celery import current_app
    from kombu import Queue

    queues, routes = current_app.conf.task_queues, current_app.conf.task_routes
    try:
        current_app.conf.task_queues = [Queue("celery"), Queue("reports")]
        current_app.conf.task_routes = {"tasks.*": {"queue": "routed"}}
        for slug, queue in (("q-default", "celery"), ("q-declared", "reports"), ("q-routed", "routed")):
            quiet = client.post(JOBS + "add/", job_form(slug=slug, queue=queue), follow=True)
            assert JobDefinition.objects.filter(slug=slug).exists()
            assert "No worker is configured" not in quiet.content.decode(), queue
    finally:
        current_app.conf.task_queues, current_app.conf.task_routes = queues, routes


def test_a_job_with_a_lone_surrogate_cannot_be_saved_so_its_page_cannot_break() -> None:
    client = operator("add_jobdefinition", "change_jobdefinition")
    refused = client.post(JOBS + "add/", job_form(args='["\\ud800"]'))
    assert refused.status_code == 200 and not JobDefinition.objects.exists()
    saved = client.post(JOBS + "add/", job_form(args='["\\ud83d\\ude00"]'))  # a pair is fine: one emoji
    assert saved.status_code == 302
    job = JobDefinition.objects.get()
    assert job.args == ["\U0001f600"]
    assert client.get(f"{JOBS}{job.pk}/change/").status_code == 200


def test_the_overview_on_the_landing_page_can_be_left_out_and_never_replaces_a_sites_own() -> None:
    """Installing the app used to replace the admin's landing page silently: it now adds the
    overview on top of it (extending ``admin/index.html``), can be turned off, and leaves an
    admin site that chose its own index template alone."""
    from django.contrib.admin import AdminSite
    from django.test import override_settings

    from taskplatform.apps import install_admin_overview

    site = AdminSite()
    assert install_admin_overview(site) and site.index_template == "admin/taskplatform/index.html"
    with override_settings(TASKPLATFORM_ADMIN_OVERVIEW=False):
        site = AdminSite()
        assert not install_admin_overview(site) and site.index_template is None
    site = AdminSite()
    site.index_template = "custom/index.html"
    assert not install_admin_overview(site) and site.index_template == "custom/index.html"


def test_the_landing_page_shows_counts_and_an_offline_chart_of_the_last_24_hours() -> None:
    make_execution("ok-1", State.SUCCEEDED)
    make_execution("ok-2", State.SUCCEEDED)
    make_execution("dead-x", State.FAILED)
    make_execution("waiting", State.PENDING)
    client = operator()
    page = client.get("/admin/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="tp-overview"' in html and '<svg xmlns="http://www.w3.org/2000/svg" id="tp-chart"' in html
    assert "<b>2</b> succeeded" in html and "<b>1</b> failed" in html and "<b>1</b> pending" in html
    assert "<b>1</b> dead letter" in html
    section = html.split('id="tp-overview"')[1].split("</svg>")[0]
    assert "<script" not in section and "src=" not in section and "https://" not in section  # nothing external
    overview = page.context["overview"]
    assert sum(overview.series["succeeded"]) == 2 and sum(overview.series["failed"]) == 1
    assert "counted now" in html  # no maintenance snapshot yet: counted live
    CountsSnapshot.take()
    html = client.get("/admin/").content.decode()
    assert "counted at " in html and "(shown while at most 30 s old)" in html  # the staleness, stated
    # Without the view permission on executions, no overview.
    User.objects.create_user("nobody", password="pw", is_staff=True)
    other = Client()
    other.login(username="nobody", password="pw")
    assert 'id="tp-overview"' not in other.get("/admin/").content.decode()


def test_a_resubmitted_form_does_not_act_on_a_later_attempt_that_ended_in_the_same_state() -> None:
    dead = make_execution("aba-1", State.FAILED)
    client = operator("retry_execution")
    form = {f"expected_{dead.pk}": f"FAILED:{dead.fencing_token}"}
    act(client, "retry_now", [dead], reason="first try", **form)
    dead.refresh_from_db()
    claim = ledger.claim(dead, worker="w:2", celery_task_id="t2", lease_seconds=60, max_attempts=1)
    assert claim is not None
    ledger.dead_letter(claim.execution, claim.token, error="again", traceback="", worker="w:2")
    again = act(client, "retry_now", [dead], reason="first try", **form)  # the browser resends the old form
    assert b"ran another attempt since" in again.content
    dead.refresh_from_db()
    assert dead.state == State.FAILED and len(operator_events(dead)) == 1


def test_force_release_refuses_when_the_lock_changed_hands_since_the_confirmation() -> None:
    backend = get_lock_backend()
    old = backend.acquire("handed-over", 600, identity="old-host:1")
    assert old is not None
    backend.force_release("handed-over")
    new = backend.acquire("handed-over", 600, identity="new-host:2")
    assert new is not None
    admin = operator("view_locklease", "force_release_locklease")
    admin.post(
        "/admin/taskplatform/locklease/force-release/",
        {"alias": "default", "name": "handed-over", "confirm": "yes", "reason": "stale page", "owner": old.owner},
    )
    assert backend.inspect("handed-over").owner == new.owner  # type: ignore[union-attr]
    assert not OperatorAction.objects.exists()
    page = admin.get("/admin/taskplatform/locklease/force-release/?alias=nope&name=x", follow=True)
    assert page.status_code == 200 and b"Cannot inspect lock" in page.content


def test_pausing_from_the_job_form_needs_the_pause_permission_and_is_audited() -> None:
    job = JobDefinition.objects.create(slug="guarded", task="testapp.effect")
    editor = operator("change_jobdefinition", username="editor")
    form = job_form(slug="guarded", schedule_kind="none", cron="", enabled="")  # unchecked box: pause
    form.pop("enabled")
    assert editor.post(f"{JOBS}{job.pk}/change/", form).status_code == 302
    job.refresh_from_db()
    assert job.enabled  # the field is read-only without the pause permission
    pauser = operator("change_jobdefinition", "pause_jobdefinition", username="pauser")
    assert pauser.post(f"{JOBS}{job.pk}/change/", form).status_code == 302
    job.refresh_from_db()
    assert not job.enabled
    assert OperatorAction.objects.get().action == "pause_job"


def test_a_large_filtered_list_shows_the_planners_estimate_not_an_exact_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the 600,000 rows a filter matches in a million-row ledger cost 0.3 s a view
    (bench/console.py): above ``EXACT_BELOW`` rows, PostgreSQL's planner estimate is shown
    (no ``COUNT`` runs); below it, and on other databases, the exact count."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from taskplatform.console.admin import EstimatedCountPaginator

    Execution.objects.bulk_create(
        Execution(idempotency_key=f"beat-{i}", task_name="testapp.effect", trigger="beat") for i in range(300)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE taskplatform_execution" if connection.vendor != "mysql" else "SELECT 1")
    client = operator()

    def count_queries() -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            assert client.get(CHANGELIST, {"trigger__exact": "beat"}).status_code == 200
        return [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper() and "beat" in q["sql"]]

    assert count_queries(), "a small filtered list is counted exactly"
    monkeypatch.setattr(EstimatedCountPaginator, "EXACT_BELOW", 100)
    if connection.vendor == "postgresql":
        assert not count_queries(), "a large one is estimated, not counted"
    else:
        assert count_queries()
