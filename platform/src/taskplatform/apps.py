"""Django app configuration for taskplatform."""

from __future__ import annotations

from django.apps import AppConfig


class TaskPlatformConfig(AppConfig):
    name = "taskplatform"
    verbose_name = "Task platform"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks; put the console's overview on the admin's landing page."""
        from django.contrib import admin

        from . import checks  # noqa: F401

        if admin.site.index_template is None:
            admin.site.index_template = "admin/taskplatform/index.html"
