"""The ledger's prepared statements lost between a claim and its success, in a real worker.

``tests/ledger/test_fast_path.py`` checks the ledger's rows when the server forgets a prepared
statement; this checks what a user pays for: the body of each task runs once, its effect is
committed once, and the worker keeps working with the statements unprepared afterwards.
"""

from __future__ import annotations

import pytest

from taskplatform import submit
from taskplatform.models import Execution
from tests.helpers import state_of
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.worker]


def test_a_success_whose_prepared_statement_the_server_forgot_runs_no_body_twice(workers, poll):
    # One pool process, so the three tasks share one database connection: the first prepares
    # the ledger's statements on it, the second makes the server forget them mid-body (its
    # success is then refused as 26000 and must be run again unprepared), the third runs on a
    # process that no longer prepares.
    worker = workers.start(concurrency=1)
    first = submit("testapp.effect")
    poll(lambda: state_of(first.pk) == "SUCCEEDED", timeout=30, what="first task (statements prepared)")
    lost = submit("testapp.effect_losing_prepared_statements")
    poll(lambda: state_of(lost.pk) == "SUCCEEDED", timeout=30, what="success recorded after the loss")
    third = submit("testapp.effect")
    poll(lambda: state_of(third.pk) == "SUCCEEDED", timeout=30, what="a task after the loss")

    # The loss did happen (else this test would pass with preparation off, or a new connection).
    assert "a prepared statement was lost on database 'default' (26000)" in worker.log()
    for execution in (first, lost, third):
        key = execution.idempotency_key
        assert EffectRaw.objects.filter(key=key, phase="started").count() == 1, key
        assert Effect.objects.filter(key=key).count() == 1, key
        row = Execution.objects.get(pk=execution.pk)
        assert (row.attempts, row.fencing_token) == (1, 1), key
