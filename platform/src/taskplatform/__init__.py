"""taskplatform: a reliable job platform for Django on Celery.

Public entry points (imported lazily so that importing the package never loads Django
models before the app registry is ready):

* ``taskplatform.submit`` — record an execution and publish it after commit;
* ``taskplatform.tasks.IdempotentTask`` — the task base class;
* ``taskplatform.exceptions`` — the error hierarchy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["submit"]

if TYPE_CHECKING:
    from .api import submit


def __getattr__(name: str) -> Any:
    if name == "submit":
        from .api import submit

        return submit
    raise AttributeError(f"module 'taskplatform' has no attribute {name!r}")
