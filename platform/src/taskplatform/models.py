"""Job definitions and the execution ledger.

Rows of ``Execution`` and ``ExecutionEvent`` are written only by ``core.ledger``, and
``JobDefinition`` rows only by the ``jobs`` service; everything else (tasks, the rescuer, the
admin, views) goes through them. The models here hold data and the checks of how their
fields fit together, not behaviour that changes state.

May import: ``domain``, ``conf``, ``exceptions`` and Django. Never Celery or a lock backend
(an import-linter contract keeps it so).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models.functions import Now

from .domain.policies import MisfirePolicy
from .domain.states import TERMINAL_STATES, State


class UtcNow(Now):
    """The database server's current time, in UTC whatever the session's time zone.

    Every instant that decides ownership (leases, fences, due times) is compared with this,
    inside the statement that acts on it (``docs/reliability.md``). Django's ``Now()`` is not
    enough on MariaDB/MySQL: it renders ``NOW()``/``CURRENT_TIMESTAMP``, the *session* time
    zone's wall time, while Django stores naive UTC there, so on a server not set to UTC every
    lease would be off by the zone's offset (and jump at daylight-saving changes).
    PostgreSQL's ``STATEMENT_TIMESTAMP()`` is an instant and SQLite's ``'now'`` is UTC, so only
    MariaDB/MySQL need another function: ``UTC_TIMESTAMP(6)``.
    """

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra_context)


class Trigger(models.TextChoices):
    """What created an execution."""

    API = "api", "submit() from code"
    VIEW = "view", "a view (HTTP request)"
    BEAT = "beat", "the beat scheduler"
    ADMIN = "admin", "an operator in the admin"
    CELERY = "celery", "a plain Celery call (delay / apply_async)"
    FLOW = "flow", "a step or compensation of a flow"


class EventKind(models.TextChoices):
    """What an ``ExecutionEvent`` records."""

    CLAIMED = "claimed", "claimed by a worker"
    TAKEN_OVER = "taken_over", "claimed from a dead or expired owner"
    SUCCEEDED = "succeeded", "attempt succeeded"
    RETRY_SCHEDULED = "retry_scheduled", "attempt failed, retry scheduled"
    DEAD_LETTERED = "dead_lettered", "moved to the dead-letter state"
    DUPLICATE_DELIVERY = "duplicate_delivery", "duplicate delivery absorbed"
    EARLY_DELIVERY = "early_delivery", "delivery before the due time or the previous attempt's fence absorbed"
    ALREADY_FINISHED = "already_finished", "delivery for a finished execution absorbed"
    STALE_WRITE_REJECTED = "stale_write_rejected", "write-back with an old fencing token refused"
    LEASE_LOST = "lease_lost", "lease renewal refused"
    RESCUED = "rescued", "lease expired; re-queued by the rescuer"
    REPUBLISHED = "republished", "published by the rescuer"
    WAITING_FOR_LIMIT = "waiting_for_limit", "a fleet-wide limit was full; waiting for a slot"
    WOKEN = "woken", "published when a slot of its limit freed"
    SUPERSEDED_DELIVERY = "superseded_delivery", "delivery of a message a newer one replaced absorbed"
    OPERATOR = "operator", "operator action"


class JobDefinition(models.Model):
    """A named, configurable job: which task, with what arguments, under which policies.

    Fields left empty fall back to the task class's own Celery options, so a job only
    states what differs. Policies are read when an attempt runs, so an edit applies to the
    next attempt without a restart.
    """

    slug = models.SlugField(max_length=100, unique=True, help_text="Stable identifier, used in slot keys.")
    task = models.CharField(max_length=200, help_text="Registered Celery task name (an IdempotentTask).")
    description = models.TextField(blank=True)
    args = models.JSONField(default=list, blank=True, help_text="Default positional arguments (JSON list).")
    kwargs = models.JSONField(default=dict, blank=True, help_text="Default keyword arguments (JSON object).")
    queue = models.CharField(max_length=100, blank=True, help_text="Queue to publish to; empty: routing decides.")
    priority = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(9)], help_text="Broker priority 0 to 9."
    )
    max_attempts = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="Attempts in all, the first included. Empty: the task's max_retries + 1.",
    )
    backoff_base_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MaxValueValidator(86_400)],
        help_text="Exponential backoff factor in seconds (0: fixed delay). Empty: the task's retry_backoff.",
    )
    backoff_max_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MaxValueValidator(7 * 86_400)],
        help_text="Cap of the backoff delay in seconds. Empty: the task's retry_backoff_max.",
    )
    jitter = models.BooleanField(
        null=True, blank=True, help_text="Full jitter on the backoff delay. Empty: the task's retry_jitter."
    )
    retry_on = models.JSONField(
        default=list,
        blank=True,
        help_text="Dotted paths of retryable error classes. Empty: the task's autoretry_for.",
    )
    fatal_errors = models.JSONField(
        default=list,
        blank=True,
        help_text="Dotted paths of error classes that fail at once. Added to the task's dont_autoretry_for.",
    )
    soft_time_limit_seconds = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Celery soft time limit."
    )
    time_limit_seconds = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Celery hard time limit."
    )
    lease_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(3), MaxValueValidator(86_400)],
        help_text="Lease a worker holds while running (renewed every third). Empty: the platform default.",
    )
    enabled = models.BooleanField(default=True, help_text="Paused jobs are not triggered by the schedule.")
    periodic_task = models.OneToOneField(
        "django_celery_beat.PeriodicTask",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="job",
        help_text="The schedule (django-celery-beat): crontab in a time zone, interval or one-off time.",
    )
    misfire_policy = models.CharField(
        max_length=16,
        choices=[(p.value, p.value) for p in MisfirePolicy],
        default=MisfirePolicy.RUN_ONCE,
        help_text="Slots missed while no beat ran: skip them, run once for the window, or catch up each.",
    )
    catch_up_window_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(31 * 86_400)],
        help_text="catch_up only: how far back missed slots are still run. Empty: the platform default.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]
        permissions = [
            ("pause_jobdefinition", "Can pause and resume jobs"),
            ("run_jobdefinition", "Can run jobs now"),
        ]

    def __str__(self) -> str:
        return self.slug

    def clean(self) -> None:
        """Refuse fields that do not fit together. The task and its arguments are checked
        against the task registry by ``jobs.validate`` (the model never loads Celery)."""
        errors: dict[str, Any] = {}
        for field in ("retry_on", "fatal_errors"):
            value = getattr(self, field)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                errors[field] = "a JSON list of dotted exception class paths"
        if (
            self.soft_time_limit_seconds
            and self.time_limit_seconds
            and self.soft_time_limit_seconds >= self.time_limit_seconds
        ):
            errors["soft_time_limit_seconds"] = "the soft time limit must be below the hard time limit"
        if (
            self.backoff_base_seconds is not None
            and self.backoff_max_seconds is not None
            and self.backoff_max_seconds < self.backoff_base_seconds
        ):
            errors["backoff_max_seconds"] = "the backoff cap must not be below the backoff base"
        if errors:
            raise ValidationError(errors)


class ExecutionQuerySet(models.QuerySet["Execution"]):
    """The conditions the console, the metrics, ``taskplatform status`` and the rescuer share,
    written once. ``now`` defaults to the database's clock (the one that decides leases)."""

    def lease_expired(self, now: Any = None) -> ExecutionQuerySet:
        """Running past its lease: its worker is gone or cut off; the rescuer takes it over."""
        return self.filter(state=State.RUNNING, lease_expires_at__lt=now if now is not None else UtcNow())

    def overdue(self, now: Any = None) -> ExecutionQuerySet:
        """Due (at or past its due time) and not claimed: a lost message, a parked retry not yet
        published. At, not only past: SQLite's clock has milliseconds, and a row made due "now"
        (a recalled waiter) must be seen by the rescuer's next statement in the same millisecond."""
        return self.filter(
            state__in=(State.PENDING, State.RETRYING, State.WAITING), due_at__lte=now if now is not None else UtcNow()
        )

    def stuck(self, now: Any = None) -> ExecutionQuerySet:
        """Either of the above: what the rescuer should be handling."""
        return self.lease_expired(now) | self.overdue(now)

    def by_state_and_job(self) -> list[tuple[str, str, int]]:
        """``(state, job slug or "", count)`` for every pair present: one pass over the table."""
        rows = self.values("state", "job__slug").annotate(n=models.Count("id")).order_by()
        return [(row["state"], row["job__slug"] or "", row["n"]) for row in rows]


