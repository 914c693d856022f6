"""The operator console in the Django admin: the ledger, jobs, locks, and audited actions.

Execution rows are read-only: state changes go through ``console.interventions`` (and so the
ledger), only along legal transitions, each behind its own permission, each after a
confirmation page that asks for a reason, each recorded with who and why. Job definitions
are written through the ``jobs`` service. Pages are templates under
``templates/admin/taskplatform/``; colours are in ``static/taskplatform/console.css`` and
follow the admin's light and dark themes.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.core.paginator import EmptyPage, Paginator
from django.db import connection
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html

from .. import jobs
from ..backends import backend_config, get_lock_backend
from ..conf import platform_settings
from ..core import flows as flow_runs
from ..domain.states import Actor as _Actor
from ..domain.states import State, find_transition
from ..exceptions import TaskPlatformError
from ..models import (
    BeatProcess,
    Execution,
    ExecutionEvent,
    FlowRun,
    JobDefinition,
    Limit,
    LockLease,
    OperatorAction,
    SchedulerFence,
)
from ..worker import limits as fleet_limits
from . import interventions as console
from .forms import JobDefinitionForm, LimitForm
from .forms import preview as schedule_preview

#: The console's stylesheet (state colours for the light and dark themes).
CONSOLE_CSS = {"all": ["taskplatform/console.css"]}


def badge(state: str) -> str:
    """A state as a coloured label; the colour comes from the stylesheet's ``tp-state-*`` class."""
    return format_html('<span class="tp-badge tp-state-{}">{}</span>', State(state).value.lower(), state)


def pretty_json(value: Any) -> str:
    return format_html('<pre class="tp-json">{}</pre>', json.dumps(value, indent=2, default=str))


def timeline_rows(events: Any) -> list[dict[str, Any]]:
    """An execution's events as rows for the change page's timeline table."""
    rows = []
    for e in events:
        parts = [e.reason] if e.reason else []
        if "duration_ms" in e.data:
            parts.append(f"took {e.data['duration_ms']} ms")
        if e.data.get("error"):
            parts.append(str(e.data["error"]))
        if e.data.get("due"):
            parts.append(f"next attempt due {e.data['due']}")
        rows.append(
            {
                "at": e.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
                "kind": e.kind,
                "transition": f"{e.from_state or '·'} → {e.to_state or '·'}",
                "attempt": e.attempt,
                "token": e.fencing_token,
                "actor": e.actor,
                "detail": " · ".join(parts),
            }
        )
    return rows


def user_label(request: HttpRequest) -> str:
    return str(getattr(request.user, "get_username", lambda: "")() or "unknown")


# --- executions ------------------------------------------------------------------------------


class EstimatedCountPaginator(Paginator):
    """Django's paginator, except that a large count is PostgreSQL's estimate: the whole
    ledger's size (``pg_class.reltuples``), or for a filtered list the planner's estimate of its
    rows. An exact ``count(*)`` of a million rows cost the unfiltered list 0.1-0.2 s a view, and
    of the 600,000 a trigger's filter matches, 0.3 s (``bench/console.py``). Below
    ``EXACT_BELOW`` rows (estimated) the list is counted exactly, and so on other databases."""

    #: Below this estimate, the list is counted exactly.
    EXACT_BELOW = 100_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet) and connection.vendor == "postgresql":
            estimate = self._estimate(queryset)
            if estimate is not None and estimate >= self.EXACT_BELOW:
                return estimate
        return super().count

    @staticmethod
    def _estimate(queryset: QuerySet[Any]) -> int | None:
        with connection.cursor() as cursor:
            if not queryset.query.where:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", [queryset.model._meta.db_table]
                )
                row = cursor.fetchone()
                return int(row[0]) if row else None
            sql, params = queryset.order_by().values("pk").query.sql_with_params()
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])

    def validate_number(self, number: Any) -> int:
        """Any page from the first on: an estimate may be short of the table (the oldest rows
        would sit past its last page, unreachable) or beyond it (a page past the end is empty)."""
        try:
            return super().validate_number(number)
        except EmptyPage:
            value = int(number)
            if value < 1:
                raise
            return value


