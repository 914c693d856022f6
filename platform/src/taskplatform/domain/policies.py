"""Policy vocabulary shared by the data model, the ledger, the worker and the beat.

Pure values: the misfire policies a job may choose, the cap on "retry forever", and the
resolution of the dotted error-class paths a job definition stores. No Celery here, so the
models (which store these values) never load the task runtime.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from django.utils.module_loading import import_string

from ..exceptions import ConfigurationError

#: A task whose ``max_retries`` is ``None`` ("forever" in Celery) is still capped at this many
#: attempts, so a poison message cannot loop for ever.
UNBOUNDED_ATTEMPTS_CAP = 100


class MisfirePolicy(StrEnum):
    """What a job does with slots that were missed while no beat was publishing."""

    SKIP = "skip"
    RUN_ONCE = "run_once"
    CATCH_UP = "catch_up"


def resolve_error_classes(paths: Iterable[str]) -> tuple[type[BaseException], ...]:
    """Import dotted exception class paths (as stored on a job definition)."""
    classes: list[type[BaseException]] = []
    for path in paths:
        try:
            obj: Any = import_string(path)
        except ImportError as exc:
            raise ConfigurationError(f"error class {path!r} cannot be imported: {exc}") from exc
        if not (isinstance(obj, type) and issubclass(obj, BaseException)):
            raise ConfigurationError(f"{path!r} is not an exception class")
        classes.append(obj)
    return tuple(classes)
