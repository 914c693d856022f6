"""Single-statement forms of the ledger's three hot writes, for PostgreSQL.

The portable protocol in ``ledger`` takes a read plus a transaction of two statements for a
claim and for a success (about nine round trips per execution). On PostgreSQL the same
compare-and-set, and its event row, fit in one statement each, using a data-modifying CTE:
the event is inserted from the ``UPDATE``'s ``RETURNING`` rows, so it exists if and only if
the compare-and-set matched. Semantics are identical; the portable path still handles
every case these do not (retries, takeovers, duplicates, other databases), and the ledger
test suite runs both (PostgreSQL here, SQLite and MariaDB there).

The claim and the success find their row by primary key only: their state condition is
written ``(state = …) IS TRUE``, which no index serves. Written plainly, PostgreSQL may pick
an index on ``state`` instead whenever its statistics make the state look rare (analysed in
a quiet hour, then a burst of new rows; or a table not analysed yet): measured, with 3,000
pending rows the claim then walked all of them, 2.6 ms instead of 0.2 ms, and the cost grows
with the burst (``tests/ledger/test_pg_plans.py``).

Private to ``core.ledger`` (an import-linter contract keeps it so).
"""

from __future__ import annotations

import json
import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import fields as dataclass_fields
from datetime import datetime
from functools import cache
from typing import Any, cast

from django.db import DEFAULT_DB_ALIAS, connection, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field, Model
from django.db.models.fields import AutoFieldMixin

from ..conf import platform_settings
from ..models import Execution, ExecutionEvent
from .types import Delivery, FinishedAttempt, NewExecution

log = logging.getLogger("taskplatform.ledger")


def enabled() -> bool:
    """True when the current connection is PostgreSQL (data-modifying CTEs, RETURNING)."""
    return _db().vendor == "postgresql"


def _db() -> BaseDatabaseWrapper:
    """This thread's connection itself: every attribute read through the ``connection``
    proxy costs a context-local lookup, and the hot paths read dozens (one per column)."""
    return connections[DEFAULT_DB_ALIAS]


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


def _raw_cursor_allowed(db: BaseDatabaseWrapper) -> bool:
    """Whether ``_run`` may go around Django's cursor on this connection.

    Only on psycopg 3 (with psycopg2, Django's cursor), only on Django's own PostgreSQL
    backend (a subclass may do its work in ``_cursor`` or ``create_cursor``: a schema per
    tenant, query metrics), and only when nothing watches the queries (``DEBUG``'s query log,
    ``CaptureQueriesContext``, execute wrappers) and the connection's time-zone loader is the
    one Django would use (``create_cursor`` registers another per cursor otherwise).

    What watches the queries can change from one statement to the next and is looked at every
    time; the rest belongs to the wrapper's class and to the psycopg connection, and is worked
    out once per connection (``_CURSOR_CHECKED``).
    """
    return _own_cursor(db) is not None


def _own_cursor(db: BaseDatabaseWrapper) -> tuple[Any, bool] | None:
    """``_run``'s cursor on this connection and whether it reads results in binary, or None
    where Django's cursor must run the statement (``_raw_cursor_allowed``).

    The cursor is kept for the connection (``_CURSORS``): a new one per statement built its
    loaders and dumpers afresh each time (measured, about 15 µs a statement)."""
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3 or db.queries_logged or db.execute_wrappers:
        return None
    conn, kind = db.connection, type(db)
    seen = (kind, kind.create_cursor, getattr(kind, "_cursor", None), db.timezone)
    checked = _CURSOR_CHECKED.get(conn)
    if checked is None or checked[0] != seen:
        checked = _CURSOR_CHECKED[conn] = (seen, _own_cursor_and_loader(db), _binary_results(db))
    if not checked[1]:
        return None
    cursor = _CURSORS.get(db)
    if cursor is None or cursor.connection is not conn:
        import psycopg

        cursor = _CURSORS[db] = psycopg.Cursor(conn)
    return cursor, checked[2]


