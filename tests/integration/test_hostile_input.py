"""Property-based: arbitrary JSON and text against every API view and the job form.

What a hostile client can send (lone surrogates as ``\\ud800`` escapes, NUL, NaN/Infinity,
numbers too large for a float or for ``int()``, deep nesting, bytes that are not UTF-8,
odd headers) must get a 4xx, never a 500, and a refused request must write nothing: no
execution, no event, no client request, no job, no schedule. Accepted requests are fine
either way; each example runs in a savepoint that is rolled back, so examples do not see
each other's rows. Bounded: a few dozen examples per target, about 30 s in all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from django_celery_beat.models import CrontabSchedule, PeriodicTask
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from taskplatform.models import Execution, ExecutionEvent, JobDefinition
from tasks.models import ApiToken, Campaign, ClientRequest

pytestmark = pytest.mark.django_db

BOUNDED = settings(
    max_examples=50,
    deadline=timedelta(seconds=5),
    database=None,  # no .hypothesis/ directory in the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- strategies ---------------------------------------------------------------------------------

#: Every code point, lone surrogates (category Cs) included.
ANY_CHAR = st.characters(exclude_categories=())
NASTY_STRINGS = st.one_of(
    st.sampled_from(
        [
            "\ud800",
            "\udfff",
            "a\udc00b",
            "\udc00\ud800",
            "\x00",
            "nul\x00",
            "NaN",
            "Infinity",
            "",
            " ",
            "\u2028",
            "20261101",
            "2026-W44-7",
            "9" * 5000,
            "x" * 70_000,
        ]
    ),
    # A lone surrogate somewhere in otherwise ordinary text.
    st.builds(lambda a, c, b: a + c + b, st.text(max_size=5), st.characters(categories=["Cs"]), st.text(max_size=5)),
)
STRINGS = st.one_of(st.text(ANY_CHAR, max_size=30), NASTY_STRINGS)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(),  # NaN and the infinities included: json.dumps writes them as bare tokens
    st.sampled_from([0, 1, 4, 64, 65, -1, True, False]),
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(STRINGS, st.sampled_from(["day", "shards"])), inner, max_size=4),
    ),
    max_leaves=12,
)
#: A field's value: a valid one (to reach the submission), a hostile string, or anything.
VALUES = st.one_of(
    st.sampled_from(["winter", "2026-11-01", "2026-02-30", "0001-01-01", 2, 64]), NASTY_STRINGS, JSON_VALUES
)
EXTRA = st.dictionaries(st.one_of(STRINGS, st.sampled_from(["campaign", "day", "shards"])), JSON_VALUES, max_size=2)
#: Objects shaped like each endpoint's requests, so that validation and submission are reached.
OBJECTS = {
    "/api/coupons/": st.one_of(
        st.fixed_dictionaries({"campaign": VALUES}), st.fixed_dictionaries({"campaign": VALUES}, optional={"x": VALUES})
    ),
    "/api/reconciliations/": st.one_of(
        st.fixed_dictionaries({"day": VALUES, "shards": st.one_of(st.integers(0, 65), VALUES)}),
        st.fixed_dictionaries({"day": VALUES}),
    ),
    "/api/inventory/sync": st.one_of(st.just({}), EXTRA),
}
#: Bare tokens json.dumps never writes but a client may: Python's json reads some of them.
TOKENS = st.sampled_from(
    ["NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1E400", "9" * 4301, "9" * 4000, "-0", "1.5e308",
     '"\\ud800"', '"\\udc00\\ud800"', '"\\u0000"', '"\\ud83d\\ude00"', '"winter"', '"2026-11-01"', "2", "true",
     "null", "[]", "{}", '"\\uDFFF"']
)  # fmt: skip


@st.composite
def raw_bodies(draw: Any, url: str) -> bytes:
    kind = draw(st.sampled_from(["object", "object", "object", "value", "token", "nested", "bytes"]))
    if kind == "object":  # ensure_ascii: a lone surrogate travels as its \\u escape, as over the wire
        return json.dumps(draw(OBJECTS[url])).encode()
    if kind == "value":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "token":
        field = draw(st.sampled_from(["campaign", "day", "shards", "\\ud800", "x"]))
        extra = ', "shards": 2' if field == "day" else ""
        return f'{{"{field}": {draw(TOKENS)}{extra}}}'.encode()
    if kind == "nested":
        depth = draw(st.integers(1, 4000))
        return b'{"campaign": ' + b"[" * depth + b"]" * depth + b"}"
    return draw(st.binary(max_size=64))


#: Header values as a WSGI server delivers them: latin-1 decoded bytes.
HEADER_TEXT = st.one_of(st.none(), st.text(st.characters(max_codepoint=255), max_size=40), st.just("k" * 250))

# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def root() -> User:
    return User.objects.create_superuser("root", password="pw")


@pytest.fixture
def api(root: User) -> Client:
    """A client with every permission, so that validation, not authorization, answers."""
    Campaign.objects.create(slug="winter", name="Winter", stock=10)
    _token, raw = ApiToken.issue(root, "hostile")
    return Client(HTTP_AUTHORIZATION=f"Token {raw}")


@pytest.fixture
def admin(root: User) -> Client:
    client = Client()
    client.login(username="root", password="pw")
    return client


def counts() -> dict[str, int]:
    return {
        "executions": Execution.objects.count(),
        "events": ExecutionEvent.objects.count(),
        "client_requests": ClientRequest.objects.count(),
        "jobs": JobDefinition.objects.count(),
        "periodic_tasks": PeriodicTask.objects.count(),
        "crontabs": CrontabSchedule.objects.count(),
    }


@contextmanager
def rolled_back() -> Iterator[None]:
    """Run one example in a savepoint, rolled back after it: examples stay independent."""
    with transaction.atomic():
        yield
        transaction.set_rollback(True)


def assert_refusal_wrote_nothing(response: Any, before: dict[str, int]) -> None:
    assert response.status_code < 500, response.content[:2000]
    if response.status_code >= 400:
        assert counts() == before, (response.status_code, response.content[:500])


# --- the API ------------------------------------------------------------------------------------

POST_URLS = ["/api/coupons/", "/api/reconciliations/", "/api/inventory/sync"]


@pytest.mark.scenario(36)
@pytest.mark.parametrize("url", POST_URLS)
@BOUNDED
@given(data=st.data(), key=HEADER_TEXT)
def test_no_body_or_key_makes_an_api_view_fail_or_half_write(api: Client, url: str, data: Any, key: str | None) -> None:
    body = data.draw(raw_bodies(url), label="body")
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    with rolled_back():
        before = counts()
        response = api.post(url, data=body, content_type="application/json", **headers)
        assert_refusal_wrote_nothing(response, before)
        assert response["Content-Type"] == "application/json", response.content[:500]
        if response.status_code in (200, 202):
            # The same request again (however the client re-serialises it) is the same execution.
            again = api.post(url, data=body, content_type="application/json", **headers)
            assert again.status_code in (200, 202) and (key is None or again.json()["id"] == response.json()["id"])


@BOUNDED
@given(pk=st.one_of(st.integers(0, 2**80), st.just(2**63 - 1), st.just(2**63)), auth=HEADER_TEXT)
def test_no_execution_id_or_credentials_makes_a_read_fail(api: Client, pk: int, auth: str | None) -> None:
    with rolled_back():
        assert api.get(f"/api/executions/{pk}").status_code in (200, 404)
        headers = {"HTTP_AUTHORIZATION": auth} if auth is not None else {}
        for url in (f"/api/executions/{pk}", "/metrics"):
            assert Client(**headers).get(url).status_code in (200, 401, 404)
        assert Client(**headers).post("/api/coupons/", data=b"{}", content_type="application/json").status_code < 500


# --- the job form -------------------------------------------------------------------------------

JOB_TASKS = st.sampled_from(["testapp.effect", "testapp.fatal", "tasks.ping", "tasks.reconcile_payment_shard"])
CRON = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=30),
    st.sampled_from(["30 2 * * *", "*/5 * * * *", "0 0 31 2 *", "61 * * * *", "* * * *", "0 0 * * mon-fri"]),
    st.builds(lambda n: ",".join(["1"] * n) + " * * * *", st.integers(1, 200)),
)
FORM_TEXT = st.text(st.characters(codec="utf-8"), max_size=20)


#: The form's fields that get hostile values (a few at a time, the others plausible).
HOSTILE_FIELDS = ["slug", "description", "args", "kwargs", "retry_on", "fatal_errors", "cron", "queue", "schedule"]


@st.composite
def job_forms(draw: Any) -> dict[str, str]:
    """The add form: up to two fields hostile, the others plausible (JSON sent ASCII-escaped)."""
    hostile = draw(st.sets(st.sampled_from(HOSTILE_FIELDS), max_size=2))

    def pick(name: str, plausible: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> Any:
        return draw(wild if name in hostile else plausible)

    def json_field(name: str, plausible: list[Any]) -> str:
        wild = st.one_of(
            JSON_VALUES.map(json.dumps), TOKENS.map(lambda token: f"[{token}]"), FORM_TEXT,
            st.lists(NASTY_STRINGS, min_size=1, max_size=2).map(json.dumps),
        )  # fmt: skip
        return str(pick(name, st.sampled_from(plausible).map(json.dumps), wild))

    kind = pick("schedule", st.sampled_from(["none", "cron", "interval"]), st.sampled_from(["interval", "once"]))
    return {
        "slug": pick("slug", st.just("hostile"), FORM_TEXT),
        "description": pick("description", st.just(""), FORM_TEXT),
        "task": draw(JOB_TASKS),
        "args": json_field("args", [[], [1], [0, "g"], ["2026-11-01", 0, 2]]),
        "kwargs": json_field("kwargs", [{}, {"seconds": 0}, {"source": "x"}, {"day": "d", "shard": 0, "shards": 1}]),
        "enabled": "on",
        "schedule_kind": kind,
        "cron": pick("cron", st.sampled_from(["30 2 * * *", "*/5 * * * mon-fri"]), CRON) if kind == "cron" else "",
        "timezone": draw(st.sampled_from(["UTC", "Europe/Berlin"])),
        "every_seconds": pick("schedule", st.just("60"), st.sampled_from(["", "0", "99999999999", "x"]))
        if kind == "interval"
        else "",
        "start_0": "", "start_1": "",
        "run_at_0": draw(st.sampled_from(["2099-01-01", "2001-01-01", "x"])) if kind == "once" else "",
        "run_at_1": "00:00:00" if kind == "once" else "",
        "misfire_policy": "run_once", "catch_up_window_seconds": "", "max_attempts": "",
        "backoff_base_seconds": "", "backoff_max_seconds": "", "jitter": "unknown",
        "retry_on": json_field("retry_on", [[]]), "fatal_errors": json_field("fatal_errors", [["builtins.ValueError"]]),
        "queue": pick("queue", st.sampled_from(["", "celery"]), FORM_TEXT),
        "priority": "", "soft_time_limit_seconds": "", "time_limit_seconds": "", "lease_seconds": "",
    }  # fmt: skip


@pytest.mark.scenario(34, 35, 36)
@settings(BOUNDED, max_examples=40)
@given(form=job_forms())
def test_no_job_form_input_makes_the_admin_fail_or_half_write(admin: Client, form: dict[str, str]) -> None:
    with rolled_back():
        before = counts()
        response = admin.post("/admin/taskplatform/jobdefinition/add/", form)
        assert response.status_code in (200, 302), response.content[:2000]
        event(f"status {response.status_code}")
        if response.status_code == 200:  # the form again, with its errors: nothing saved
            assert response.context["adminform"].form.errors
            assert counts() == before
            return
        job = JobDefinition.objects.order_by("-pk").first()
        assert job is not None and counts()["jobs"] == before["jobs"] + 1
        # What was saved can be shown and saved again unchanged (the reported 500 on the change page).
        page = admin.get(f"/admin/taskplatform/jobdefinition/{job.pk}/change/")
        assert page.status_code == 200
        job.refresh_from_db()
        json.dumps([job.args, job.kwargs, job.retry_on, job.fatal_errors], allow_nan=False).encode("utf-8")
