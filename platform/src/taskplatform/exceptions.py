"""One exception root for the platform, with a family per concern.

Each class's docstring is its default message, so ``raise LedgerError()`` still says
something useful; callers add the specifics.
"""

from __future__ import annotations

from typing import Any


class TaskPlatformError(Exception):
    """A taskplatform error."""

    def __init__(self, message: str | None = None, **context: Any) -> None:
        self.context = context
        super().__init__(message or (self.__doc__ or "").strip().splitlines()[0])


# --- configuration -------------------------------------------------------------------------


class ConfigurationError(TaskPlatformError):
    """The taskplatform configuration is invalid."""


class MissingDependencyError(ConfigurationError):
    """An optional client library is not installed."""


# --- submission (bad input at the edge) ----------------------------------------------------


class SubmissionError(TaskPlatformError):
    """The submission was refused; nothing was recorded."""


class UnknownTaskError(SubmissionError):
    """No task with this name is registered with the Celery app."""


class NotIdempotentTaskError(SubmissionError):
    """The task does not use IdempotentTask as its base, so the ledger cannot track it."""


class InvalidArgumentsError(SubmissionError):
    """The task arguments are not valid JSON values."""


class PayloadTooLargeError(SubmissionError):
    """The task arguments exceed the configured size limit."""


class InvalidIdempotencyKeyError(SubmissionError):
    """The idempotency key is empty, too long or not a string."""


class IdempotencyKeyConflictError(SubmissionError):
    """The idempotency key is already used by an execution with a different task or arguments."""


# --- ledger ----------------------------------------------------------------------------------


class LedgerError(TaskPlatformError):
    """The execution ledger refused the operation."""


class ExecutionNotFound(LedgerError):
    """No execution matches."""


class IllegalTransitionError(LedgerError):
    """This state change is not allowed by the transitions table."""


class StaleExecutionError(LedgerError):
    """The write was refused: the execution was claimed again under a newer fencing token."""


# --- tasks -----------------------------------------------------------------------------------


class TaskError(TaskPlatformError):
    """A task could not be run under the platform's protocol."""


class LeaseLostError(TaskError):
    """The worker lost the execution's lease; another attempt may own it now."""


# --- locks (plug-in backends) ----------------------------------------------------------------


class LockError(TaskPlatformError):
    """A lock backend operation failed."""
