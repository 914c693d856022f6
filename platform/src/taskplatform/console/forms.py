"""The job form of the operator console: a job and its schedule on one page, validated whole.

Bad input never saves: an unknown task, invalid or oversized JSON, strings that cannot be
stored (a lone surrogate, a NUL), arguments that do not fit the task's signature, a
malformed cron expression or one with a field longer than its column, an unknown time zone,
a one-off time in the past, negative or absurd limits — each is a field error that says
what is wrong. A queue no worker is configured to consume is a warning (``form.warnings``,
shown by the admin after saving): workers may be started with ``-Q`` for it.
"""

from __future__ import annotations

import inspect
import json
import zoneinfo
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import cache
from typing import Any

from django import forms
from django.contrib.admin.widgets import AdminSplitDateTime
from django.core.exceptions import ValidationError
from django.utils import timezone

from .. import jobs
from ..core.validation import is_idempotent, registered_task
from ..exceptions import ConfigurationError
from ..http import unstorable_text
from ..models import JobDefinition, Limit
from ..scheduling.slots import PERIOD_SECONDS, Clocked, Interval, Schedule, parse_cron

SCHEDULE_KINDS = [
    ("none", "No schedule (run on demand only)"),
    ("cron", "Cron expression in a time zone"),
    ("interval", "Every N seconds"),
    ("once", "Once, at a given time"),
]
#: Upper bound of the time limits an operator may set (a week).
MAX_TIME_LIMIT_SECONDS = 7 * 86_400


@cache
def timezone_choices() -> list[tuple[str, str]]:
    return [(name, name) for name in sorted(zoneinfo.available_timezones()) if "/" in name or name == "UTC"]


def task_choices() -> list[tuple[str, str]]:
    """Every registered ``IdempotentTask`` (the ones the ledger can run), by name."""
    from celery import current_app

    current_app.loader.import_default_modules()
    names = sorted(name for name, task in current_app.tasks.items() if is_idempotent(task) and "." in name)
    return [(n, n) for n in names]


