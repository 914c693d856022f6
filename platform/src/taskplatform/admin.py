"""Django's admin autodiscovery imports ``<app>.admin``: the console's admin lives in ``console.admin``."""

from __future__ import annotations

from .console import admin as _console_admin  # noqa: F401  (registers the ModelAdmins)
