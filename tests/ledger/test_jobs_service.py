"""The jobs service is the one writer of job definitions and their schedules, and the console's
pages take their colours from the theme-aware stylesheet."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.test import Client
from django_celery_beat.models import PeriodicTask

from taskplatform import jobs
from taskplatform.core import ledger
from taskplatform.models import Execution, JobDefinition, OperatorAction

pytestmark = [pytest.mark.portable, pytest.mark.django_db(transaction=True)]

CSS = Path(jobs.__file__).parent / "static" / "taskplatform" / "console.css"


def superuser() -> Client:
    User.objects.create_superuser("root", "root@example.invalid", "pw")
    client = Client()
    client.login(username="root", password="pw")
    return client


def test_define_job_validates_creates_once_and_keeps_operator_edits() -> None:
    with pytest.raises(ValidationError) as info:
        jobs.define_job("bad", task="no.such.task", args=[])
    assert "unknown task" in info.value.message_dict["task"][0]
    assert not JobDefinition.objects.exists() and not PeriodicTask.objects.exists()

    job, created = jobs.define_job("nightly", task="testapp.effect", schedule={"cron": "0 3 * * *"})
    assert created and job.periodic_task is not None and job.periodic_task.crontab.hour == "3"
    JobDefinition.objects.filter(pk=job.pk).update(max_attempts=7)  # an operator's edit
    again, created = jobs.define_job("nightly", task="testapp.effect", schedule={"cron": "0 4 * * *"})
    assert not created and again.max_attempts == 7
    assert PeriodicTask.objects.get(name="job:nightly").crontab.hour == "4"  # deployment owns the schedule


def test_deleting_a_job_in_the_admin_removes_its_schedule_keeps_its_history_and_is_audited() -> None:
    job, _ = jobs.define_job("doomed", task="testapp.effect", schedule={"every_seconds": 60})
    execution, _ = ledger.create(
        ledger.NewExecution(idempotency_key="doomed@1", task_name="testapp.effect", args=[], kwargs={}, job=job)
    )
    client = superuser()
    page = client.post(f"/admin/taskplatform/jobdefinition/{job.pk}/delete/", {"post": "yes"}, follow=True)
    assert page.status_code == 200
    assert not JobDefinition.objects.exists()
    assert not PeriodicTask.objects.filter(name="job:doomed").exists(), "a schedule must not outlive its job"
    assert Execution.objects.get(pk=execution.pk).job_id is None
    assert OperatorAction.objects.filter(action="delete_job", target="job:doomed", user="root").exists()


def test_bulk_delete_goes_through_the_service_too() -> None:
    for slug in ("a", "b"):
        jobs.define_job(slug, task="testapp.effect", schedule={"every_seconds": 30})
    client = superuser()
    ids = list(JobDefinition.objects.values_list("pk", flat=True))
    client.post(
        "/admin/taskplatform/jobdefinition/",
        {"action": "delete_selected", "_selected_action": ids, "post": "yes"},
        follow=True,
    )
    assert not JobDefinition.objects.exists() and not PeriodicTask.objects.exists()
    assert OperatorAction.objects.filter(action="delete_job").count() == 2


def test_console_colours_come_from_the_stylesheet_in_both_themes() -> None:
    css = CSS.read_text()
    variables = set(re.findall(r"(--tp-[a-z-]+):", css))
    assert {"--tp-succeeded", "--tp-failed", "--tp-running", "--tp-badge-fg"} <= variables
    dark_media = css.split("@media (prefers-color-scheme: dark)")[1].split("}\n}")[0]
    dark_switch = css.split('html[data-theme="dark"]')[1].split("}")[0]
    for name in variables:
        assert name in dark_media and name in dark_switch, f"{name} has no dark-theme value"

    execution, _ = ledger.create(
        ledger.NewExecution(idempotency_key="styled", task_name="testapp.effect", args=[], kwargs={})
    )
    client = superuser()
    for url in ("/admin/", "/admin/taskplatform/execution/", f"/admin/taskplatform/execution/{execution.pk}/change/"):
        html = client.get(url).content.decode()
        assert "taskplatform/console.css" in html, url
        assert not re.search(r"style=[\"'][^\"']*(#[0-9a-fA-F]{3,6}|background|color)", html), url
        assert "<style>" not in html, url
    change = client.get(f"/admin/taskplatform/execution/{execution.pk}/change/").content.decode()
    assert 'class="tp-badge tp-state-pending"' in change