#: psycopg connection → (what the answers depend on besides the connection: the wrapper's
#: class, its cursor methods, which something may patch, and its time zone; whether ``_run``
#: may use a cursor of its own on it; whether it reads results in binary): what
#: ``_own_cursor`` works out once per connection.
_CURSOR_CHECKED: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], bool, bool]] = weakref.WeakKeyDictionary()
#: Django's connection wrapper → ``_run``'s psycopg cursor on its current connection. Keyed by
#: the wrapper, not the psycopg connection: the cursor refers to its connection, which a weak
#: key would then never let go (one dead connection kept for every reconnection).
_CURSORS: weakref.WeakKeyDictionary[BaseDatabaseWrapper, Any] = weakref.WeakKeyDictionary()


def _own_cursor_and_loader(db: BaseDatabaseWrapper) -> bool:
    from django.db.backends.base.base import BaseDatabaseWrapper as Base
    from django.db.backends.postgresql import base as postgresql

    kind = type(db)
    own_cursor = getattr(kind, "_cursor", None) is getattr(Base, "_cursor", None)
    if kind.create_cursor is not postgresql.DatabaseWrapper.create_cursor or not own_cursor:
        return False
    from psycopg.pq import Format

    loader = db.connection.adapters.get_loader(postgresql.TIMESTAMPTZ_OID, Format.TEXT)
    return getattr(loader, "timezone", None) == db.timezone


def _binary_results(db: BaseDatabaseWrapper) -> bool:
    """Whether the hot statements' rows may be read in binary: what they return (integers,
    strings, timestamps; their JSON columns come back NULL) loads to the same values as
    through Django's text loaders, and in C, where Django's time-stamp loader parses text in
    Python (measured, 4 µs a time stamp). The time stamps come in the connection's time zone,
    which must be the one Django's loader gives them (it is: Django sets the session's
    ``TimeZone`` to it), and the binary loader must be psycopg's own."""
    from django.db.backends.postgresql import base as postgresql
    from psycopg.pq import Format

    conn = db.connection
    loader = conn.adapters.get_loader(postgresql.TIMESTAMPTZ_OID, Format.BINARY)
    stock = loader is not None and loader.__module__.split(".")[0] in ("psycopg", "psycopg_binary", "psycopg_c")
    return stock and conn.info.timezone == db.timezone and _binary_safe(tuple(Execution._meta.concrete_fields))


#: Internal types of the columns the hot statements return whose binary form psycopg loads to
#: what Django's text loaders give: Django registers text-only loaders for others (``jsonb``,
#: ``inet``, ``cidr``), which binary reads would bypass. JSON columns come back NULL
#: (``_returning``).
_BINARY_SAFE = frozenset(
    {"AutoField", "BigAutoField", "BigIntegerField", "BooleanField", "CharField", "DateTimeField", "ForeignKey",
     "IntegerField", "PositiveIntegerField", "PositiveSmallIntegerField", "SmallIntegerField", "TextField"}
)  # fmt: skip


@cache
def _binary_safe(fields: tuple[Field[Any, Any], ...]) -> bool:
    """Whether every column of ``fields`` that a hot statement returns loads the same in binary
    (``_BINARY_SAFE``; JSON columns are returned NULL); a column added to the execution row of
    another type turns binary reads off rather than load it differently."""
    return all(f.get_internal_type() in _BINARY_SAFE | {"JSONField"} for f in fields)


#: ``prepare_threshold`` lent to a connection Django opened with none (its default, which makes
#: psycopg ignore ``prepare=True`` too) for the time of one hot statement, then taken back: only
#: these statements are prepared, and psycopg keeps no record of Django's own (with a threshold
#: it remembers the last hundred statement texts, each with its parameters inlined by Django).
_ONLY_WHEN_ASKED = sys.maxsize

#: SQLSTATE of a prepared statement whose result changed type ("cached plan must not change
#: result type": a migration altered a returned column while this process ran).
_RESULT_TYPE_CHANGED = "0A000"
#: SQLSTATEs of a prepared statement the server does not have: gone (26000: a pooler moved the
#: session to another server connection, or ``DISCARD ALL`` ran behind psycopg's back), or its
#: name taken (42P05: a pooler's server connection holds another client's statements).
_NOT_ON_THE_SERVER = frozenset({"26000", "42P05"})
#: psycopg connections that lost a prepared statement: they run the hot statements unprepared
#: until they are closed (weak: a pooled connection is marked for as long as it lives).
_UNPREPARED_CONNECTIONS: weakref.WeakSet[Any] = weakref.WeakSet()
#: Database aliases behind something that loses prepared statements (a transaction-mode
#: pooler): this process runs their hot statements unprepared from the first loss on.
_UNPREPARED_ALIASES: set[str] = set()


