"""The reference deployment's configuration: settings, URLs and the Celery app."""

from .celery_app import app as celery_app

__all__ = ["celery_app"]
