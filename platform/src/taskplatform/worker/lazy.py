"""Modules loaded at their first use, so that the task modules import before ``django.setup()``.

A project's ``celery.py`` (imported by its package's ``__init__``, before Django has loaded its
apps) may define tasks on ``IdempotentTask``; the ledger's modules define or import Django
models, which cannot be imported that early. ``IdempotentTask`` only needs them when it runs.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """Module ``name``, executed at the first attribute read (``importlib.util.LazyLoader``);
    the module itself if it is imported already."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
