"""Single-statement forms of the ledger's three hot writes, for PostgreSQL.

The portable protocol in ``ledger`` takes a read plus a transaction of two statements for a
claim and for a success (about nine round trips per execution). On PostgreSQL the same
compare-and-set, and its event row, fit in one statement each, using a data-modifying CTE:
the event is inserted from the ``UPDATE``'s ``RETURNING`` rows, so it exists if and only if
the compare-and-set matched. Semantics are identical; the portable path still handles
every case these do not (retries, takeovers, duplicates, other databases), and the ledger
test suite runs both (PostgreSQL here, SQLite and MariaDB there).

Private to ``core.ledger`` (an import-linter contract keeps it so).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from typing import Any

from django.db import connection
from django.db.models import Field

from ..domain.states import State
from ..models import Execution, ExecutionEvent
from .types import Delivery


def enabled() -> bool:
    """True when the current connection is PostgreSQL (data-modifying CTEs, RETURNING)."""
    return connection.vendor == "postgresql"


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


@cache
def _insert_sql() -> tuple[str, tuple[Field[Any, Any], ...]]:
    fields = tuple(f for f in Execution._meta.concrete_fields if not f.primary_key)
    columns = ", ".join(_q(str(f.column)) for f in fields)
    # due_at: a parked execution is due at its scheduled time (an instant the caller chose);
    # otherwise it is the rescuer's next look at the row, set by the database's clock from how
    # far ahead the writer wants it, so a producer whose clock is off does not move it.
    placeholders = ", ".join(
        "COALESCE(%s::timestamptz, statement_timestamp() + %s::interval)" if f.attname == "due_at" else "%s"
        for f in fields
    )
    key = _q("idempotency_key")
    sql = (
        f"INSERT INTO {_q(Execution._meta.db_table)} ({columns}) VALUES ({placeholders}) "
        f"ON CONFLICT ({key}) DO NOTHING RETURNING {_q('id')}, {_q('due_at')}"
    )
    return sql, fields


def insert(execution: Execution, now: datetime) -> bool:
    """Insert ``execution`` unless its key exists; True (and ``pk`` set) if it was inserted.

    ``ON CONFLICT DO NOTHING`` means no error path, so no savepoint is needed even inside
    the caller's transaction.
    """
    execution.created_at = execution.updated_at = now
    sql, fields = _insert_sql()
    values: list[Any] = []
    for f in fields:
        if f.attname != "due_at":
            values.append(f.get_db_prep_save(getattr(execution, f.attname), connection))
        elif execution.due_at is None or execution.due_at == execution.scheduled_for:
            values += [execution.due_at, None]
        else:
            values += [None, execution.due_at - now]
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return False
    execution.pk, execution.due_at = row[0], row[1]
    execution._state.adding = False
    execution._state.db = connection.alias
    return True


#: Rows per multi-row ``INSERT`` (``insert_many``). About 26 parameters a row keeps a full
#: statement far below PostgreSQL's 65,535 bind parameters; measured, larger statements
#: gain nothing per row.
INSERT_MANY_ROWS = 1000


@cache
def _insert_many_sql(rows: int) -> str:
    _sql, fields = _insert_sql()
    columns = ", ".join(_q(str(f.column)) for f in fields)
    # due_at as in ``insert``: the caller's instant for a parked row, else the database's clock.
    row = ", ".join(
        "COALESCE(%s::timestamptz, statement_timestamp() + %s::interval)" if f.attname == "due_at" else "%s"
        for f in fields
    )
    return (
        f"INSERT INTO {_q(Execution._meta.db_table)} ({columns}) VALUES {', '.join([f'({row})'] * rows)} "
        f"ON CONFLICT ({_q('idempotency_key')}) DO NOTHING "
        f"RETURNING {_q('id')}, {_q('idempotency_key')}, {_q('due_at')}"
    )


def insert_many(executions: list[Execution], now: datetime) -> int:
    """``insert`` for many rows: one ``INSERT … VALUES (…), (…) ON CONFLICT DO NOTHING`` per
    ``INSERT_MANY_ROWS``; returns how many were inserted.

    Each inserted instance gets its ``pk`` and ``due_at`` (matched by key: ``RETURNING`` does
    not promise the order of ``VALUES``); an instance whose key already existed keeps
    ``pk = None``. The keys must be distinct (the caller collapses repeats).
    """
    _sql, fields = _insert_sql()
    prep = [(f.attname, f) for f in fields]
    inserted = 0
    for start in range(0, len(executions), INSERT_MANY_ROWS):
        chunk = executions[start : start + INSERT_MANY_ROWS]
        values: list[Any] = []
        for execution in chunk:
            execution.created_at = execution.updated_at = now
            for attname, f in prep:
                if attname != "due_at":
                    values.append(f.get_db_prep_save(getattr(execution, attname), connection))
                elif execution.due_at is None or execution.due_at == execution.scheduled_for:
                    values += [execution.due_at, None]
                else:
                    values += [None, execution.due_at - now]
        with connection.cursor() as cursor:
            cursor.execute(_insert_many_sql(len(chunk)), values)
            rows = cursor.fetchall()
        by_key = {key: (pk, due_at) for pk, key, due_at in rows}
        for execution in chunk:
            found = by_key.get(execution.idempotency_key)
            if found is not None:
                execution.pk, execution.due_at = found
                execution._state.adding = False
                execution._state.db = connection.alias
        inserted += len(rows)
    return inserted


_EVENT_COLUMNS = "execution_id, at, kind, from_state, to_state, attempt, fencing_token, actor, reason, data"


@cache
def _claim_sql() -> str:
    ex, job, ev = (
        _q(Execution._meta.db_table),
        _q("taskplatform_jobdefinition"),
        _q(ExecutionEvent._meta.db_table),
    )
    return f"""
        WITH u AS (
            UPDATE {ex} AS e SET
                state = 'RUNNING',
                attempts = e.attempts + 1,
                fencing_token = e.fencing_token + 1,
                lease_expires_at = statement_timestamp() + make_interval(secs => COALESCE(
                    (SELECT j.lease_seconds FROM {job} AS j WHERE j.id = e.job_id), %(lease)s)),
                worker = %(worker)s,
                celery_task_id = %(task_id)s,
                started_at = %(now)s,
                due_at = NULL,
                updated_at = %(now)s
            WHERE e.id = %(id)s AND e.state = 'PENDING' AND e.attempts = 0
              AND (e.lease_expires_at IS NULL OR e.lease_expires_at <= statement_timestamp())
            RETURNING e.id, e.idempotency_key, e.job_id, e.attempts, e.fencing_token, e.lease_expires_at,
                      e.{_q("trigger")}, e.queue, e.priority, e.scheduled_for, e.created_at, e.publish_count,
                      round(EXTRACT(EPOCH FROM e.lease_expires_at - statement_timestamp()))::int AS lease_seconds
        ), ev AS (
            INSERT INTO {ev} ({_EVENT_COLUMNS})
            SELECT u.id, %(now)s, 'claimed', 'PENDING', 'RUNNING', u.attempts, u.fencing_token, %(worker)s, '',
                   jsonb_build_object('celery_task_id', %(task_id)s::text, 'lease_seconds', u.lease_seconds)
            FROM u
        )
        SELECT * FROM u
    """


def claim_first_attempt(
    delivery: Delivery, *, default_lease_seconds: int, now: datetime
) -> tuple[Execution, int] | None:
    """Claim a ``PENDING`` execution that has never been attempted, in one statement.

    Returns the claimed execution (with the arguments from the message, which are the
    ledger's) and its lease in seconds, or None when the row is in any other condition,
    a fence left by an operator's stop of a running attempt included: the portable path
    decides. The lease and the fence are the database's clock (``statement_timestamp()``).
    """
    params: dict[str, Any] = {
        "id": delivery.execution_id,
        "now": now,
        "lease": default_lease_seconds,
        "worker": delivery.worker[:255],
        "task_id": delivery.celery_task_id[:255],
    }
    with connection.cursor() as cursor:
        cursor.execute(_claim_sql(), params)
        row = cursor.fetchone()
    if row is None:
        return None
    (
        pk,
        key,
        job_id,
        attempts,
        token,
        lease_until,
        trigger,
        queue,
        priority,
        scheduled_for,
        created_at,
        pubs,
        lease,
    ) = row
    execution = Execution(
        id=pk,
        idempotency_key=key,
        job_id=job_id,
        task_name=delivery.task_name,
        args=delivery.args,
        kwargs=delivery.kwargs,
        trigger=trigger,
        queue=queue,
        priority=priority,
        state=State.RUNNING,
        attempts=attempts,
        fencing_token=token,
        lease_expires_at=lease_until,
        worker=delivery.worker,
        celery_task_id=delivery.celery_task_id,
        scheduled_for=scheduled_for,
        publish_count=pubs,
        created_at=created_at,
        updated_at=now,
        started_at=now,
    )
    execution._state.adding = False
    execution._state.db = connection.alias
    return execution, int(lease)


@cache
def _succeed_sql() -> str:
    ex, ev = _q(Execution._meta.db_table), _q(ExecutionEvent._meta.db_table)
    return f"""
        WITH u AS (
            UPDATE {ex} SET state = 'SUCCEEDED', result = %(result)s::jsonb, finished_at = %(now)s,
                            lease_expires_at = NULL, updated_at = %(now)s
            WHERE id = %(id)s AND state = 'RUNNING' AND fencing_token = %(token)s
            RETURNING id, attempts, fencing_token
        ), ev AS (
            INSERT INTO {ev} ({_EVENT_COLUMNS})
            SELECT u.id, %(now)s, 'succeeded', 'RUNNING', 'SUCCEEDED', u.attempts, u.fencing_token, %(worker)s, '',
                   %(data)s::jsonb
            FROM u
        )
        SELECT count(*) FROM u
    """


def succeed(execution_id: int, token: int, result: Any, *, worker: str, data: dict[str, Any], now: datetime) -> bool:
    """The success compare-and-set and its event in one statement; False if ``token`` is stale."""
    params: dict[str, Any] = {
        "id": execution_id,
        "token": token,
        "result": None if result is None else json.dumps(result),
        "now": now,
        "worker": worker[:255],
        "data": json.dumps(data),
    }
    with connection.cursor() as cursor:
        cursor.execute(_succeed_sql(), params)
        (matched,) = cursor.fetchone()
    return bool(matched)