def _prepared(db: BaseDatabaseWrapper) -> bool:
    """Whether ``_run`` prepares its statement on ``db``'s connection: ``prepared_statements``
    on, no ``prepare_threshold: None`` in the database's ``OPTIONS`` (a host that turned
    psycopg's preparation off on purpose, say for a pooler), and no prepared statement lost on
    this connection, nor one of the kind a pooler causes on any connection of this alias."""
    if not platform_settings().prepared_statements:
        return False
    options = db.settings_dict.get("OPTIONS") or {}
    if "prepare_threshold" in options and options["prepare_threshold"] is None:
        return False
    return db.alias not in _UNPREPARED_ALIASES and db.connection not in _UNPREPARED_CONNECTIONS


def _run(sql: str, params: Sequence[Any] | dict[str, Any], *, prepare: bool = True) -> list[tuple[Any, ...]]:
    """Execute one of the hot statements and return its rows.

    On psycopg's own cursor, parameters bound by the server, rather than on Django's cursor,
    which interpolates every parameter into the statement's text in Python (Django's
    default, for connection poolers): measured on the worker's claim and success, 350 µs of
    the 590 µs of CPU the ledger added per task went into that and into the cursor wrapper.

    Prepared once per connection (``TASKPLATFORM_PREPARED_STATEMENTS``, on by default): parse,
    analysis and planning were half of PostgreSQL's CPU for these statements, measured
    (787 → 337 µs a task, wall time per task in a worker 1.60 → 1.19 ms). When the server no
    longer has a statement in its prepared form (``_PREPARED_STATEMENT_LOST``: a migration, a
    pooler, a ``DISCARD ALL``), refused, it did nothing: outside a transaction it is run again
    at once, unprepared; inside one, the transaction is aborted and the error reaches the
    caller (an atomic attempt is then rescued and run again). Either way this connection runs
    the hot statements unprepared from then on; after a loss of the pooler's kind (26000,
    42P05) every connection of that database in this process does, so a pooler costs one
    failure a process. Behind PgBouncer in transaction mode before 1.22 (or with
    ``max_prepared_statements = 0``), set ``TASKPLATFORM_PREPARED_STATEMENTS = False``.

    It does what Django's cursor does first: the health check, the connection, the thread
    check and the broken-transaction check (a statement in an atomic block marked for
    rollback must fail, not succeed and then vanish with the rollback). Errors are Django's
    (``wrap_database_errors``), so callers catch ``OperationalError`` as before. Where the
    raw cursor is not allowed (``_raw_cursor_allowed``), Django's cursor runs the statement.
    """
    db = _db()
    db.close_if_health_check_failed()
    db.ensure_connection()
    own = _own_cursor(db)
    if own is None:
        with db.cursor() as django_cursor:
            django_cursor.execute(sql, params)
            return django_cursor.fetchall()
    import psycopg  # psycopg 3 is installed (``_own_cursor``)

    cursor, binary = own
    db.validate_no_broken_transaction()
    with db.wrap_database_errors:
        db.validate_thread_sharing()
        conn = db.connection
        prepare = prepare and _prepared(db)
        lent = prepare and conn.prepare_threshold is None
        try:
            if lent:
                conn.prepare_threshold = _ONLY_WHEN_ASKED
            try:
                cursor.execute(sql, params, prepare=prepare, binary=binary)
            finally:
                if lent:
                    conn.prepare_threshold = None
        except psycopg.Error as exc:
            if not prepare or not (exc.sqlstate == _RESULT_TYPE_CHANGED or exc.sqlstate in _NOT_ON_THE_SERVER):
                raise
            _UNPREPARED_CONNECTIONS.add(conn)
            if exc.sqlstate in _NOT_ON_THE_SERVER and db.alias not in _UNPREPARED_ALIASES:
                _UNPREPARED_ALIASES.add(db.alias)
                log.warning(
                    "a prepared statement was lost on database %r (%s): a transaction-mode pooler? "
                    "This process runs the ledger's statements unprepared from now on; set "
                    "TASKPLATFORM_PREPARED_STATEMENTS = False to avoid the first failure.",
                    db.alias,
                    exc.sqlstate,
                )
            if db.in_atomic_block or not conn.autocommit:
                raise
            cursor.execute(sql, params, prepare=False, binary=binary)
        return cursor.fetchall()


