"""Django app configuration for taskplatform."""

from __future__ import annotations

import logging
from typing import Any

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured

#: The apps taskplatform's models and console need in ``INSTALLED_APPS``.
REQUIRED_APPS = ("django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes", "django_celery_beat")


class TaskPlatformConfig(AppConfig):
    name = "taskplatform"
    verbose_name = "Task platform"
    default_auto_field = "django.db.models.BigAutoField"

    def import_models(self) -> None:
        """Say which apps are missing before the models import (a job's schedule is a
        django-celery-beat row, the console is the admin); it used to be a traceback about a
        model without an app label, or ``django.setup()`` failing."""
        registry = self.apps
        assert registry is not None  # set before import_models is called
        missing = [name for name in REQUIRED_APPS if not registry.is_installed(name)]
        if missing:
            raise ImproperlyConfigured(
                f"taskplatform needs {', '.join(repr(name) for name in missing)} in INSTALLED_APPS "
                f"(all of: {', '.join(REQUIRED_APPS)})"
            )
        super().import_models()

    def ready(self) -> None:
        """Register the system checks; make workers candidates for the maintenance duties; put
        the console's overview on the admin's landing page."""
        from celery.signals import (
            after_setup_logger,
            after_setup_task_logger,
            worker_init,
            worker_process_shutdown,
            worker_ready,
            worker_shutdown,
        )
        from django.contrib import admin

        from . import checks  # noqa: F401
        from .scheduling.maintenance import start_worker_maintenance, stop_worker_maintenance
        from .worker.lazy import load_deferred
        from .worker.recorder import flush_on_exit

        worker_init.connect(refuse_bad_settings, dispatch_uid="taskplatform.refuse_bad_settings")
        after_setup_logger.connect(structured_celery_logs, dispatch_uid="taskplatform.logs")
        after_setup_task_logger.connect(structured_celery_logs, dispatch_uid="taskplatform.task_logs")
        worker_ready.connect(start_worker_maintenance, dispatch_uid="taskplatform.worker_maintenance")
        worker_shutdown.connect(stop_worker_maintenance, dispatch_uid="taskplatform.worker_maintenance")
        # A pool process leaving in an orderly way writes the successes its recorder holds;
        # the main process (solo and threads pools) does so at worker shutdown.
        worker_process_shutdown.connect(flush_on_exit, dispatch_uid="taskplatform.success_recorder")
        worker_shutdown.connect(flush_on_exit, dispatch_uid="taskplatform.success_recorder")

        from django.db.models.signals import post_delete

        from .models import Limit
        from .worker.limits import recall_waiters_of_deleted

        # However a limit goes (the admin, a job deleted with its limit, a queryset's delete),
        # the executions it refused are published again once the workers have read it.
        post_delete.connect(recall_waiters_of_deleted, sender=Limit, dispatch_uid="taskplatform.limit_deleted")

        install_admin_overview(admin.site)
        start_tracing()
        load_deferred()  # what taskplatform.tasks deferred, if it was imported before setup


def start_tracing() -> bool:
    """Turn OpenTelemetry tracing on in this process when ``TASKPLATFORM_TRACING`` asks for it
    (web, worker and beat processes all pass here; prefork's pool processes inherit it)."""
    from . import tracing
    from .conf import platform_settings

    try:
        mode = platform_settings().tracing
    except ImproperlyConfigured:  # reported by the system checks (E002)
        return False
    try:
        return tracing.setup(mode)
    except RuntimeError as exc:  # the extra is missing: reported by the system checks (E050)
        logging.getLogger("taskplatform.tracing").error("%s; tracing stays off", exc)
        return False


def structured_celery_logs(logger: Any = None, **kwargs: Any) -> None:
    """Celery's ``after_setup_logger``: the worker's and the beat's own log handlers get the
    execution fields, in any project. The format (``TASKPLATFORM_LOG_FORMAT``) replaces
    Celery's default one; a formatter of the host's own is replaced only when the host set
    ``TASKPLATFORM_LOG_FORMAT`` itself."""
    from django.conf import settings

    from .conf import platform_settings
    from .observability.logs import apply_to

    try:
        kind = platform_settings().log_format
    except ImproperlyConfigured:  # the worker refuses to start (refuse_bad_settings)
        return
    if logger is not None:
        # A host's own formatters stay unless it asked for the platform's format by name.
        apply_to(logger, kind, only_celerys=not hasattr(settings, "TASKPLATFORM_LOG_FORMAT"))


def refuse_bad_settings(sender: object = None, **kwargs: object) -> None:
    """Celery's ``worker_init``: a worker with a ``TASKPLATFORM_*`` value of the wrong type or
    out of range does not start (``SystemExit``: Celery logs and swallows a handler's
    ``Exception``), rather than fail every task with it."""
    from .conf import platform_settings

    try:
        platform_settings()
    except ImproperlyConfigured as exc:
        raise SystemExit(f"taskplatform: {exc}") from exc


def install_admin_overview(site: Any) -> bool:
    """Put the console's overview on ``site``'s landing page, above what it shows already
    (the template extends ``admin/index.html``, the host's own override included), unless
    ``TASKPLATFORM_ADMIN_OVERVIEW`` is False or the site has an index template of its own.
    True if installed."""
    from .conf import platform_settings

    try:
        wanted = platform_settings().admin_overview
    except ImproperlyConfigured:  # reported by the system checks (E002); setup must go on to run them
        return False
    if not wanted or site.index_template is not None:
        return False
    site.index_template = "admin/taskplatform/index.html"
    return True