class Execution(models.Model):
    """One logical execution, keyed by its idempotency key: the system of record.

    The broker only carries a pointer to this row; the worker claims it by compare-and-set
    and every claim increments ``fencing_token``.
    """

    idempotency_key = models.CharField(max_length=255, unique=True)
    job = models.ForeignKey(JobDefinition, null=True, blank=True, on_delete=models.SET_NULL, related_name="executions")
    task_name = models.CharField(max_length=200)
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    queue = models.CharField(max_length=100, blank=True)
    priority = models.PositiveSmallIntegerField(null=True, blank=True)
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.API)

    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveIntegerField(default=0, help_text="Attempts claimed so far.")
    fencing_token = models.BigIntegerField(default=0, help_text="Incremented on every claim.")
    lease_expires_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=(
            "RUNNING: when the attempt's lease expires. Other states: the fence an operator's action "
            "left (the stopped attempt may run until then; no new attempt starts before it)."
        ),
    )
    max_attempts = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Attempts budget set by an explicit retry(max_retries=...); empty: the retry policy's.",
    )
    worker = models.CharField(max_length=255, blank=True, help_text="node:pid of the current or last owner.")
    celery_task_id = models.CharField(max_length=255, blank=True, help_text="Id of the latest message.")

    scheduled_for = models.DateTimeField(null=True, blank=True, help_text="Requested run time (eta).")
    due_at = models.DateTimeField(
        null=True, blank=True, help_text="When the rescuer next publishes this row if no worker claimed it."
    )
    publish_count = models.PositiveIntegerField(default=0)
    #: Not a foreign key: a deleted limit leaves its waiters to their due time, and the hot path
    #: pays no constraint for it.
    waiting_on_limit = models.BigIntegerField(
        null=True, blank=True, help_text="WAITING: the fleet-wide limit that refused it (a slot of it freed wakes it)."
    )
    # ``db_default`` too: a process of the previous release, mid-deploy, inserts without it. Not
    # a PositiveIntegerField: its CHECK made adding the column scan the ledger under a lock.
    limit_backoffs = models.IntegerField(
        default=0,
        db_default=0,
        help_text="Waits in a row whose limit slots could not be counted (lock backend down): the next backs off.",
    )

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    result = models.JSONField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    last_traceback = models.TextField(blank=True)
    # ``db_default`` too: a process of the previous release, mid-deploy, inserts without it.
    trace_context = models.CharField(
        max_length=64,
        blank=True,
        default="",
        db_default="",
        help_text="W3C traceparent of the span that recorded it (tracing on).",
    )
    #: Not a foreign key, and not indexed: the hot path's inserts pay nothing for it, and a
    #: flow finds its executions by their keys (``core/flows.py``).
    flow_id = models.BigIntegerField(null=True, blank=True, help_text="The flow run this is a step or compensation of.")

    objects = ExecutionQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        permissions = [
            ("retry_execution", "Can retry executions now (dead letters, cancelled, waiting retries)"),
            ("cancel_execution", "Can cancel executions"),
            ("mark_failed_execution", "Can mark running executions failed"),
            ("mark_succeeded_execution", "Can mark dead letters succeeded"),
        ]
        indexes = [
            models.Index(fields=["state", "due_at"], name="tp_exec_state_due"),
            models.Index(fields=["state", "lease_expires_at"], name="tp_exec_state_lease"),
            models.Index(fields=["created_at"], name="tp_exec_created"),
            # Retention and the console's per-hour chart look rows up by finish time.
            models.Index(fields=["state", "finished_at"], name="tp_exec_state_finished"),
            # The console's trigger filter, newest first: without it a trigger few rows have (an
            # operator's, a flow's) read the whole ledger, 334 ms at p95 at a million rows.
            models.Index(fields=["trigger", "id"], name="tp_exec_trigger"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.idempotency_key}] {self.state}"

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def trace_id(self) -> str:
        """The OpenTelemetry trace this execution belongs to ("" when it was recorded untraced)."""
        parts = self.trace_context.split("-")
        return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