class DeadLetterFilter(admin.SimpleListFilter):
    title = "dead letters"
    parameter_name = "dead_letter"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "dead letters only")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Execution]) -> QuerySet[Execution]:
        return queryset.filter(state=State.FAILED) if self.value() == "yes" else queryset


class StuckFilter(admin.SimpleListFilter):
    """Running past its lease, or waiting past its due time: what the rescuer should be handling."""

    title = "stuck"
    parameter_name = "stuck"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "lease expired or overdue")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Execution]) -> QuerySet[Execution]:
        if self.value() != "yes":
            return queryset
        return queryset & Execution.objects.stuck(timezone.now())


@admin.register(Execution)
class ExecutionAdmin(admin.ModelAdmin):
    list_display = (
        "id", "state_badge", "task_name", "job", "idempotency_key", "attempts", "trigger", "created_at", "finished_at",
    )  # fmt: skip
    list_display_links = ("id", "idempotency_key")
    list_filter = (DeadLetterFilter, StuckFilter, "state", "trigger", "job", ("created_at", admin.DateFieldListFilter))
    # What stays fast at a million rows (bench/console.py): a key or its beginning (the key's
    # pattern index), or an execution's id. A substring anywhere in four columns read every
    # row: 2.5 s a search at a million executions.
    search_fields = ("idempotency_key",)  # the box; ``get_search_results`` decides how
    search_help_text = "An idempotency key or its beginning, or an execution id."
    # No date hierarchy (its year links read every row's created_at: the created filter
    # covers the same ground) and no second, unfiltered count beside a filtered one.
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    list_select_related = ("job",)
    actions = ["retry_now", "requeue_dead_letters", "cancel", "mark_failed", "mark_succeeded"]
    fieldsets = (
        (None, {"fields": ("state_badge", "task_name", "job", "idempotency_key", "trigger", "attempts", "trace")}),
        ("Input and output", {"fields": ("arguments", "result_pretty", "last_error", "traceback")}),
        (
            "Delivery",
            {
                "classes": ("collapse",),
                "fields": (
                    "celery_task_id", "worker", "fencing_token", "lease_expires_at", "queue", "priority",
                    "scheduled_for", "due_at", "publish_count", "created_at", "started_at", "finished_at",
                ),
            },
        ),
    )  # fmt: skip

    change_form_template = "admin/taskplatform/execution/change_form.html"

    class Media:
        css = CONSOLE_CSS

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The event timeline gets the page's full width, below the fields (a table in the template)."""
        execution = self.get_object(request, object_id)
        events = ExecutionEvent.objects.filter(execution=execution).order_by("id") if execution else []
        extra = {**(extra_context or {}), "tp_timeline": timeline_rows(events)}
        return super().change_view(request, object_id, form_url, extra_context=extra)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Execution], search_term: str
    ) -> tuple[QuerySet[Execution], bool]:
        """Keys that start with the term (case-sensitive, as keys are: the key's pattern index
        serves it; Django's case-insensitive search read every row), or the execution whose id
        it is."""
        term = search_term.strip()
        if not term:
            return queryset, False
        matches = Q(idempotency_key__startswith=term)
        if term.isascii() and term.isdigit() and int(term) < 2**63:  # "²".isdigit() too
            matches |= Q(pk=int(term))
        return queryset.filter(matches), False

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Execution) -> str:
        return badge(obj.state)

    @admin.display(description="arguments")
    def arguments(self, obj: Execution) -> str:
        return pretty_json({"args": obj.args, "kwargs": obj.kwargs})

    @admin.display(description="result")
    def result_pretty(self, obj: Execution) -> str:
        return pretty_json(obj.result)

    @admin.display(description="trace id")
    def trace(self, obj: Execution) -> str:
        """The OpenTelemetry trace (``TASKPLATFORM_TRACING``): search your tracing backend for it."""
        return obj.trace_id or "—"

    @admin.display(description="traceback of the last failure")
    def traceback(self, obj: Execution) -> str:
        return format_html('<pre class="tp-json">{}</pre>', obj.last_traceback or "—")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Execution._meta.fields] + [
            "state_badge",
            "arguments",
            "result_pretty",
            "traceback",
            "trace",
        ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # -- operator actions: each with its permission, a confirmation page and a reason --

    def _has(self, request: HttpRequest, codename: str) -> bool:
        return bool(request.user.has_perm(f"taskplatform.{codename}"))

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "retry_execution")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "cancel_execution")

    def has_mark_failed_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "mark_failed_execution")

    def has_mark_succeeded_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "mark_succeeded_execution")

    @admin.action(description="Retry now…", permissions=["retry"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Execution]) -> HttpResponse | None:
        return self._confirm_and_apply(request, queryset, "retry_now", "retry_now")

    @admin.action(description="Requeue the selected dead letters…", permissions=["retry"])
    def requeue_dead_letters(self, request: HttpRequest, queryset: QuerySet[Execution]) -> HttpResponse | None:
        return self._confirm_and_apply(request, queryset, "retry_now", "requeue_dead_letters", only=State.FAILED)

    @admin.action(description="Cancel (revokes queued or running work)…", permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Execution]) -> HttpResponse | None:
        return self._confirm_and_apply(request, queryset, "cancel", "cancel")

    @admin.action(description="Mark failed…", permissions=["mark_failed"])
    def mark_failed(self, request: HttpRequest, queryset: QuerySet[Execution]) -> HttpResponse | None:
        return self._confirm_and_apply(request, queryset, "mark_failed", "mark_failed")

    @admin.action(description="Mark succeeded (fixed by hand)…", permissions=["mark_succeeded"])
    def mark_succeeded(self, request: HttpRequest, queryset: QuerySet[Execution]) -> HttpResponse | None:
        return self._confirm_and_apply(request, queryset, "mark_succeeded", "mark_succeeded")

    def _confirm_and_apply(
        self,
        request: HttpRequest,
        queryset: QuerySet[Execution],
        action_name: str,
        admin_action: str,
        only: State | None = None,
    ) -> HttpResponse | None:
        action = console.ACTIONS[action_name]
        if request.POST.get("confirm") == "yes":
            reason = request.POST.get("reason", "").strip()
            # Act on the rows the action was given (the selected ones, which the admin has
            # already checked against the user's view), never on an expected_<id> field alone:
            # a forged or stale field for an unselected row is ignored.
            selected = {str(pk): pk for pk in queryset.values_list("pk", flat=True)}
            expected = {
                selected[k.removeprefix("expected_")]: str(request.POST[k])
                for k in request.POST
                if k.startswith("expected_") and k.removeprefix("expected_") in selected
            }
            if not reason:
                self.message_user(request, "A reason is required; nothing changed.", messages.ERROR)
            elif not expected:
                self.message_user(request, "Nothing was selected; nothing changed.", messages.WARNING)
            else:
                if only is not None:
                    expected = {pk: seen for pk, seen in expected.items() if seen.partition(":")[0] == only}
                outcome = console.apply(action_name, expected, user=user_label(request), reason=reason)
                if outcome.changed:
                    self.message_user(
                        request, f"{action.label}: {len(outcome.changed)} execution(s) changed.", messages.SUCCESS
                    )
                for pk, why in outcome.refused.items():
                    self.message_user(request, f"Execution {pk} not changed: {why}", messages.ERROR)
            return None
        rows = []
        for execution in queryset.order_by("id"):
            legal, why = True, ""
            if only is not None and execution.state != only:
                legal, why = False, f"not a dead letter ({execution.state})"
            else:
                try:
                    find_transition(execution.state, action.target, _Actor.OPERATOR)
                except TaskPlatformError as exc:
                    legal, why = False, str(exc)
            rows.append({"execution": execution, "badge": badge(execution.state), "legal": legal, "why": why})
        legal_count = sum(1 for r in rows if r["legal"])
        context = {
            **self.admin_site.each_context(request),
            "title": f"{action.label}: confirm",
            "opts": self.model._meta,
            "action": admin_action,
            "action_label": action.label,
            "rows": rows,
            "legal_count": legal_count,
            "checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/taskplatform/confirm_action.html", context)


