"""Modules loaded at their first use, so that the task modules import before ``django.setup()``.

A project's ``celery.py`` (imported by its package's ``__init__``, before Django has loaded its
apps) may define tasks on ``IdempotentTask``; the ledger's modules define or import Django
models, which cannot be imported that early. ``IdempotentTask`` only needs them when it runs.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

#: Modules ``lazy_module`` deferred, executed by ``load_deferred`` at the app's ``ready()``.
_DEFERRED: list[ModuleType] = []


def lazy_module(name: str) -> ModuleType:
    """Module ``name``: imported now if Django's models are loaded (or it is imported already),
    else executed at the first attribute read (``importlib.util.LazyLoader``) or at the app's
    ``ready()``, whichever comes first."""
    if name in sys.modules:
        return sys.modules[name]
    from django.apps import apps

    if apps.models_ready:
        return importlib.import_module(name)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    _DEFERRED.append(module)
    return module


def load_deferred() -> None:
    """Execute every deferred module now (``TaskPlatformConfig.ready()``: one thread, models
    loaded, before any task runs). Left to its first use, a lazy module would be executed by
    whichever thread touches it first, and Python 3.11's ``LazyLoader`` is not thread-safe: a
    second thread could see it half-executed (found in review: ``-P threads`` and a burst)."""
    while _DEFERRED:
        _DEFERRED.pop().__dict__.get("__name__")  # any attribute read executes it