@cache
def _attnames() -> tuple[str, ...]:
    return tuple(f.attname for f in Execution._meta.concrete_fields)


def _loaded(row: Sequence[Any], **values: Any) -> Execution:
    """An ``Execution`` from a full row in column order (``RETURNING e.*``), with ``values``
    standing in for some columns, built the way Django builds rows it loads (``from_db``,
    positional: a third of the cost of keyword arguments)."""
    names = _attnames()
    if values:
        row = [values.get(name, value) for name, value in zip(names, row, strict=True)]
    return Execution.from_db(DEFAULT_DB_ALIAS, names, row)


#: Django's stock field classes whose prepared value (``get_db_prep_save`` on PostgreSQL) is the
#: Python value itself when it already has this exact type (for ``DateTimeField``: an aware
#: datetime), or for integers the value in psycopg's wrapper for the column's size (Django's
#: ``adapt_integerfield_value``): ``get_prep_value`` only converts a value to that type.
_SAME_WHEN: dict[type[Field[Any, Any]], type] = {
    models.CharField: str, models.TextField: str, models.IntegerField: int, models.BigIntegerField: int,
    models.SmallIntegerField: int, models.PositiveIntegerField: int, models.PositiveSmallIntegerField: int,
    models.BooleanField: bool, models.DateTimeField: datetime, models.AutoField: int, models.BigAutoField: int,
}  # fmt: skip

#: How ``_prepare`` binds a value of a field: (the exact type it takes as it is, or None for
#: none: Django's path for every value; the wrapper of an integer, else None).
Shortcut = tuple[type | None, Callable[[Any], Any] | None]


def _shortcut(f: Field[Any, Any]) -> Shortcut:
    """What ``_prepare`` may do without Django for ``f``: a foreign key is its target's; a
    subclass (which may prepare its own way) and every other field take Django's path."""
    target = f.target_field if type(f) is models.ForeignKey else f
    kind = _SAME_WHEN.get(type(target))
    if kind is not int or isinstance(target, AutoFieldMixin):  # a key: Django binds it as it is
        return kind, None
    wrappers = getattr(_db().ops, "integerfield_type_map", None)  # psycopg 3's Int2, Int4, Int8
    wrap = wrappers.get(target.get_internal_type()) if wrappers else None
    return (int, wrap) if wrap is not None else (None, None)


def _prepare(f: Field[Any, Any], shortcut: Shortcut, value: Any, db: BaseDatabaseWrapper) -> Any:
    """``f.get_db_prep_save(value, db)``, without Django's calls when ``value`` is None or of
    the field's exact type (``_shortcut``): 26 fields an insert, 20 a claim, about 2 µs each."""
    kind, wrap = shortcut
    if kind is not None:
        if value is None:
            return None
        if type(value) is kind:
            if wrap is not None:
                return wrap(value)
            if kind is not datetime or cast(datetime, value).utcoffset() is not None:  # aware, as Django tells
                return value
    return f.get_db_prep_save(value, db)


@cache
def _insert_shortcuts() -> tuple[Shortcut, ...]:
    return tuple(_shortcut(f) for f in _insert_sql()[1])


@cache
def _create_claimed_shortcuts(carrying: bool) -> tuple[Shortcut, ...]:
    return tuple(_shortcut(f) for f in _create_claimed_sql(carrying)[1])


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
    shortcuts = _insert_shortcuts()
    db = _db()
    values: list[Any] = []
    for f, shortcut in zip(fields, shortcuts, strict=True):
        if f.attname != "due_at":
            values.append(_prepare(f, shortcut, getattr(execution, f.attname), db))
        elif execution.due_at is None or execution.due_at == execution.scheduled_for:
            values += [execution.due_at, None]
        else:
            values += [None, execution.due_at - now]
    rows = _run(sql, values)
    if not rows:
        return False
    execution.pk, execution.due_at = rows[0]
    execution._state.adding = False
    execution._state.db = DEFAULT_DB_ALIAS
    return True