class ExecutionEvent(models.Model):
    """Append-only history of an execution: attempts, retries, rescues, operator actions.

    It is both the per-attempt record and the audit log; rows are never updated.
    """

    # No database-level constraint: events are only ever inserted by the ledger from the
    # execution row's own compare-and-set (so the row exists by construction), and the
    # deferred constraint check costs about a tenth of a claim. Deleting an execution
    # through the ORM still deletes its events (Django's collector does the cascade).
    execution = models.ForeignKey(Execution, on_delete=models.CASCADE, related_name="events", db_constraint=False)
    at = models.DateTimeField()
    kind = models.CharField(max_length=32, choices=EventKind.choices)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    fencing_token = models.BigIntegerField(default=0)
    actor = models.CharField(max_length=255, blank=True, help_text="worker node:pid, 'rescuer' or user.")
    reason = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.kind} #{self.attempt} {self.from_state}→{self.to_state}"


class FlowState(models.TextChoices):
    """Where a flow run is (``core/flows.py``)."""

    RUNNING = "RUNNING", "running"  # its steps run in order
    SUCCEEDED = "SUCCEEDED", "succeeded"  # terminal: every step succeeded
    COMPENSATING = "COMPENSATING", "compensating"  # a step failed for good; undoing the ones before it
    COMPENSATED = "COMPENSATED", "compensated"  # terminal: every succeeded step was undone
    FAILED_TO_COMPENSATE = "FAILED_TO_COMPENSATE", "failed to compensate"  # a compensation dead-lettered


