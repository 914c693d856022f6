"""The hot statements find their row by primary key, whatever PostgreSQL's statistics say.

Found while profiling the hot path: with statistics taken when every row had finished, a
burst of new rows looks rare by state, and PostgreSQL served the claim's ``state = 'PENDING'``
from the ``(state, …)`` index, then filtered every pending row by id. Each claim cost time in
proportion to the backlog (2.6 ms at 3,000 pending rows, 0.2 ms by primary key). The plans
are read with ``EXPLAIN``; the statistics are made stale on purpose.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from taskplatform.core import _pg, ledger
from taskplatform.models import Execution, Trigger

pytestmark = pytest.mark.django_db(transaction=True)

BACKLOG = 400


def _stale_statistics_then_a_burst() -> list[Execution]:
    """Statistics that say every row has succeeded, then ``BACKLOG`` pending rows (and as many
    running ones, for the success mark)."""
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim and success exist on PostgreSQL only")
    for i in range(BACKLOG):
        ledger.create(ledger.NewExecution(f"old-{i}", "testapp.effect", [], {}, Trigger.API))
    Execution.objects.update(state="SUCCEEDED")
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Execution._meta.db_table}")
    burst = [
        ledger.create(ledger.NewExecution(f"new-{i}", "testapp.effect", [], {}, Trigger.API))[0]
        for i in range(2 * BACKLOG)
    ]
    Execution.objects.filter(pk__in=[e.pk for e in burst[BACKLOG:]]).update(state="RUNNING", fencing_token=1)
    return burst


def _plan(sql: str, params: dict[str, Any]) -> str:
    import psycopg

    connection.ensure_connection()
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(f"EXPLAIN (COSTS off) {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


def _scans_of_executions(plan: str) -> list[str]:
    scans = [line.strip() for line in plan.splitlines() if "Scan" in line and Execution._meta.db_table in line]
    assert scans, plan
    return scans


def _scan_of_executions(plan: str) -> str:
    return _scans_of_executions(plan)[0]


def test_the_first_attempt_claim_finds_its_row_by_primary_key_under_stale_statistics() -> None:
    """Alone, and carrying the previous attempt's success (both of its row lookups)."""
    burst = _stale_statistics_then_a_burst()
    params: dict[str, Any] = {
        "id": burst[0].pk,
        "now": timezone.now(),
        "lease": 60,
        "worker": "w:1",
        "task_id": "t",
        "task": "testapp.effect",
    }
    scan = _scan_of_executions(_plan(_pg._claim_sql(False), params))
    assert "_pkey" in scan, f"the claim walks an index other than the primary key: {scan}"
    carried = {"id": burst[-1].pk, "token": 1, "result": None, "now": timezone.now(), "worker": "w:1", "data": "{}"}
    params.update({f"s_{name}": value for name, value in carried.items()})
    scans = _scans_of_executions(_plan(_pg._claim_sql(True), params))
    assert len(scans) >= 2 and all("_pkey" in s for s in scans), f"a carrying claim walks another index: {scans}"


def test_the_success_mark_finds_its_row_by_primary_key_under_stale_statistics() -> None:
    burst = _stale_statistics_then_a_burst()
    params = {
        "id": burst[-1].pk, "token": 1, "result": None, "now": timezone.now(), "worker": "w:1",
        "data": json.dumps({}),
    }  # fmt: skip
    scan = _scan_of_executions(_plan(_pg._succeed_sql(), params))
    assert "_pkey" in scan, f"the success mark walks an index other than the primary key: {scan}"
