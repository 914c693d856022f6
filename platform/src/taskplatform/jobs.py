"""The jobs service: the only writer of ``JobDefinition`` rows and their schedule rows.

A job's schedule lives in django-celery-beat's tables (a ``PeriodicTask`` named ``job:<slug>``
that triggers ``taskplatform.trigger_job(slug)``, so a plain beat works too), linked to the
job. The admin's job form, ``taskplatform.schedule_job()``, the reference deployment's set-up
commands and the console's job actions all come here, so a job and its schedule are always
written together, validated the same way, and every operator change is audited.

May import: ``core`` (validation, audit), ``scheduling.slots`` (cron parsing), ``models``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import ClockedSchedule, CrontabSchedule, IntervalSchedule, PeriodicTask, PeriodicTasks

from .core.audit import audit
from .core.validation import encode_arguments, resolve_task
from .domain.policies import resolve_error_classes
from .exceptions import ConfigurationError, SubmissionError, TaskPlatformError
from .models import JobDefinition, Limit
from .scheduling.slots import parse_cron

#: The task a job's django-celery-beat entry calls (``worker.builtins.trigger_job``).
TRIGGER_TASK = "taskplatform.trigger_job"


def definition_errors(job: JobDefinition) -> dict[str, str]:
    """What would stop ``job`` from running, by field: task, arguments and error classes.

    The model's own ``clean()`` checks how its fields fit together; this adds what needs
    the task registry (an unknown task, a task that is not an ``IdempotentTask``).
    """
    errors: dict[str, str] = {}
    try:
        resolve_task(job.task)
    except SubmissionError as exc:
        errors["task"] = str(exc)
    try:
        encode_arguments(job.args, job.kwargs)
    except SubmissionError as exc:
        errors["args"] = str(exc)
    for field in ("retry_on", "fatal_errors"):
        value = getattr(job, field)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            try:
                resolve_error_classes(value)
            except ConfigurationError as exc:
                errors[field] = str(exc)
    return errors


def validate(job: JobDefinition) -> None:
    """Raise ``ValidationError`` naming every bad field of ``job`` (model checks included)."""
    errors: dict[str, Any] = {}
    try:
        job.full_clean(validate_unique=False)
    except ValidationError as exc:
        errors.update(exc.message_dict)
    for field, message in definition_errors(job).items():
        errors.setdefault(field, [message])
    if errors:
        raise ValidationError(errors)


def define_job(slug: str, *, schedule: dict[str, Any] | None = None, **fields: Any) -> tuple[JobDefinition, bool]:
    """Create job ``slug`` from ``fields`` unless it exists (an existing one keeps its edits).

    ``schedule`` (``schedule_job``'s keyword arguments) is written either way: it is what
    deployment code owns. Returns ``(job, created)``. Invalid fields raise ``ValidationError``
    and save nothing.
    """
    with transaction.atomic():
        job = JobDefinition.objects.filter(slug=slug).first()
        created = job is None
        if job is None:
            job = JobDefinition(slug=slug, **fields)
            validate(job)
            job.save()
        if schedule is not None:
            schedule_job(job, **schedule)
    return job, created


def save_job(job: JobDefinition, *, schedule: dict[str, Any] | None, user: str, enabled_changed: bool = False) -> None:
    """Save ``job`` (already validated, e.g. by the console's form) with its schedule.

    ``schedule`` is ``schedule_job``'s keyword arguments, or None to remove the schedule.
    A change of ``enabled`` made in the form is audited like the pause and resume actions.
    """
    with transaction.atomic():
        job.save()
        if enabled_changed:
            audit(user, "resume_job" if job.enabled else "pause_job", f"job:{job.slug}", "changed in the job form")
            _mirror_to_schedule(job.periodic_task_id, job.enabled)
        if schedule is not None:
            schedule_job(job, **schedule)
        else:
            clear_schedule(job)


#: The five cron fields, named as ``CrontabSchedule``'s columns.
CRON_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")


def cron_field_too_long(expression: str) -> str:
    """Why a field of ``expression`` does not fit its ``CrontabSchedule`` column, or ''.

    Checked before saving: PostgreSQL would refuse the row with a DataError, and SQLite would
    store it anyway.
    """
    for name, part in zip(CRON_FIELDS, expression.split(), strict=False):
        limit = CrontabSchedule._meta.get_field(name).max_length
        if limit is not None and len(part) > limit:
            return f"the {name.replace('_', ' ')} field is {len(part)} characters long; at most {limit} are stored"
    return ""


def schedule_job(
    job: JobDefinition,
    *,
    cron: str | None = None,
    timezone_name: str = "UTC",
    every_seconds: int | None = None,
    start: datetime | None = None,
    at: datetime | None = None,
) -> PeriodicTask:
    """Give ``job`` a schedule (exactly one of ``cron``, ``every_seconds``, ``at``).

    The schedule lives in django-celery-beat's tables (a ``PeriodicTask`` named after the
    job that triggers ``taskplatform.trigger_job(slug)``, so plain beat works too) and is
    linked to the job. ``cron`` is five fields, ``"minute hour day-of-month month
    day-of-week"``, read in ``timezone_name`` (an IANA name). ``every_seconds`` counts from
    ``start`` (else the Unix epoch); ``at`` is a one-off time. A malformed expression or
    an unknown time zone raises ``ConfigurationError`` and saves nothing.
    """
    if sum(x is not None for x in (cron, every_seconds, at)) != 1:
        raise ConfigurationError("give exactly one of cron, every_seconds and at")
    fields: dict[str, Any] = {"interval": None, "crontab": None, "clocked": None, "solar": None, "one_off": False}
    with transaction.atomic():
        if cron is not None:
            too_long = cron_field_too_long(cron)
            if too_long:
                raise ConfigurationError(too_long)
            spec = parse_cron(cron, timezone_name)  # raises ConfigurationError on bad input
            minute, hour, dom, month, dow = (
                spec.minute,
                spec.hour,
                spec.day_of_month,
                spec.month_of_year,
                spec.day_of_week,
            )
            fields["crontab"], _ = CrontabSchedule.objects.get_or_create(
                minute=minute, hour=hour, day_of_month=dom, month_of_year=month, day_of_week=dow,
                timezone=timezone_name,
            )  # fmt: skip
        elif every_seconds is not None:
            if every_seconds <= 0:
                raise ConfigurationError(f"every_seconds must be positive, not {every_seconds!r}")
            fields["interval"], _ = IntervalSchedule.objects.get_or_create(
                every=every_seconds, period=IntervalSchedule.SECONDS
            )
        else:
            assert at is not None
            if timezone.is_naive(at):
                raise ConfigurationError("at must be a timezone-aware datetime")
            fields["clocked"], _ = ClockedSchedule.objects.get_or_create(clocked_time=at)
            fields["one_off"] = True
        periodic, _ = PeriodicTask.objects.update_or_create(
            name=f"job:{job.slug}",
            defaults={
                **fields,
                "task": TRIGGER_TASK,
                "args": f'["{job.slug}"]',
                "kwargs": "{}",
                "start_time": start,
                "enabled": job.enabled,  # one switch: django-celery-beat's pages show the job's
                "description": f"Schedule of job {job.slug} (taskplatform).",
            },
        )
        if job.periodic_task_id != periodic.pk:
            job.periodic_task = periodic
            job.save(update_fields=["periodic_task", "updated_at"])
    return periodic


def clear_schedule(job: JobDefinition) -> None:
    """Remove ``job``'s schedule (its django-celery-beat entry); the job stays, run on demand."""
    if job.periodic_task_id is None:
        return
    with transaction.atomic():
        periodic = job.periodic_task
        job.periodic_task = None
        job.save(update_fields=["periodic_task", "updated_at"])
        if periodic is not None:
            periodic.delete()


def set_enabled(job: JobDefinition, enabled: bool, *, user: str, reason: str) -> bool:
    """Pause or resume a job; False if it already was (nothing recorded).

    Resuming a job that is on but whose django-celery-beat entry was switched off there (the
    job does not run: an entry runs when both switches are on) switches the entry back on:
    the console's "resume" is the way to make a job run, whichever switch stopped it."""
    with transaction.atomic():
        changed = JobDefinition.objects.filter(pk=job.pk, enabled=not enabled).update(
            enabled=enabled, updated_at=timezone.now()
        )
        if changed:
            audit(user, "resume_job" if enabled else "pause_job", f"job:{job.slug}", reason)
            _mirror_to_schedule(job.periodic_task_id, enabled)
        elif enabled and entry_disabled(job):
            audit(user, "resume_job", f"job:{job.slug}", f"{reason} (its django-celery-beat entry was off)")
            _mirror_to_schedule(job.periodic_task_id, True)
            changed = 1
    return bool(changed)


def entry_disabled(job: JobDefinition) -> bool:
    """Whether ``job`` is on while its django-celery-beat entry is off, switched off in
    django-celery-beat's pages: it does not run, the console says so, and "resume" switches
    the entry on. A one-off whose time has passed is not counted: it ran, or its time went by
    (django-celery-beat switches it off itself), and switching it on would run it again."""
    if not job.enabled or job.periodic_task_id is None:
        return False
    return _switchable(PeriodicTask.objects.filter(pk=job.periodic_task_id, enabled=False)).exists()


def one_off_passed(task: PeriodicTask) -> bool:
    """A one-off (clocked) entry whose time has passed: never switched on again from here."""
    return task.clocked is not None and task.clocked.clocked_time <= timezone.now()


def _switchable(entries: Any) -> Any:
    """The entries the console may switch on: not a one-off whose time has passed. Under
    django-celery-beat's ``DatabaseScheduler`` such an entry is due at once when it is on
    again (it keys the run on the message, so the body runs a second time)."""
    return entries.exclude(clocked__isnull=False, clocked__clocked_time__lte=timezone.now())


def _mirror_to_schedule(periodic_task_id: int | None, enabled: bool) -> None:
    """Keep the job's django-celery-beat entry's ``enabled`` equal to the job's: its pages show
    the switch the console does. One direction only: django-celery-beat disables entries
    itself (a one-off that ran, an expired one), which must not pause a job; an entry
    disabled there is simply not run (an entry runs when both switches are on). Written as
    django-celery-beat writes a disabled entry (``last_run_at`` cleared, so a resumed entry is
    not due at once under its ``DatabaseScheduler``), with its change mark bumped, and
    without its ``save()``, whose validation of unrelated fields must not stop a pause."""
    if periodic_task_id is None:
        return
    fields: dict[str, Any] = {"enabled": enabled, "date_changed": timezone.now()}
    if not enabled:
        fields["last_run_at"] = None
    entries = PeriodicTask.objects.filter(pk=periodic_task_id).exclude(enabled=enabled)
    if enabled:
        entries = _switchable(entries)  # a one-off whose time passed stays off: it would run again
    if entries.update(**fields):
        PeriodicTasks.update_changed()


def duplicate_job(job: JobDefinition, *, user: str, new_slug: str) -> JobDefinition:
    """A paused copy of ``job`` without its schedule (give the copy one deliberately)."""
    if JobDefinition.objects.filter(slug=new_slug).exists():
        raise TaskPlatformError(f"a job {new_slug!r} exists already")
    with transaction.atomic():
        copy = JobDefinition.objects.get(pk=job.pk)
        copy.pk = None
        copy.slug = new_slug
        copy.enabled = False
        copy.periodic_task = None
        copy.save()
        audit(user, "duplicate_job", f"job:{job.slug}", copy=new_slug)
    return copy


def delete_job(job: JobDefinition, *, user: str) -> None:
    """Delete ``job`` and its schedule (a schedule left behind would trigger a job that is gone).

    Its executions stay in the ledger (their job link is cleared), so history is not lost.
    """
    with transaction.atomic():
        slug = job.slug
        clear_schedule(job)
        job.delete()
        audit(user, "delete_job", f"job:{slug}", "deleted in the admin")


def free_slug(slug: str) -> str:
    """``slug`` + ``-copy`` (then ``-copy-2``, …): the first name no job has yet."""
    candidate, n = f"{slug}-copy", 2
    while JobDefinition.objects.filter(slug=candidate).exists():
        candidate, n = f"{slug}-copy-{n}", n + 1
    return candidate


def define_limit(
    *,
    task: str = "",
    job: JobDefinition | None = None,
    concurrency: int | None = None,
    rate: int | None = None,
    per_seconds: int = 1,
    backend: str = "default",
    note: str = "",
    user: str = "deployment",
) -> tuple[Limit, bool]:
    """Create the fleet-wide limit of ``task`` (or of ``job``) unless it exists: an existing
    one keeps its edits in the admin, as ``define_job`` does. Returns ``(limit, created)``;
    an invalid limit raises ``ValidationError`` and saves nothing."""
    from .worker.limits import save_limit

    scope = f"job:{job.pk}" if job is not None else f"task:{task}"
    existing = Limit.objects.filter(scope=scope).first()
    if existing is not None:
        return existing, False
    limit = Limit(task_name=task, job=job, concurrency=concurrency, rate=rate, per_seconds=per_seconds,
                  backend=backend, note=note)  # fmt: skip
    save_limit(limit, user=user, reason="defined by the deployment")
    return limit, True
