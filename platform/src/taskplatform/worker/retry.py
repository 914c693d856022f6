"""Retry arithmetic: pure functions, no I/O.

The delay is Celery's own ``get_exponential_backoff_interval`` (AWS "full jitter": uniform
over the integers ``0 … min(cap, base·2ⁿ)``), so a task's ``retry_backoff`` /
``retry_backoff_max`` / ``retry_jitter`` mean exactly what they mean in Celery. What the
platform adds is that the numbers can be overridden per job and are read at run time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from celery.utils.time import get_exponential_backoff_interval

from ..domain.policies import resolve_error_classes

__all__ = ["RetryPolicy", "backoff_cap", "resolve_error_classes"]


@dataclass(frozen=True)
class RetryPolicy:
    """How an execution's failures are handled."""

    #: Attempts allowed in all, the first one included (Celery's ``max_retries + 1``).
    max_attempts: int
    #: Exponential backoff factor in seconds; 0 disables backoff (``fixed_delay_seconds`` applies).
    backoff_base_seconds: int
    #: Cap of the exponential delay, in seconds, applied before jitter.
    backoff_max_seconds: int
    #: Full jitter on (uniform over ``0 … delay``) or off (exactly ``delay``).
    jitter: bool
    #: Delay when backoff is off, in seconds (Celery's ``default_retry_delay``).
    fixed_delay_seconds: int
    #: Error classes that are retried (Celery's ``autoretry_for``).
    retry_on: tuple[type[BaseException], ...]
    #: Error classes that fail at once even if they match ``retry_on`` (``dont_autoretry_for``).
    fatal: tuple[type[BaseException], ...]

    def delay_seconds(self, attempt: int, rng: random.Random | None = None) -> int:
        """Seconds to wait after failed attempt number ``attempt`` (1-based).

        >>> p = RetryPolicy(5, 2, 16, False, 180, (Exception,), ())
        >>> [p.delay_seconds(n) for n in (1, 2, 3, 4, 5)]
        [2, 4, 8, 16, 16]
        >>> RetryPolicy(5, 0, 16, False, 7, (Exception,), ()).delay_seconds(3)
        7
        """
        if self.backoff_base_seconds <= 0:
            return self.fixed_delay_seconds
        if rng is None:
            return get_exponential_backoff_interval(
                factor=self.backoff_base_seconds,
                retries=attempt - 1,
                maximum=self.backoff_max_seconds,
                full_jitter=self.jitter,
            )
        cap = backoff_cap(self.backoff_base_seconds, self.backoff_max_seconds, attempt)
        return rng.randrange(cap + 1) if self.jitter else cap

    def classify(self, exc: BaseException) -> Literal["retry", "fatal"]:
        """Whether ``exc`` is retried or fails the execution at once."""
        if self.fatal and isinstance(exc, self.fatal):
            return "fatal"
        if self.retry_on and isinstance(exc, self.retry_on):
            return "retry"
        return "fatal"

    def has_attempts_left(self, attempts_made: int) -> bool:
        """True when another attempt is allowed after ``attempts_made`` attempts."""
        return attempts_made < self.max_attempts


def backoff_cap(base_seconds: int, max_seconds: int, attempt: int) -> int:
    """The upper bound of the delay after attempt ``attempt``: ``min(cap, base·2^(attempt-1))``.

    >>> [backoff_cap(1, 10, n) for n in range(1, 7)]
    [1, 2, 4, 8, 10, 10]
    """
    return max(0, min(max_seconds, base_seconds * (2 ** (attempt - 1))))
