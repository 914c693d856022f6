"""Retry arithmetic: delays stay inside the full-jitter bounds; classification is exact."""

import random

import pytest

from taskplatform.exceptions import ConfigurationError
from taskplatform.worker.retry import RetryPolicy, backoff_cap, resolve_error_classes


class Transient(Exception):
    pass


class Fatal(Transient):
    pass


def policy(**overrides):
    values = dict(
        max_attempts=5,
        backoff_base_seconds=2,
        backoff_max_seconds=16,
        jitter=True,
        fixed_delay_seconds=180,
        retry_on=(Transient,),
        fatal=(Fatal,),
    )
    values.update(overrides)
    return RetryPolicy(**values)


@pytest.mark.parametrize("attempt", range(1, 9))
def test_jittered_delay_lies_within_zero_and_capped_exponential(attempt):
    p = policy()
    rng = random.Random(attempt)
    bound = min(16, 2 * 2 ** (attempt - 1))
    delays = {p.delay_seconds(attempt, rng) for _ in range(2000)}
    assert min(delays) >= 0 and max(delays) <= bound
    # full jitter: the whole range is used, zero included
    assert delays == set(range(bound + 1))


@pytest.mark.parametrize("attempt", range(1, 9))
def test_celery_backoff_function_is_used_without_an_explicit_rng(attempt):
    p = policy()
    bound = min(16, 2 * 2 ** (attempt - 1))
    assert all(0 <= p.delay_seconds(attempt) <= bound for _ in range(200))


def test_without_jitter_the_delay_is_the_capped_exponential():
    p = policy(jitter=False)
    assert [p.delay_seconds(n) for n in range(1, 7)] == [2, 4, 8, 16, 16, 16]


def test_backoff_off_uses_the_fixed_delay_like_celery_default_retry_delay():
    assert policy(backoff_base_seconds=0).delay_seconds(3) == 180


def test_backoff_cap_never_exceeds_maximum():
    assert backoff_cap(3, 10, 1) == 3
    assert backoff_cap(3, 10, 30) == 10


def test_fatal_errors_win_over_retryable_ones_and_unknown_errors_are_fatal():
    p = policy()
    assert p.classify(Transient()) == "retry"
    assert p.classify(Fatal()) == "fatal"
    assert p.classify(ValueError()) == "fatal"


def test_attempt_budget():
    p = policy(max_attempts=3)
    assert [p.has_attempts_left(n) for n in (1, 2, 3)] == [True, True, False]


def test_error_class_paths_are_resolved_or_refused_clearly():
    assert resolve_error_classes(["builtins.ValueError"]) == (ValueError,)
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        resolve_error_classes(["nowhere.Nothing"])
    with pytest.raises(ConfigurationError, match="not an exception class"):
        resolve_error_classes(["os.path.join"])