# --- jobs ------------------------------------------------------------------------------------


@admin.register(JobDefinition)
class JobDefinitionAdmin(admin.ModelAdmin):
    form = JobDefinitionForm
    change_form_template = "admin/taskplatform/jobdefinition/change_form.html"
    fieldsets = (
        (None, {"fields": ("slug", "description", "task", "args", "kwargs", "enabled")}),
        (
            "Schedule",
            {
                "fields": ("schedule_kind", "cron", "timezone", "every_seconds", "start", "run_at", "misfire_policy",
                           "catch_up_window_seconds"),
                "description": "The preview below shows the next runs in the schedule's own time zone.",
            },
        ),
        (
            "Retry policy (empty: the task's own Celery options)",
            {"fields": ("max_attempts", "backoff_base_seconds", "backoff_max_seconds", "jitter", "retry_on",
                        "fatal_errors")},
        ),
        ("Execution", {"fields": ("queue", "priority", "soft_time_limit_seconds", "time_limit_seconds",
                                  "lease_seconds")}),
    )  # fmt: skip
    list_display = ("slug", "task", "schedule", "misfire_policy", "queue", "max_attempts", "runs", "updated_at")
    list_filter = ("enabled", "queue", "misfire_policy")
    search_fields = ("slug", "task", "description")
    list_select_related = ("periodic_task__crontab", "periodic_task__interval", "periodic_task__clocked")
    actions = ["pause", "resume", "run_now", "duplicate"]

    @admin.display(description="runs", ordering="enabled")
    def runs(self, obj: JobDefinition) -> str:
        """Whether the beat runs the job: on here and on in django-celery-beat (two switches;
        pausing here flips both, the other page flips only its own)."""
        if not obj.enabled:
            return "paused"
        task = obj.periodic_task
        if task is not None and jobs.one_off_passed(task):
            return "no: its one-off time has passed"
        if task is not None and not task.enabled:
            return "no: its django-celery-beat entry is off (resume it to run it)"
        return "yes"

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        job = self.get_object(request, object_id)
        if job is not None and request.method == "GET" and jobs.entry_disabled(job):
            self.message_user(
                request,
                "This job does not run: its django-celery-beat entry is off (switched off on django-celery-beat's "
                "Periodic tasks page). Resume it from the job list to switch the entry on.",
                messages.WARNING,
            )
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="schedule")
    def schedule(self, obj: JobDefinition) -> str:
        task = obj.periodic_task
        if task is None:
            return "—"
        if task.crontab is not None:
            c = task.crontab
            return f"{c.minute} {c.hour} {c.day_of_month} {c.month_of_year} {c.day_of_week} ({c.timezone})"
        if task.interval is not None:
            return f"every {task.interval.every} {task.interval.period}"
        if task.clocked is not None:
            return f"once at {task.clocked.clocked_time:%Y-%m-%d %H:%M %Z}"
        return "—"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        """Pausing and resuming has its own permission, in the form as in the actions."""
        return [] if self.has_pause_permission(request) else ["enabled"]

    def save_model(self, request: HttpRequest, obj: JobDefinition, form: Any, change: bool) -> None:
        """Save through the jobs service: the job and its schedule together, a pause audited."""
        jobs.save_job(
            obj,
            schedule=form.schedule_arguments(),
            user=user_label(request),
            enabled_changed=change and "enabled" in form.changed_data,
        )
        for warning in getattr(form, "warnings", []):  # saved, but probably not what was meant
            self.message_user(request, warning, messages.WARNING)

    def delete_model(self, request: HttpRequest, obj: JobDefinition) -> None:
        """Delete through the jobs service: the schedule goes with the job, and it is audited."""
        jobs.delete_job(obj, user=user_label(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[JobDefinition]) -> None:
        for job in queryset:
            jobs.delete_job(job, user=user_label(request))

    def get_urls(self) -> list[Any]:
        preview = self.admin_site.admin_view(self.preview_view)
        return [path("preview/", preview, name="taskplatform_jobdefinition_preview"), *super().get_urls()]

    def preview_view(self, request: HttpRequest) -> HttpResponse:
        """The schedule preview (description, next 5 runs) for the form's current values, as JSON."""
        from django.http import JsonResponse

        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        from django import forms

        data: dict[str, Any] = {"timezone": request.GET.get("timezone") or "UTC", "cron": request.GET.get("cron", "")}
        parsers = {
            "every_seconds": forms.IntegerField(required=False, min_value=1),
            "start": forms.DateTimeField(required=False),
            "run_at": forms.DateTimeField(required=False),
        }
        for name, field in parsers.items():
            try:
                data[name] = field.clean(request.GET.get(name) or None)
            except Exception as exc:
                return JsonResponse({"ok": False, "error": f"{name}: {' '.join(getattr(exc, 'messages', [str(exc)]))}"})
        try:
            return JsonResponse({"ok": True, **schedule_preview(request.GET.get("schedule_kind", "none"), data)})
        except (TaskPlatformError, ValueError, KeyError) as exc:
            return JsonResponse({"ok": False, "error": str(exc)})

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("taskplatform.pause_jobdefinition"))

    def has_run_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("taskplatform.run_jobdefinition"))

    @admin.action(description="Pause the selected jobs", permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: QuerySet[JobDefinition]) -> None:
        self._set_enabled(request, queryset, False)

    @admin.action(description="Resume the selected jobs", permissions=["pause"])
    def resume(self, request: HttpRequest, queryset: QuerySet[JobDefinition]) -> None:
        self._set_enabled(request, queryset, True)

    def _set_enabled(self, request: HttpRequest, queryset: QuerySet[JobDefinition], enabled: bool) -> None:
        verb = "resumed" if enabled else "paused"
        changed = [
            job.slug
            for job in queryset
            if jobs.set_enabled(job, enabled, user=user_label(request), reason=f"{verb} in the admin")
        ]
        self.message_user(request, f"{len(changed)} job(s) {verb}: {', '.join(changed) or 'none'}.")

    @admin.action(description="Run now…", permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[JobDefinition]) -> HttpResponse | None:
        if request.POST.get("confirm") == "yes":
            token = request.POST.get("token", "")
            if not token:
                self.message_user(request, "The confirmation form is incomplete; nothing ran.", messages.ERROR)
                return None
            for job in queryset:
                try:
                    execution, created = console.run_job_now(
                        job, user=user_label(request), request_token=token, reason=request.POST.get("reason", "")
                    )
                except TaskPlatformError as exc:
                    self.message_user(request, f"{job.slug}: not run: {exc}", messages.ERROR)
                    continue
                url = reverse("admin:taskplatform_execution_change", args=[execution.pk])
                self.message_user(
                    request,
                    format_html(
                        "{}: {} <a href='{}'>execution {}</a>",
                        job.slug,
                        "started" if created else "already started by this form:",
                        url,
                        execution.pk,
                    ),
                    messages.SUCCESS if created else messages.WARNING,
                )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Run now: confirm",
            "opts": self.model._meta,
            "action": "run_now",
            "action_label": "Run now",
            "jobs": list(queryset),
            "token": uuid.uuid4().hex,
            "checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/taskplatform/confirm_run.html", context)

    @admin.action(description="Duplicate (a paused copy, without schedule)", permissions=["add"])
    def duplicate(self, request: HttpRequest, queryset: QuerySet[JobDefinition]) -> None:
        for job in queryset:
            copy = jobs.duplicate_job(job, user=user_label(request), new_slug=jobs.free_slug(job.slug))
            self.message_user(request, f"{job.slug} copied to {copy.slug} (paused).")