class StorableJSONField(forms.JSONField):
    """A JSON field whose input and page never fail: bad input is a field error, not a 500.

    Django shows JSON with ``ensure_ascii=False``; a lone surrogate (refused input shown
    back with its error, or a row stored before such input was refused) would then make the
    whole page unencodable. Such a value is shown with ``\\u`` escapes instead. An integer
    of more than 4300 digits (Python's ``int()`` limit) is invalid JSON here.
    """

    #: Indentation of the JSON shown in the form (None: one line).
    indent: int | None = None

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except ValueError as exc:  # Django catches JSONDecodeError only, not int()'s digit limit
            raise ValidationError(f"Enter a valid JSON: {exc}".split("; use sys.")[0], code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except ValueError:  # as above: shown back as typed, with the field's error
            return forms.fields.InvalidJSONInput(data)

    def prepare_value(self, value: Any) -> Any:
        shown = self.show(value)
        if isinstance(shown, str) and not _renderable(shown):
            return json.dumps(value, indent=self.indent)  # \\u escapes: the page stays encodable
        return shown

    def show(self, value: Any) -> Any:
        """The text the form shows for ``value`` (readable, non-ASCII kept)."""
        return super().prepare_value(value)


class PrettyJSONField(StorableJSONField):
    """A JSON field shown indented, so operators can read and edit it."""

    indent = 2

    def show(self, value: Any) -> Any:
        if isinstance(value, str) and not isinstance(value, forms.fields.InvalidJSONInput):
            try:
                value = json.loads(value)
            except ValueError:
                return value
        if isinstance(value, forms.fields.InvalidJSONInput):
            return value
        return json.dumps(value, indent=2, ensure_ascii=False)


def _renderable(text: str) -> bool:
    """Whether a page can hold ``text``: not if it has a lone surrogate (UTF-8 cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def schedule_from(kind: str, data: dict[str, Any]) -> Schedule | None:
    """The slots.Schedule a form's schedule fields describe (raises ConfigurationError)."""
    if kind == "cron":
        return parse_cron(data.get("cron") or "", data.get("timezone") or "UTC")
    if kind == "interval":
        every = data.get("every_seconds")
        if not every:
            raise ConfigurationError("give the interval in seconds")
        return Interval(float(every), anchor=data.get("start") or datetime(1970, 1, 1, tzinfo=UTC))
    if kind == "once":
        at = data.get("run_at")
        if at is None:
            raise ConfigurationError("give the time to run at")
        return Clocked(at)
    return None


def preview(kind: str, data: dict[str, Any], count: int = 5) -> dict[str, Any]:
    """A human-readable description and the next ``count`` runs in the schedule's own zone."""
    schedule = schedule_from(kind, data)
    if schedule is None:
        return {"description": "No schedule: the job runs only when submitted or run from the console.", "next": []}
    zone = zoneinfo.ZoneInfo(data.get("timezone") or "UTC") if kind == "cron" else UTC
    description = ""
    if kind == "cron":
        from cron_descriptor import get_description

        try:
            description = f"{get_description(data['cron'])} ({data.get('timezone') or 'UTC'})"
        except Exception:  # the describer is stricter than Celery on some forms; the slots are what count
            description = f"cron {data['cron']} ({data.get('timezone') or 'UTC'})"
    elif kind == "interval":
        description = f"Every {data['every_seconds']} seconds"
    else:
        description = "Once"
    upcoming: list[str] = []
    moment = timezone.now()
    for _ in range(count):
        slot = schedule.next_after(moment)
        if slot is None:
            break
        upcoming.append(slot.astimezone(zone).strftime("%a %Y-%m-%d %H:%M:%S %Z"))
        moment = slot
    return {"description": description, "next": upcoming}


class JobDefinitionForm(forms.ModelForm):
    task = forms.ChoiceField(choices=task_choices, help_text="A registered IdempotentTask.")
    args = PrettyJSONField(required=False, initial=list, help_text="Positional arguments, a JSON list.")
    kwargs = PrettyJSONField(required=False, initial=dict, help_text="Keyword arguments, a JSON object.")
    schedule_kind = forms.ChoiceField(choices=SCHEDULE_KINDS, initial="none", label="Schedule")
    cron = forms.CharField(
        required=False,
        max_length=1000,
        help_text="minute hour day-of-month month day-of-week, e.g. 30 2 * * * (Celery's syntax).",
    )
    timezone = forms.ChoiceField(choices=timezone_choices, initial="UTC", required=False, help_text="IANA time zone.")
    every_seconds = forms.IntegerField(required=False, min_value=1, max_value=31 * 86_400, label="Every (seconds)")
    start = forms.SplitDateTimeField(
        required=False, widget=AdminSplitDateTime, help_text="Interval anchor (UTC); empty: the Unix epoch."
    )
    run_at = forms.SplitDateTimeField(
        required=False, widget=AdminSplitDateTime, label="Run at", help_text="One-off time (UTC)."
    )

    class Meta:
        model = JobDefinition
        fields = (
            "slug", "description", "task", "args", "kwargs", "enabled", "misfire_policy", "catch_up_window_seconds",
            "max_attempts", "backoff_base_seconds", "backoff_max_seconds", "jitter", "retry_on", "fatal_errors",
            "queue", "priority", "soft_time_limit_seconds", "time_limit_seconds", "lease_seconds",
        )  # fmt: skip
        field_classes = {"retry_on": StorableJSONField, "fatal_errors": StorableJSONField}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Non-blocking findings about valid input (e.g. a queue no worker consumes).
        self.warnings: list[str] = []
        task = self.instance.periodic_task if self.instance.pk else None
        if task is not None and not self.is_bound:
            if task.crontab is not None:
                c = task.crontab
                self.initial.update(
                    schedule_kind="cron",
                    cron=f"{c.minute} {c.hour} {c.day_of_month} {c.month_of_year} {c.day_of_week}",
                    timezone=str(c.timezone),
                )
            elif task.interval is not None:
                seconds = task.interval.every * PERIOD_SECONDS.get(task.interval.period, 1)
                self.initial.update(
                    schedule_kind="interval", every_seconds=max(1, round(seconds)), start=task.start_time
                )
            elif task.clocked is not None:
                self.initial.update(schedule_kind="once", run_at=task.clocked.clocked_time)
        for name in ("soft_time_limit_seconds", "time_limit_seconds"):
            if name in self.fields:
                self.fields[name].validators.append(
                    _max(MAX_TIME_LIMIT_SECONDS, "time limits above a week are refused (7 days = 604800 s)")
                )

    def clean_args(self) -> Any:
        value = _storable(self.cleaned_data.get("args"))
        if value in (None, ""):
            return []
        if not isinstance(value, list):
            raise ValidationError(f"positional arguments must be a JSON list, not {type(value).__name__}")
        return value

    def clean_kwargs(self) -> Any:
        value = _storable(self.cleaned_data.get("kwargs"))
        if value in (None, ""):
            return {}
        if not isinstance(value, dict):
            raise ValidationError(f"keyword arguments must be a JSON object, not {type(value).__name__}")
        return value

    def clean_retry_on(self) -> Any:
        return _storable(self.cleaned_data.get("retry_on"))

    def clean_fatal_errors(self) -> Any:
        return _storable(self.cleaned_data.get("fatal_errors"))

    def clean_cron(self) -> str:
        """Each cron field must fit its ``CrontabSchedule`` column (SQLite would not say so)."""
        value = str(self.cleaned_data.get("cron") or "")
        too_long = jobs.cron_field_too_long(value)
        if too_long:
            raise ValidationError(too_long)
        return value

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        # The jobs service's checks: the task must be a registered IdempotentTask, the
        # arguments plain JSON within the size limit, the error classes importable.
        probe = JobDefinition(
            task=data.get("task") or "",
            args=data.get("args", []),
            kwargs=data.get("kwargs", {}),
            retry_on=data.get("retry_on") or [],
            fatal_errors=data.get("fatal_errors") or [],
        )
        definition_errors = jobs.definition_errors(probe)
        for name, message in definition_errors.items():
            if name in self.fields and name not in self.errors:
                self.add_error(name, message)
        if not definition_errors and not {"task", "args", "kwargs"} & set(self.errors):
            self._check_signature(probe.task, probe.args, probe.kwargs)
        queue = data.get("queue")
        if queue and queue not in consumed_queues():
            self.warnings.append(
                f"No worker is configured to consume queue {queue!r} (Celery's task_queues, "
                f"task_default_queue and task_routes name {', '.join(sorted(consumed_queues()))}): runs of this "
                f"job stay pending until a worker is started with -Q {queue}."
            )
        kind = data.get("schedule_kind") or "none"
        field = {"cron": "cron", "interval": "every_seconds", "once": "run_at"}.get(kind)
        try:
            schedule = schedule_from(kind, data)
        except ConfigurationError as exc:
            message = str(exc)
            self.add_error("timezone" if "time zone" in message else field, message)
            return data
        if kind == "once" and schedule is not None and schedule.next_after(timezone.now()) is None:
            self.add_error("run_at", "this time is in the past; a one-off schedule would never run")
        if kind == "cron" and schedule is not None and schedule.next_after(timezone.now()) is None:
            self.add_error("cron", "this expression never matches a future date")
        return data

    def _check_signature(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Arguments the task's function cannot take would dead-letter every run: refuse them."""
        task = registered_task(name)
        body = getattr(task, "_orig_run", None) or getattr(task, "run", None)
        if body is None:
            return
        try:
            # A bound task's ``run`` is a bound method: ``self`` is already left out.
            signature = inspect.signature(body)
        except (TypeError, ValueError):  # a builtin or C function: nothing to check against
            return
        try:
            signature.bind_partial(*args)
        except TypeError as exc:
            self.add_error("args", f"{name}{signature} cannot take these positional arguments: {exc}")
            return
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            self.add_error("kwargs" if kwargs else "args", f"{name}{signature} cannot take these arguments: {exc}")

    def schedule_arguments(self) -> dict[str, Any] | None:
        """``schedule_job`` keyword arguments for the cleaned schedule, or None for no schedule."""
        data = self.cleaned_data
        kind = data.get("schedule_kind") or "none"
        if kind == "cron":
            return {"cron": " ".join(data["cron"].split()), "timezone_name": data.get("timezone") or "UTC"}
        if kind == "interval":
            return {"every_seconds": data["every_seconds"], "start": data.get("start")}
        if kind == "once":
            return {"at": data["run_at"]}
        return None


def _storable(value: Any) -> Any:
    """``value`` if every string in it can be stored and published, else a field error."""
    problem = unstorable_text(value)
    if problem is not None:
        raise ValidationError(problem.replace("$", "the value", 1))
    return value


def consumed_queues() -> set[str]:
    """The queues Celery's configuration says workers consume, read statically.

    ``task_queues`` (what a worker without ``-Q`` consumes), else ``task_default_queue``,
    plus the queues ``task_routes`` sends tasks to (a deployment that routes there runs
    workers for them). A live ``inspect`` of the workers would block the form on the broker.
    """
    from celery import current_app

    conf = current_app.conf
    names: set[str] = {str(conf.task_default_queue or "celery")}
    queues = conf.task_queues or ()
    for queue in queues.keys() if isinstance(queues, dict) else queues:
        names.add(str(getattr(queue, "name", queue)))
    routes = conf.task_routes or ()
    for table in [routes] if isinstance(routes, dict) else routes:
        if isinstance(table, dict):
            names.update(_route_queues(table.values()))
    return names


def _route_queues(routes: Iterable[Any]) -> set[str]:
    found: set[str] = set()
    for route in routes:
        if isinstance(route, str):
            found.add(route)
        elif isinstance(route, dict) and route.get("queue"):
            queue = route["queue"]
            found.add(str(getattr(queue, "name", queue)))
    return found


def _max(limit: int, message: str) -> Any:
    def check(value: Any) -> None:
        if value is not None and value > limit:
            raise ValidationError(message)

    return check


class LimitForm(forms.ModelForm):
    """A fleet-wide limit: the model's checks plus the task registry and the lock backends
    (``worker.limits.limit_errors``), each error on its field."""

    class Meta:
        model = Limit
        fields = ("task_name", "job", "concurrency", "rate", "per_seconds", "backend", "note")

    def clean(self) -> dict[str, Any]:
        from ..worker.limits import limit_errors

        cleaned = super().clean() or {}

        probe = Limit(task_name=cleaned.get("task_name") or "", backend=cleaned.get("backend") or "default")
        for name, message in limit_errors(probe).items():
            if name not in self.errors:
                self.add_error(name, message)
        job = cleaned.get("job")
        probe.job = job
        scope = probe.derive_scope()
        if (cleaned.get("task_name") or job) and Limit.objects.filter(scope=scope).exclude(
            pk=self.instance.pk
        ).exists():
            # ``scope`` is not a form field, so Django's form would not check its uniqueness: the
            # save would fail with an IntegrityError (a 500).
            self.add_error("job" if job else "task_name", f"{scope} has a limit already: edit that one")
        return cleaned
