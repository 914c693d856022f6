"""The platform's own Celery tasks: the rescuer pass and the job trigger of a plain beat entry."""

from __future__ import annotations

import logging

from celery import Task, shared_task

from ..core.rescuer import run_rescuer
from ..core.submission import submit
from ..models import JobDefinition, Trigger

log = logging.getLogger("taskplatform.tasks")


@shared_task(name="taskplatform.rescue", ignore_result=True, acks_late=False)
def rescue() -> dict[str, int]:
    """Periodic maintenance: publish due rows, re-publish lost ones, rescue expired leases."""
    return run_rescuer().as_dict()


@shared_task(name="taskplatform.trigger_job", bind=True, ignore_result=True)
def trigger_job(self: Task, slug: str) -> int | None:
    """Submit job ``slug`` through the ledger: what a plain beat entry calls.

    Keyed by this trigger message's id, so a re-delivered trigger is absorbed. (The
    ``LockedScheduler`` keys executions by schedule slot instead.) A paused job is skipped.
    """
    job = JobDefinition.objects.filter(slug=slug).first()
    if job is None:
        log.error("trigger for an unknown job %r ignored", slug)
        return None
    if not job.enabled:
        log.info("job %r is paused; trigger skipped", slug)
        return None
    return submit(job, idempotency_key=f"{slug}@{self.request.id}", trigger=Trigger.BEAT).pk