# --- flows ------------------------------------------------------------------------------------


@admin.register(FlowRun)
class FlowRunAdmin(admin.ModelAdmin):
    """Flow runs (sagas), read-only: the operator acts on a step's or a compensation's
    execution (retry, mark done), and the flow moves on from there (``core/flows.py``)."""

    list_display = ("id", "state_badge", "flow", "key", "current", "failed_step", "created_at", "finished_at")
    list_display_links = ("id", "key")
    list_filter = ("state", "flow")
    search_fields = ("key",)
    search_help_text = "A flow key or its beginning."
    readonly_fields = ("state_badge", "flow", "key", "input_pretty", "results_pretty", "failed_step", "error",
                       "created_at", "updated_at", "finished_at", "check_at")  # fmt: skip
    fields = readonly_fields
    change_form_template = "admin/taskplatform/flowrun/change_form.html"

    class Media:
        css = CONSOLE_CSS

    @admin.display(description="state")
    def state_badge(self, obj: FlowRun) -> str:
        return format_html('<span class="tp-badge tp-flow-{}">{}</span>', obj.state.lower(), obj.get_state_display())

    @admin.display(description="step")
    def current(self, obj: FlowRun) -> str:
        return "—" if obj.finished_at else str(obj.step)

    @admin.display(description="input")
    def input_pretty(self, obj: FlowRun) -> str:
        return pretty_json(obj.input)

    @admin.display(description="results")
    def results_pretty(self, obj: FlowRun) -> str:
        return pretty_json(obj.results)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[FlowRun], search_term: str) -> Any:
        term = search_term.strip()
        return (queryset.filter(key__startswith=term) if term else queryset), False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The steps and compensations with their executions, and one timeline of them all."""
        run = self.get_object(request, object_id)
        extra = dict(extra_context or {})
        if run is not None:
            extra["tp_parts"] = flow_runs.parts(run)
            extra["tp_timeline"] = [
                {**row, "part": part, "execution_id": execution_id}
                for part, execution_id, row in (
                    (r["part"], r["execution"].pk, timeline_rows([r["event"]])[0]) for r in flow_runs.timeline(run)
                )
            ]
        return super().change_view(request, object_id, form_url, extra)


# --- fleet-wide limits ---------------------------------------------------------------------------


@admin.register(Limit)
class LimitAdmin(admin.ModelAdmin):
    """Fleet-wide concurrency and rate limits, per task or per job; their holders are on the
    locks page. Saved and deleted through ``worker.limits`` (validated, audited)."""

    form = LimitForm
    fields = ("task_name", "job", "concurrency", "rate", "per_seconds", "backend", "note")
    list_display = ("scope", "concurrency", "rate", "per_seconds", "backend", "waiting", "updated_at")
    search_fields = ("scope", "task_name", "note")
    autocomplete_fields = ("job",)

    @admin.display(description="waiting now")
    def waiting(self, obj: Limit) -> int:
        """The executions this limit refused that wait for a slot of it (not those of its
        scope that wait on another limit)."""
        return Execution.objects.filter(state=State.WAITING, waiting_on_limit=obj.pk).count()

    def save_model(self, request: HttpRequest, obj: Limit, form: Any, change: bool) -> None:
        fleet_limits.save_limit(obj, user=user_label(request))

    def delete_model(self, request: HttpRequest, obj: Limit) -> None:
        fleet_limits.delete_limit(obj, user=user_label(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Limit]) -> None:
        for limit in queryset:
            fleet_limits.delete_limit(limit, user=user_label(request))


# --- locks and leadership ----------------------------------------------------------------------


@admin.register(LockLease)
class LockAdmin(admin.ModelAdmin):
    """The locks page: every lease on every configured backend, the beat leader, its followers."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[Any]:
        release = self.admin_site.admin_view(self.force_release_view)
        return [path("force-release/", release, name="taskplatform_lock_release"), *super().get_urls()]

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return TemplateResponse(request, "admin/taskplatform/locks.html", self._locks_context(request))

    def _locks_context(self, request: HttpRequest) -> dict[str, Any]:
        conf = platform_settings()
        aliases = sorted(set(conf.lock_backends or {}) | {"default"})
        backends = []
        all_limits = list(Limit.objects.all())
        aliases = sorted(set(aliases) | {limit.backend for limit in all_limits})
        slots: dict[str, list[Any]] = {}
        for alias in aliases:
            entry: dict[str, Any] = {"alias": alias, "backend": "?", "locks": []}
            try:
                entry["backend"] = backend_config(alias)["BACKEND"]
                backend = get_lock_backend(alias)
                infos = {info.name: info for info in backend.locks()}
                if alias == conf.beat_lock_alias and conf.beat_lock_name not in infos:
                    info = backend.inspect(conf.beat_lock_name)
                    if info is not None:
                        infos[info.name] = info
                slots[alias] = [i for i in infos.values() if i.name.startswith("limit:")]
                # A limit's slots are listed under the limit (free ones not at all).
                entry["locks"] = sorted(
                    (i for i in infos.values() if not i.name.startswith("limit:")), key=lambda i: i.name
                )
            except Exception as exc:  # an unreachable lock server is what the page must show
                entry["error"] = str(exc)
            backends.append(entry)
        now = timezone.now()
        return {
            **self.admin_site.each_context(request),
            "title": "Locks and beat leadership",
            "opts": self.model._meta,
            "backends": backends,
            "fence": SchedulerFence.objects.filter(name=conf.beat_lock_name).first(),
            "beats": [
                {**vars(b), "seen_seconds": round((now - b.last_seen_at).total_seconds(), 1)}
                for b in BeatProcess.objects.filter(
                    lock_name=conf.beat_lock_name, last_seen_at__gte=now - timedelta(hours=1)
                )
            ],
            "beat_lock": conf.beat_lock_name,
            "limits": [
                {
                    "limit": limit,
                    "holders": fleet_limits.holders(limit, slots[limit.backend]) if limit.backend in slots else [],
                    "reachable": limit.backend in slots,
                }
                for limit in all_limits
            ],
            "can_release": request.user.has_perm("taskplatform.force_release_locklease"),
            "now": now,
        }

    def force_release_view(self, request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm("taskplatform.force_release_locklease"):
            raise PermissionDenied
        alias = request.POST.get("alias") or request.GET.get("alias", "")
        name = request.POST.get("name") or request.GET.get("name", "")
        if not alias or not name:
            self.message_user(request, "Choose a lock to release (its Force-release… button).", messages.ERROR)
            return HttpResponseRedirect(reverse("admin:taskplatform_locklease_changelist"))
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            reason = request.POST.get("reason", "").strip()
            if not reason:
                self.message_user(request, "A reason is required; the lock was not released.", messages.ERROR)
            else:
                try:
                    released = console.force_release_lock(
                        alias, name, user=user_label(request), reason=reason,
                        expected_owner=request.POST.get("owner") or None,
                    )  # fmt: skip
                except TaskPlatformError as exc:
                    self.message_user(request, f"Not released: {exc}", messages.ERROR)
                else:
                    self.message_user(
                        request,
                        f"Lock {name} on {alias} released." if released else f"Lock {name} was not held.",
                        messages.SUCCESS if released else messages.WARNING,
                    )
            return HttpResponseRedirect(reverse("admin:taskplatform_locklease_changelist"))
        try:
            info = get_lock_backend(alias).inspect(name)
        except Exception as exc:  # unknown alias, unreachable server: say so, do not fail
            self.message_user(request, f"Cannot inspect lock {name!r} on {alias!r}: {exc}", messages.ERROR)
            return HttpResponseRedirect(reverse("admin:taskplatform_locklease_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": "Force-release a lock: confirm",
            "opts": self.model._meta,
            "alias": alias,
            "name": name,
            "info": info,
        }
        return TemplateResponse(request, "admin/taskplatform/confirm_release.html", context)


# --- audit ---------------------------------------------------------------------------------------


@admin.register(OperatorAction)
class OperatorActionAdmin(admin.ModelAdmin):
    list_display = ("at", "user", "action", "target", "reason")
    list_filter = ("action",)
    search_fields = ("user", "target", "reason")
    date_hierarchy = "at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
