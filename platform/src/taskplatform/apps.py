"""Django app configuration for taskplatform."""

from __future__ import annotations

from django.apps import AppConfig


class TaskPlatformConfig(AppConfig):
    name = "taskplatform"
    verbose_name = "Task platform"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks that validate configuration at start-up."""
        from . import checks  # noqa: F401
