"""The Celery app. Configuration comes from Django settings prefixed ``CELERY_``."""

import os
from typing import Any

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

app = Celery("config")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _structured_logs(logger: Any, **kwargs: Any) -> None:
    """Celery's own worker/beat log handlers get the execution fields and the chosen format."""
    from django.conf import settings

    from taskplatform.observability.logs import apply_to

    apply_to(logger, getattr(settings, "TASKPLATFORM_LOG_FORMAT", "plain"))