class FlowRun(models.Model):
    """One run of a declared flow (``taskplatform.Flow``): ordered steps, each an execution,
    and on a step's failure the compensations of the steps before it, in reverse order.

    Its step executions are keyed ``flow:<id>:<index>:<step>`` and its compensations
    ``…:undo``, so a replayed message or a second advance never runs a step twice.
    """

    key = models.CharField(max_length=255, unique=True, help_text="The caller's idempotency key for the whole flow.")
    flow = models.CharField(max_length=100, help_text="The declared flow's name.")
    input = models.JSONField(default=dict, blank=True, help_text="The arguments the flow was started with.")
    state = models.CharField(max_length=24, choices=FlowState.choices, default=FlowState.RUNNING)
    step = models.PositiveSmallIntegerField(default=0, help_text="Index of the step (or compensation) in progress.")
    results = models.JSONField(default=dict, blank=True, help_text="Each succeeded step's result, by step name.")
    failed_step = models.CharField(max_length=100, blank=True, help_text="The step that failed for good.")
    error = models.TextField(blank=True)
    check_at = models.DateTimeField(
        null=True, blank=True, help_text="The rescuer looks at it then if nothing moved it on before."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        verbose_name = "flow"
        indexes = [
            models.Index(fields=["state", "check_at"], name="tp_flow_state_check"),
            models.Index(fields=["state", "created_at"], name="tp_flow_state_created"),
        ]

    def __str__(self) -> str:
        return f"{self.flow} {self.key} ({self.state})"


class Limit(models.Model):
    """A fleet-wide bound on one task's or one job's executions: at most ``concurrency``
    bodies running at once, at most ``rate`` starts in any ``per_seconds``, across every worker.

    Slots are leases on a lock backend (``worker/limits.py``): a crashed holder's slot frees
    when its lease runs out. An execution that finds the limit full waits in the ledger
    (``WAITING``) and is published again when a slot frees; it is not failed.
    """

    task_name = models.CharField(
        max_length=200,
        blank=True,
        help_text="Registered task name: the limit bounds every execution of this task. Or choose a job.",
    )
    job = models.OneToOneField(
        JobDefinition,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="limit",
        help_text="A job: the limit bounds the executions of this job only. Or give a task name.",
    )
    scope = models.CharField(
        max_length=220, unique=True, editable=False, help_text="task:<name> or job:<id>, derived on save."
    )
    concurrency = models.PositiveIntegerField(
        null=True, blank=True, help_text="At most this many bodies running at once across all workers; empty: none."
    )
    rate = models.PositiveIntegerField(
        null=True, blank=True, help_text="At most this many starts in any window of per_seconds; empty: none."
    )
    per_seconds = models.PositiveIntegerField(default=1, help_text="The rate limit's window, in seconds.")
    backend = models.CharField(
        max_length=100,
        default="default",
        help_text="Lock backend alias (TASKPLATFORM_LOCK_BACKENDS) holding the slots.",
    )
    note = models.TextField(blank=True, help_text="Why this limit: the downstream it protects.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["scope"]
        verbose_name = "fleet-wide limit"

    def __str__(self) -> str:
        parts = []
        if self.concurrency:
            parts.append(f"{self.concurrency} at once")
        if self.rate:
            parts.append(f"{self.rate} per {self.per_seconds} s")
        return f"{self.scope or self.derive_scope()}: {', '.join(parts) or 'no bound'}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.scope = self.derive_scope()
        super().save(*args, **kwargs)

    def clean(self) -> None:
        """Refuse a limit that bounds nothing or names both (or neither) a task and a job.
        The task name and the backend are checked by ``worker.limits.validate``."""
        errors: dict[str, Any] = {}
        if bool(self.task_name) == bool(self.job_id):
            errors["task_name"] = "give either a task name or a job, not both"
        if not self.concurrency and not self.rate:
            errors["concurrency"] = "give a concurrency limit, a rate limit, or both"
        if self.concurrency is not None and not 1 <= self.concurrency <= MAX_LIMIT_SLOTS:
            errors["concurrency"] = f"between 1 and {MAX_LIMIT_SLOTS}"
        if self.rate is not None and not 1 <= self.rate <= MAX_LIMIT_SLOTS:
            errors["rate"] = f"between 1 and {MAX_LIMIT_SLOTS}"
        if not 1 <= (self.per_seconds or 0) <= 86400:
            errors["per_seconds"] = "between 1 and 86400 (a day)"
        if errors:
            raise ValidationError(errors)

    def derive_scope(self) -> str:
        return f"job:{self.job_id}" if self.job_id else f"task:{self.task_name}"


#: The most slots a limit may have (concurrency or starts per window): each is a lease.
MAX_LIMIT_SLOTS = 1000


class LockLease(models.Model):
    """A named lease held through the database lock backend (``backends.db``).

    Times are the database server's (``NOW()``), so beat processes on hosts with skewed
    clocks still agree on who holds a lease. ``fencing_token`` only ever grows, release
    included.
    """

    name = models.CharField(max_length=200, unique=True)
    owner = models.CharField(max_length=255, blank=True, help_text="Empty when free.")
    fencing_token = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    renewed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        permissions = [("force_release_locklease", "Can force-release locks")]
        verbose_name = "lock"
        verbose_name_plural = "locks and beat leadership"

    def __str__(self) -> str:
        return f"{self.name} ({self.owner or 'free'})"


class ScheduleCursor(models.Model):
    """Per schedule entry: the latest slot the beat leader has accounted for.

    Written in the same transaction as the executions of those slots, so a new leader
    resumes exactly where the last one stopped and knows which slots were missed while no
    beat ran (the misfire policies act on those).
    """

    name = models.CharField(max_length=200, unique=True, help_text="The django-celery-beat PeriodicTask name.")
    last_slot = models.DateTimeField()
    fencing_token = models.BigIntegerField(default=0, help_text="The leader's token that moved the cursor last.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} @ {self.last_slot.isoformat()}"


class SchedulerFence(models.Model):
    """The highest beat-leader fencing token that has published, per scheduler lock.

    Every publication transaction raises it to the leader's token and aborts if it is
    already higher: a leader that was paused past its lease, woke up and has not yet
    noticed can no longer publish once its successor has.
    """

    name = models.CharField(max_length=200, unique=True)
    fencing_token = models.BigIntegerField(default=0)
    leader = models.CharField(max_length=255, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    cursors_owed_from = models.DateTimeField(
        null=True,
        blank=True,
        help_text=(
            "Set while a new leader is still writing the cursors of its first load (it publishes "
            "first): an entry without a cursor is owed its slots from then."
        ),
    )
    cursors_owed_up_to_id = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="With cursors_owed_from: the highest schedule row id that leader's load read (later rows are new).",
    )

    def __str__(self) -> str:
        return f"{self.name} ≥ {self.fencing_token}"


class BeatProcess(models.Model):
    """One beat process, as it last reported itself (``taskplatform status``, the admin)."""

    identity = models.CharField(max_length=255, unique=True, help_text="host:pid#random of the process.")
    lock_name = models.CharField(max_length=200)
    is_leader = models.BooleanField(default=False)
    fencing_token = models.BigIntegerField(default=0, help_text="Its lease's token while it leads.")
    lease_expires_at = models.DateTimeField(null=True, blank=True, help_text="Its lease's expiry, if it leads.")
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    entries = models.PositiveIntegerField(default=0, help_text="Schedule entries it has loaded.")
    published = models.PositiveIntegerField(default=0, help_text="Slots it published while leading.")
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-is_leader", "identity"]

    def __str__(self) -> str:
        return f"{self.identity} ({'leader' if self.is_leader else 'follower'})"


class OperatorAction(models.Model):
    """The audit log of operator actions that are not execution transitions.

    Execution transitions are audited as ``ExecutionEvent`` rows (kind ``operator``); job
    pauses, runs and copies and lock releases are recorded here, with who and why. Rows are
    never updated.
    """

    at = models.DateTimeField(auto_now_add=True)
    user = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=255, help_text="What the action was applied to, e.g. job:<slug>.")
    reason = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} {self.user} {self.action} {self.target}"


class CountsSnapshot(models.Model):
    """Executions per state and job, counted by the maintenance holder every
    ``TASKPLATFORM_COUNTS_INTERVAL_SECONDS``: the console's landing page and ``/metrics`` read
    these instead of counting a large ledger on every request (at a million executions that
    count took 0.2-0.3 s a page). A reader that finds none fresh counts live."""

    name = models.CharField(max_length=50, primary_key=True)
    counts = models.JSONField(default=list, help_text="[[state, job slug, count], ...]")
    taken_at = models.DateTimeField()

    EXECUTIONS = "executions"

    def __str__(self) -> str:
        return f"{self.name} at {self.taken_at:%Y-%m-%d %H:%M:%S}"

    @classmethod
    def take(cls) -> CountsSnapshot:
        """Count now and store the result (the maintenance duty), stamped by the database's clock."""
        counts = [list(row) for row in Execution.objects.by_state_and_job()]
        snapshot, _ = cls.objects.update_or_create(
            name=cls.EXECUTIONS, defaults={"counts": counts, "taken_at": UtcNow()}
        )
        snapshot.refresh_from_db(fields=["taken_at"])
        return snapshot

    @classmethod
    def executions(cls, max_age_seconds: float) -> tuple[list[tuple[str, str, int]], Any, float]:
        """The counts per state and job, when they were taken, and how many seconds ago: the
        stored snapshot if it is at most ``max_age_seconds`` old, else counted now (``None``,
        0). Both instants are the database's clock's: a holder whose clock is off neither
        keeps a dead snapshot fresh nor makes a live one look stale."""
        from datetime import timedelta

        row = (
            cls.objects.filter(name=cls.EXECUTIONS)
            .annotate(
                age=models.ExpressionWrapper(UtcNow() - models.F("taken_at"), output_field=models.DurationField())
            )
            .values("counts", "taken_at", "age")
            .first()
        )
        if row is not None and row["age"] is not None and row["age"] <= timedelta(seconds=max_age_seconds):
            counts = [(str(state), str(job), int(n)) for state, job, n in row["counts"]]
            return counts, row["taken_at"], max(0.0, row["age"].total_seconds())
        return Execution.objects.by_state_and_job(), None, 0.0
