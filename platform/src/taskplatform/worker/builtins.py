"""The platform's own Celery tasks: the rescuer pass and the job trigger of a plain beat entry."""

from __future__ import annotations

import logging
import time

from celery import Task, shared_task
from celery.exceptions import Reject
from django.db import DatabaseError

from .task import REQUEUE_PAUSE_SECONDS

log = logging.getLogger("taskplatform.tasks")


@shared_task(name="taskplatform.rescue", ignore_result=True, acks_late=False)
def rescue() -> dict[str, int]:
    """Periodic maintenance: publish due rows, re-publish lost ones, rescue expired leases."""
    from ..core.rescuer import run_rescuer  # models: not before django.setup() (``worker/lazy.py``)

    return run_rescuer().as_dict()


@shared_task(name="taskplatform.trigger_job", bind=True, ignore_result=True, acks_late=True)
def trigger_job(self: Task, slug: str) -> int | None:
    """Submit job ``slug`` through the ledger: what a plain beat entry calls.

    Keyed by this trigger message's id, so a re-delivered trigger is absorbed. (The
    ``LockedScheduler`` keys executions by schedule slot instead.) A paused job is skipped.
    Acknowledged late, and put back in the queue when the ledger cannot be written: until its
    execution is recorded, the message is the only record of the trigger.
    """
    try:
        return _trigger(self, slug)
    except DatabaseError as exc:
        log.error("the ledger is unreachable; the trigger of %r goes back to the queue", slug, exc_info=True)
        time.sleep(REQUEUE_PAUSE_SECONDS)  # not synchronisation: an outage must not spin the pool
        raise Reject(exc, requeue=True) from exc


def _trigger(self: Task, slug: str) -> int | None:
    from ..core.submission import submit  # models: not before django.setup() (``worker/lazy.py``)
    from ..models import JobDefinition, Trigger

    job = JobDefinition.objects.filter(slug=slug).first()
    if job is None:
        log.error("trigger for an unknown job %r ignored", slug)
        return None
    if not job.enabled:
        log.info("job %r is paused; trigger skipped", slug)
        return None
    return submit(job, idempotency_key=f"{slug}@{self.request.id}", trigger=Trigger.BEAT).pk
