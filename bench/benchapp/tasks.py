"""The same no-op task four ways: plain Celery, with django-celery-results, celery-once, IdempotentTask."""

from __future__ import annotations

from celery import current_app, shared_task
from celery_once import QueueOnce
from django.conf import settings

from taskplatform.tasks import IdempotentTask

# celery-once reads its configuration from the app (not the CELERY_ namespace).
current_app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": settings.BENCH_ONCE_REDIS_URL, "default_timeout": 3600},
}


@shared_task(name="bench.plain_noop", ignore_result=True)
def plain_noop(i: int) -> int:
    return i


@shared_task(name="bench.dcr_noop", ignore_result=False)
def dcr_noop(i: int) -> int:
    return i


@shared_task(name="bench.once_noop", base=QueueOnce, once={"graceful": True}, ignore_result=True)
def once_noop(i: int) -> int:
    return i


@shared_task(name="bench.ledger_noop", base=IdempotentTask, bind=True)
def ledger_noop(self: IdempotentTask, i: int) -> int:
    return i