#: Rows per multi-row ``INSERT`` (``insert_many``).
INSERT_MANY_ROWS = 1000


def _per_row_fields() -> frozenset[str]:
    """The columns ``insert_many`` reads from each row: what ``NewExecution`` sets. Every other
    column holds the same value in every new row (the model's default, the state, the time of
    the insert)."""
    names = {f.name for f in dataclass_fields(NewExecution)}
    return frozenset(f.attname for f in Execution._meta.concrete_fields if f.name in names)


@cache
def _insert_many_sql() -> tuple[str, tuple[Field[Any, Any], ...], tuple[Field[Any, Any], ...]]:
    _sql, fields = _insert_sql()
    per_row = tuple(f for f in fields if f.attname in _per_row_fields() and f.attname != "due_at")
    constant = tuple(f for f in fields if f.attname not in _per_row_fields() and f.attname != "due_at")
    exprs: list[str] = []
    for f in fields:
        if f.attname == "due_at":  # as in ``insert``: the caller's instant if parked, else the database's clock
            exprs.append("COALESCE(r.due_at, statement_timestamp() + make_interval(secs => r.due_in))")
        elif f in per_row:
            exprs.append(f"r.{_q(str(f.column))}")
        else:
            exprs.append("%s")
    record = ", ".join(
        [f"{_q(str(f.column))} {f.db_type(connection)}" for f in per_row] + ["due_at timestamptz", "due_in float8"]
    )
    sql = (
        f"INSERT INTO {_q(Execution._meta.db_table)} ({', '.join(_q(str(f.column)) for f in fields)}) "
        f"SELECT {', '.join(exprs)} FROM jsonb_to_recordset(%s::jsonb) AS r({record}) "
        f"ON CONFLICT ({_q('idempotency_key')}) DO NOTHING "
        f"RETURNING {_q('id')}, {_q('idempotency_key')}, {_q('due_at')}"
    )
    return sql, per_row, constant


#: Field types whose Python values are already what ``jsonb_to_recordset`` reads.
_AS_IS = frozenset(
    {"CharField", "TextField", "JSONField", "IntegerField", "BigIntegerField", "PositiveIntegerField",
     "PositiveSmallIntegerField", "SmallIntegerField", "BooleanField"}
)  # fmt: skip


