"""The operator console end to end, in a real browser against a live server, a real worker
and a real beat: log in, create a cron job in a time zone and see its preview, watch it run,
retry a dead letter with a reason and find the audit event, look at the locks page."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.contrib.auth.models import User

from taskplatform import submit
from taskplatform.models import Execution, JobDefinition
from tests.helpers import state_of, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def log_in(live_server: Any, page: Any) -> str:
    """A superuser ``ops`` logged in to the console; the live server's base URL."""
    User.objects.create_superuser("ops", "ops@example.invalid", "a-long-test-password")
    base = str(live_server.url)
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "a-long-test-password")
    page.click("input[type=submit]")
    page.wait_for_selector("#tp-overview")
    return base


def test_an_operator_creates_a_cron_job_watches_it_run_and_retries_a_dead_letter(
    live_server: Any, page: Any, screenshot: Any, workers: Any, beats: Any
) -> None:
    workers.start(concurrency=2)
    beats.start(env={"TASKPLATFORM_BEAT_SYNC_SECONDS": "1"})
    dead = submit("testapp.fatal")
    wait_for(lambda: state_of(dead.pk) == "FAILED", timeout=60, what="a dead letter to retry later")
    base = log_in(live_server, page)

    # Create a cron job in a time zone; the preview shows its next runs in that zone.
    page.goto(f"{base}/admin/taskplatform/jobdefinition/add/")
    page.fill("#id_slug", "every-minute-ny")
    page.select_option("#id_task", "testapp.effect")
    page.select_option("#id_schedule_kind", "cron")
    page.fill("#id_cron", "* * * * *")
    page.select_option("#id_timezone", "America/New_York")
    # The preview answers the form's last state (an earlier, slower answer never replaces it).
    page.wait_for_function(
        "(() => { const runs = [...document.querySelectorAll('#tp-next-runs li')];"
        " return runs.length === 5 && runs.every(r => / E[SD]T$/.test(r.textContent)); })()"
    )
    runs = page.locator("#tp-next-runs li").all_inner_texts()
    assert all(" E" in run and run.endswith(("EST", "EDT")) for run in runs), runs
    assert "Every minute" in page.inner_text("#tp-schedule-preview")
    screenshot(page, "job-form")
    page.click("input[name=_save]")
    page.wait_for_selector("ul.messagelist li.success")
    job = JobDefinition.objects.get(slug="every-minute-ny")

    # Watch it run in the executions list (the beat publishes it at the next minute).
    wait_for(
        lambda: Execution.objects.filter(job=job, state="SUCCEEDED").exists(), timeout=90, what="the job's first run"
    )
    page.goto(f"{base}/admin/taskplatform/execution/?job__id__exact={job.pk}")
    row = page.locator("#result_list tbody tr").first
    assert "SUCCEEDED" in row.inner_text() and "every-minute-ny@" in row.inner_text()

    # Retry the dead letter, with a reason, through the confirmation page.
    page.goto(f"{base}/admin/taskplatform/execution/?dead_letter=yes")
    page.check(f"input[name=_selected_action][value='{dead.pk}']")
    page.select_option("select[name=action]", "retry_now")
    page.click("button[name=index]")
    page.wait_for_selector("#id_reason")
    assert "will change" in page.inner_text("#tp-confirm")
    page.fill("#id_reason", "fixed the card data by hand, ticket OPS-7")
    page.click("#content form input[type=submit].default")
    page.wait_for_selector("ul.messagelist li.success")
    assert "1 execution(s) changed" in page.inner_text("ul.messagelist")

    # The audit event is on the execution's timeline.
    page.goto(f"{base}/admin/taskplatform/execution/{dead.pk}/change/")
    timeline = page.inner_text(".tp-timeline")
    assert "operator" in timeline and "fixed the card data by hand, ticket OPS-7" in timeline and "ops" in timeline
    screenshot(page, "execution-timeline")

    # The locks page shows the beat leader.
    page.goto(f"{base}/admin/taskplatform/locklease/")
    page.wait_for_selector("#tp-beats")
    assert "leader" in page.inner_text("#tp-beats")
    assert "taskplatform.beat" in page.inner_text("#content")
    screenshot(page, "locks")


def test_a_slow_preview_answer_for_an_older_form_state_never_replaces_the_current_one(
    live_server: Any, page: Any
) -> None:
    """The preview's requests are held and answered newest first: the older answers (an empty
    cron, the default time zone) arrive last and must not replace the current preview."""
    base = log_in(live_server, page)

    held: list[Any] = []
    issued_at = [time.monotonic()]
    page.on("request", lambda request: issued_at.append(time.monotonic()) if "/preview/?" in request.url else None)
    page.route("**/jobdefinition/preview/?*", lambda route: held.append(route))
    page.goto(f"{base}/admin/taskplatform/jobdefinition/add/")
    page.select_option("#id_schedule_kind", "cron")
    page.fill("#id_cron", "* * * * *")
    page.select_option("#id_timezone", "America/New_York")

    def current(route: Any) -> bool:
        return "America%2FNew_York" in route.request.url and "cron=*+*+*+*+*" in route.request.url

    def answers() -> int:
        return int(page.evaluate("Number(document.getElementById('tp-schedule-preview').dataset.answers || 0)"))

    deadline = time.monotonic() + 20

    def poll(done: Any, what: str) -> None:
        while not done():
            assert time.monotonic() < deadline, what
            page.wait_for_timeout(50)  # lets Playwright dispatch its events while we poll

    # Every request the form makes is sent (the typing's debounce is 250 ms) and held.
    poll(lambda: any(map(current, held)) and time.monotonic() - issued_at[-1] > 0.5, "the form's requests")
    newest = held.pop()
    assert current(newest), [route.request.url for route in held]
    newest.continue_()
    poll(lambda: answers() == 1, "the newest request's answer")
    runs = page.locator("#tp-next-runs li").all_inner_texts()
    assert len(runs) == 5 and all(run.endswith(("EST", "EDT")) for run in runs), runs

    # Now the older requests' answers, one at a time, those for older form states last.
    older = sorted(held, key=lambda route: not current(route))
    assert older and not current(older[-1]), "no older form state to answer late"
    for route in older:
        seen = answers()
        route.continue_()
        poll(lambda seen=seen: answers() == seen + 1, "an older request's answer")
    runs = page.locator("#tp-next-runs li").all_inner_texts()
    assert len(runs) == 5 and all(run.endswith(("EST", "EDT")) for run in runs), runs
    assert "Every minute" in page.inner_text("#tp-schedule-preview")


def test_a_preview_request_that_fails_says_so_instead_of_leaving_an_older_preview(live_server: Any, page: Any) -> None:
    """The server answers the form's current state with an error page: the preview says it is
    unavailable rather than keep the answer for an earlier state of the form."""
    base = log_in(live_server, page)

    def answer(route: Any) -> None:
        if "America%2FNew_York" in route.request.url:
            route.fulfill(status=500, content_type="text/html", body="<h1>Server Error (500)</h1>")
        else:
            route.continue_()

    page.route("**/jobdefinition/preview/?*", answer)
    page.goto(f"{base}/admin/taskplatform/jobdefinition/add/")
    page.select_option("#id_schedule_kind", "cron")
    page.fill("#id_cron", "* * * * *")
    page.wait_for_selector("#tp-next-runs li")  # the preview of the form before the time zone
    page.select_option("#id_timezone", "America/New_York")
    page.wait_for_selector("#tp-schedule-preview .errornote")
    assert "unavailable (HTTP 500)" in page.inner_text("#tp-schedule-preview")
    assert page.locator("#tp-next-runs").count() == 0
