"""Bad input is refused at the edge with a message that says what is wrong."""

import datetime as dt
import math

import pytest
from django.test import override_settings

from taskplatform.core.validation import check_idempotency_key, encode_arguments, encode_result
from taskplatform.exceptions import InvalidArgumentsError, InvalidIdempotencyKeyError, PayloadTooLargeError


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ([dt.datetime(2026, 1, 1)], {}, "must be JSON values"),
        ([{1, 2}], {}, "must be JSON values"),
        ([object()], {}, "must be JSON values"),
        ([math.nan], {}, "must be JSON values"),
        ("abc", {}, "args must be a list"),
        ([], [("a", 1)], "kwargs must be a dict"),
        ([], {1: "x"}, "kwargs keys must be strings"),
    ],
)
def test_non_json_arguments_are_refused(args, kwargs, message):
    with pytest.raises(InvalidArgumentsError, match=message):
        encode_arguments(args, kwargs)


def test_json_arguments_are_normalised():
    assert encode_arguments((1, "a"), {"k": [None, True]})[:2] == ([1, "a"], {"k": [None, True]})
    assert encode_arguments(None, None)[:2] == ([], {})


@override_settings(TASKPLATFORM_MAX_ARGS_BYTES=100)
def test_oversized_arguments_name_their_size_and_the_limit():
    encode_arguments(["x" * 80], {})
    with pytest.raises(PayloadTooLargeError, match=r"\d+ bytes encoded; the limit is 100 bytes"):
        encode_arguments(["x" * 200], {})


@pytest.mark.parametrize(("key", "message"), [("", "empty"), ("   ", "empty"), (42, "string"), ("k" * 256, "limit")])
def test_bad_idempotency_keys(key, message):
    with pytest.raises(InvalidIdempotencyKeyError, match=message):
        check_idempotency_key(key)


def test_unstorable_results_are_reported_not_raised():
    assert encode_result({"a": 1}) == ({"a": 1}, None)
    value, why = encode_result(object())
    assert value is None and "not a JSON value" in why
    with override_settings(TASKPLATFORM_MAX_RESULT_BYTES=10):
        value, why = encode_result("x" * 50)
    assert value is None and "exceeds" in why