def _json_value(value: Any) -> Any:
    """A value of a ``NewExecution`` field as ``jsonb_to_recordset`` reads it."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Model):  # a foreign key (``job``): its id
        return value.pk
    return value


def insert_many(specs: Sequence[NewExecution], now: datetime) -> dict[str, tuple[int, datetime]]:
    """``insert`` for many new executions, ``INSERT_MANY_ROWS`` a statement: for each key
    inserted, its id and due time (a key that already existed is absent).

    One ``INSERT … SELECT … FROM jsonb_to_recordset(%s) … ON CONFLICT DO NOTHING RETURNING``
    per chunk: the rows travel as one JSON parameter. Measured against a multi-row
    ``VALUES (…), (…)`` with about 26 parameters a row, it took a third of the time for
    10,000 rows: psycopg no longer parses and adapts a 26,000-placeholder statement, and
    Django no longer prepares each value of each field. Columns that ``NewExecution`` does
    not set hold the same value in every new row and are sent once. Run by ``_run``: the JSON
    parameter bound by the server rather than quoted into the statement's text by Django's
    cursor, the returned rows read in binary (10,000 rows: the ledger's part 0.55 → 0.48 s).
    Not prepared: it always runs in a transaction, where ``_run`` cannot run again unprepared
    a statement whose prepared form the server lost (a migration, a pooler), and the batch
    would fail; planned once a thousand rows, it costs little.

    The keys must be distinct (the caller collapses repeats).
    """
    if not specs:
        return {}
    sql, per_row, constant = _insert_many_sql()
    # Most fields are JSON as they are; only datetimes and the job need ``_json_value``.
    plain = [(str(f.column), f.name) for f in per_row if f.get_internal_type() in _AS_IS]
    other = [(str(f.column), f.name) for f in per_row if f.get_internal_type() not in _AS_IS]
    template = specs[0].build()
    template.created_at = template.updated_at = now
    constants = [f.get_db_prep_save(getattr(template, f.attname), connection) for f in constant]
    inserted: dict[str, tuple[int, datetime]] = {}
    for start in range(0, len(specs), INSERT_MANY_ROWS):
        rows: list[dict[str, Any]] = []
        for spec in specs[start : start + INSERT_MANY_ROWS]:
            row = {column: getattr(spec, name) for column, name in plain}
            for column, name in other:
                row[column] = _json_value(getattr(spec, name))
            due_at = spec.due_at
            if due_at is None or due_at == spec.scheduled_for:
                row["due_at"], row["due_in"] = _json_value(due_at), None
            else:
                row["due_at"], row["due_in"] = None, (due_at - now).total_seconds()
            rows.append(row)
        found = _run(sql, [*constants, json.dumps(rows, allow_nan=False, separators=(",", ":"))], prepare=False)
        inserted.update((key, (pk, due_at)) for pk, key, due_at in found)
    return inserted


def _returning(alias: str) -> str:
    """Every column of the execution row, in field order, for a ``RETURNING`` clause that
    ``_loaded`` reads back; the JSON columns as ``NULL`` (the caller has their values, and
    ``from_db`` would not decode them)."""
    return ", ".join(
        "NULL" if f.get_internal_type() == "JSONField" else f"{alias}.{_q(str(f.column))}"
        for f in Execution._meta.concrete_fields
    )


_EVENT_COLUMNS = "execution_id, at, kind, from_state, to_state, attempt, fencing_token, actor, reason, data"


def _success_ctes(ph: Callable[[str], str], *, carried: bool = False) -> str:
    """The success's compare-and-set (``s``) and its event (``s_ev``) as two CTEs; ``ph``
    gives each parameter's placeholder: ``succeed``'s own statement, and a claim that carries
    the success of the attempt before it (``FinishedAttempt``). Carried, the row is first
    locked without waiting (``s_row``): a claim must not wait on another transaction's lock of
    a finished attempt's row (its lease runs from the statement's start); a row locked
    elsewhere is left to the recorder thread, whose own statement waits."""
    ex, ev = _q(Execution._meta.db_table), _q(ExecutionEvent._meta.db_table)
    row = ph("id")
    lock = ""
    if carried:
        lock = f"s_row AS (SELECT id FROM {ex} WHERE id = {row} FOR UPDATE SKIP LOCKED), "
        row = "(SELECT id FROM s_row)"
    return f"""
        {lock}s AS (
            UPDATE {ex} SET state = 'SUCCEEDED', result = {ph("result")}::jsonb, finished_at = {ph("now")},
                            lease_expires_at = NULL, updated_at = {ph("now")}
            WHERE id = {row} AND (state = 'RUNNING') IS TRUE AND fencing_token = {ph("token")}
            RETURNING id, attempts, fencing_token
        ), s_ev AS (
            INSERT INTO {ev} ({_EVENT_COLUMNS})
            SELECT s.id, {ph("now")}, 'succeeded', 'RUNNING', 'SUCCEEDED', s.attempts, s.fencing_token,
                   {ph("worker")}, '', {ph("data")}::jsonb
            FROM s
        )"""


def _success_params(
    execution_id: int, token: int, result: Any, worker: str, data: dict[str, Any], now: datetime
) -> dict[str, Any]:
    return {
        "id": execution_id,
        "token": token,
        "result": None if result is None else json.dumps(result),
        "now": now,
        "worker": worker[:255],
        "data": json.dumps(data),
    }


def _carrying(ctes: str, carrying: bool, ph: Callable[[str], str]) -> str:
    """A claim's statement from its CTEs (``u``, the claimed row, and its event), carrying a
    finished attempt's success when ``carrying``: its CTEs go first (the positional placeholders
    come first), and the claim's row comes back with one more column, 1 if the success's
    compare-and-set matched, 0 if not, and one more, 1 if its row could be locked at once;
    always one row (all NULL but those columns when the claim matched nothing)."""
    if not carrying:
        return f"WITH {ctes} SELECT * FROM u"
    return f"""WITH {_success_ctes(ph, carried=True)}, {ctes}
        SELECT u.*, (SELECT count(*) FROM s), (SELECT count(*) FROM s_row)
        FROM (VALUES (1)) AS one (x) LEFT JOIN u ON true"""


def _settle(rows: list[tuple[Any, ...]], carried: FinishedAttempt | None) -> tuple[Any, ...] | None:
    """The claim's row from a ``_carrying`` statement's rows, having noted whether the success
    it carried was written (True), refused as stale (False), or not tried because another
    transaction held its row (None: the recorder thread writes it)."""
    if carried is None:
        return rows[0] if rows else None
    *row, matched, locked = rows[0]
    carried.written = bool(matched) if locked else None
    return None if row[0] is None else tuple(row)


@cache
def _claim_sql(carrying: bool) -> str:
    ex, ev = _q(Execution._meta.db_table), _q(ExecutionEvent._meta.db_table)
    ctes = f"""
            u AS (
            UPDATE {ex} AS e SET
                state = 'RUNNING',
                attempts = e.attempts + 1,
                fencing_token = e.fencing_token + 1,
                lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
                worker = %(worker)s,
                celery_task_id = %(task_id)s,
                started_at = %(now)s,
                due_at = NULL,
                updated_at = %(now)s
            WHERE e.id = %(id)s AND (e.state = 'PENDING') IS TRUE AND e.attempts = 0 AND e.task_name = %(task)s
              AND (e.lease_expires_at IS NULL OR e.lease_expires_at <= statement_timestamp())
            RETURNING {_returning("e")},
                      round(EXTRACT(EPOCH FROM e.lease_expires_at - statement_timestamp()))::int AS lease_seconds
        ), ev AS (
            INSERT INTO {ev} ({_EVENT_COLUMNS})
            SELECT u.id, %(now)s, 'claimed', 'PENDING', 'RUNNING', u.attempts, u.fencing_token, %(worker)s, '',
                   jsonb_build_object('celery_task_id', %(task_id)s::text, 'lease_seconds', u.lease_seconds)
            FROM u
        )"""
    return _carrying(ctes, carrying, lambda name: f"%(s_{name})s")


def claim_first_attempt(
    delivery: Delivery, *, default_lease_seconds: int, now: datetime, carried: FinishedAttempt | None = None
) -> tuple[Execution, int] | None:
    """Claim a ``PENDING`` execution that has never been attempted, in one statement.

    Returns the claimed execution (with the arguments from the message, which are the
    ledger's) and its lease in seconds, or None when the row is in any other condition,
    a fence left by an operator's stop of a running attempt included: the portable path
    decides. The lease and the fence are the database's clock (``statement_timestamp()``).

    ``default_lease_seconds`` is the job's lease, which the publisher puts in the message
    (``HEADER_LEASE``), or the task's: the statement does not read the job definition, a
    correlated subquery that cost a third of the claim's time on the server, measured.

    ``carried``: a finished attempt's success, written in the same statement (``_carrying``).
    """
    params: dict[str, Any] = {
        "id": delivery.execution_id,
        "now": now,
        "lease": default_lease_seconds,
        "worker": delivery.worker[:255],
        "task_id": delivery.celery_task_id[:255],
        "task": delivery.task_name,  # a row of another task is not this message's (``claim_message``)
    }
    if carried is not None:
        params.update({f"s_{name}": value for name, value in _attempt_params(carried).items()})
    found = _settle(_run(_claim_sql(carried is not None), params), carried)
    if found is None:
        return None
    *row, lease = found
    execution = _loaded(row, args=delivery.args, kwargs=delivery.kwargs)
    return execution, int(lease)


@cache
def _create_claimed_sql(carrying: bool) -> tuple[str, tuple[Field[Any, Any], ...], tuple[str, ...]]:
    """The statement, the execution's fields in the order of their placeholders, and the
    carried success's parameters, by name, in the order of theirs (which come first)."""
    fields = tuple(f for f in Execution._meta.concrete_fields if not f.primary_key)
    ex, ev = _q(Execution._meta.db_table), _q(ExecutionEvent._meta.db_table)
    placeholders = ", ".join(
        "statement_timestamp() + make_interval(secs => %s)" if f.attname == "lease_expires_at" else "%s" for f in fields
    )
    order: list[str] = []

    def positional(name: str) -> str:
        order.append(name)
        return "%s"

    ctes = f"""
            u AS (
            INSERT INTO {ex} AS e ({", ".join(_q(str(f.column)) for f in fields)}) VALUES ({placeholders})
            ON CONFLICT ({_q("idempotency_key")}) DO NOTHING
            RETURNING {_returning("e")}
        ), ev AS (
            INSERT INTO {ev} ({_EVENT_COLUMNS})
            SELECT u.id, u.started_at, 'claimed', 'PENDING', 'RUNNING', u.attempts, u.fencing_token, u.worker, '',
                   jsonb_build_object('celery_task_id', u.celery_task_id, 'lease_seconds', %s::int)
            FROM u
        )"""
    sql = _carrying(ctes, carrying, positional)
    return sql, fields, tuple(order)


@cache
def _constant_values() -> dict[str, Any]:
    """The model's default of every column, as ``get_db_prep_save`` prepares it: what
    ``create_claimed`` binds for the columns its caller does not set (they are the same in
    every new row, so they are prepared once, not field by field for every task)."""
    template = Execution()
    db = _db()
    return {
        f.attname: f.get_db_prep_save(getattr(template, f.attname), db)
        for f in Execution._meta.concrete_fields
        if not (f.has_default() and callable(f.default))  # made afresh for each row (``list``, a clock)
    }


def create_claimed(
    values: dict[str, Any], *, lease_seconds: int, carried: FinishedAttempt | None = None
) -> Execution | None:
    """Insert a new execution already claimed by its first attempt, unless its key exists.

    For a plain Celery call, whose row the worker creates: one statement instead of the
    portable read, insert, read and claim. ``values`` are the new row's columns by attribute
    name (``job`` may stand for ``job_id``), with the attempt's (state ``RUNNING``, attempts
    and token 1, worker, message id, start mark); every other column takes the model's
    default; the lease is the database's clock plus ``lease_seconds``. No model instance is
    built before the insert: the one returned is built from the stored row. Returns it, or
    None when the key existed (another delivery of the same call, or a key derived from the
    arguments that another call holds): the portable claim decides then.

    ``carried``: a finished attempt's success, written in the same statement (``_carrying``).
    """
    sql, fields, order = _create_claimed_sql(carried is not None)
    db = _db()
    constants = _constant_values()
    params: list[Any] = []
    if carried is not None:
        attempt = _attempt_params(carried)
        params.extend(attempt[name] for name in order)
    for f, shortcut in zip(fields, _create_claimed_shortcuts(carried is not None), strict=True):
        name = f.attname
        if name == "lease_expires_at":
            params.append(lease_seconds)
        elif name in values:
            params.append(_prepare(f, shortcut, values[name], db))
        elif name != f.name and f.name in values:  # a foreign key given as its object
            related = values[f.name]
            params.append(_prepare(f, shortcut, None if related is None else related.pk, db))
        elif name in constants:
            params.append(constants[name])
        else:  # a default made afresh for each row
            params.append(f.get_db_prep_save(f.get_default(), db))
    found = _settle(_run(sql, [*params, lease_seconds]), carried)
    if found is None:
        return None
    return _loaded(found, args=values["args"], kwargs=values["kwargs"], result=None)


@cache
def _succeed_sql() -> str:
    return f"WITH {_success_ctes(lambda name: f'%({name})s')} SELECT count(*) FROM s"


def succeed(execution_id: int, token: int, result: Any, *, worker: str, data: dict[str, Any], now: datetime) -> bool:
    """The success compare-and-set and its event in one statement; False if ``token`` is stale."""
    params = _success_params(execution_id, token, result, worker, data, now)
    ((matched,),) = _run(_succeed_sql(), params)
    return bool(matched)


def _attempt_params(attempt: FinishedAttempt) -> dict[str, Any]:
    return _success_params(
        attempt.execution_id, attempt.token, attempt.result, attempt.worker, attempt.data, attempt.finished_at
    )
