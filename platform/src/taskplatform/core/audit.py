"""The audit log of operator actions that are not execution transitions.

An execution's own history (``ExecutionEvent``) is written by the ledger; everything else an
operator does (pause, resume, run now, duplicate, force-release a lock) is an
``OperatorAction`` row written here, in the caller's transaction.
"""

from __future__ import annotations

from typing import Any

from ..models import OperatorAction


def audit(user: str, action: str, target: str, reason: str = "", **data: Any) -> OperatorAction:
    """Record that ``user`` did ``action`` to ``target`` and why."""
    return OperatorAction.objects.create(user=user, action=action, target=target, reason=reason, data=data)
