"""The PostgreSQL fast path (``core/_pg.py``) keeps the portable path's semantics.

Found in review of the hot-path work: the fast path runs its statements on psycopg's own
cursor, so it must repeat what Django's cursor checks (a transaction marked for rollback), fall
back to Django's cursor where it may not go around it (psycopg2, an engine that overrides its
cursors, a query log), and write the same row a plain call's portable create-and-claim wrote.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from taskplatform.core import _pg, ledger
from taskplatform.domain.states import State
from taskplatform.models import EventKind, Execution, ExecutionEvent, JobDefinition, Trigger
from tests.ledger.test_ledger import claim, new

pytestmark = pytest.mark.django_db(transaction=True)


def spec(key: str) -> ledger.NewExecution:
    return ledger.NewExecution(
        idempotency_key=key, task_name="testapp.effect", args=[1, "a"], kwargs={"b": [2]}, trigger=Trigger.CELERY,
        queue="celery", celery_task_id="t-1", publish_count=1,
    )  # fmt: skip


def pg_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the fast path exists on PostgreSQL only")


def first_attempt_claimed(key: str) -> Execution:
    """A submitted execution's first attempt claimed by the fast path: the ``Execution`` the
    claim built from its statement's ``RETURNING``."""
    execution = ledger.create(spec(key))[0]
    claimed = _pg.claim_first_attempt(
        ledger.Delivery(execution.pk, "testapp.effect", [1, "a"], {"b": [2]}, "node-a:1", f"t-{key}"),
        default_lease_seconds=60, now=timezone.now(),
    )  # fmt: skip
    assert claimed is not None
    return claimed[0]


def assert_as_stored(held: Execution, *, exact_types: bool = True) -> None:
    """``held`` equals a fresh read of its row through the ORM, field by field: the value, the
    type (``exact_types=False``: a subclass, where a spec's enum members stand in the row,
    ``Trigger.API``), and each time stamp's time-zone object."""
    stored = Execution.objects.get(pk=held.pk)
    for field in Execution._meta.concrete_fields:
        mine, theirs = getattr(held, field.attname), getattr(stored, field.attname)
        assert mine == theirs, (held.idempotency_key, field.attname)
        same_type = type(mine) is type(theirs) if exact_types else isinstance(mine, type(theirs))
        assert same_type, (held.idempotency_key, field.attname, type(mine), type(theirs))
        if isinstance(theirs, datetime):
            assert mine.tzinfo is theirs.tzinfo, (held.idempotency_key, field.attname)


@pytest.mark.portable
def test_a_success_inside_a_transaction_marked_for_rollback_is_refused_not_lost() -> None:
    """An atomic body that marked its transaction for rollback (``set_rollback``, or an inner
    block that failed and was caught): the success mark must raise, as Django's cursor does,
    not report success and then vanish with the rollback (the attempt would look done to the
    worker while the row stays running)."""
    execution = new("broken-tx")
    token = claim(execution).token
    with transaction.atomic():
        transaction.set_rollback(True)
        with pytest.raises(TransactionManagementError):
            ledger.succeed(ledger.get(execution.pk), token, 1, worker="node-a:1", data={})
        with pytest.raises(TransactionManagementError):
            ledger.create(ledger.NewExecution("broken-tx-2", "testapp.effect", [], {}))
    assert Execution.objects.get(pk=execution.pk).state == State.RUNNING
    assert not Execution.objects.filter(idempotency_key="broken-tx-2").exists()


def test_a_plain_calls_create_and_claim_writes_the_row_the_portable_path_wrote() -> None:
    """``create_claimed`` (one statement) against ``ensure`` + ``claim`` (the portable path):
    the same row, field by field, and the same claim event; the lease is the database's clock."""
    pg_only()
    mark = timezone.now()
    fast = ledger.create_claimed(
        spec("fast"), worker="node-a:1", celery_task_id="t-1", lease_seconds=60, started_at=mark
    )
    assert fast is not None
    portable = ledger.claim(
        ledger.ensure(spec("portable")), worker="node-a:1", celery_task_id="t-1", lease_seconds=60, max_attempts=3,
        started_at=mark,
    )  # fmt: skip
    a, b = Execution.objects.get(idempotency_key="fast"), Execution.objects.get(idempotency_key="portable")
    own = {"id", "idempotency_key", "created_at", "updated_at", "lease_expires_at"}
    same = tuple(f.attname for f in Execution._meta.concrete_fields if f.attname not in own)
    assert {f: getattr(a, f) for f in same} == {f: getattr(b, f) for f in same}
    assert a.state == State.RUNNING and a.due_at is None and a.started_at == mark
    assert a.lease_expires_at is not None and b.lease_expires_at is not None
    assert abs((a.lease_expires_at - b.lease_expires_at).total_seconds()) < 5
    # What the worker holds is what was stored.
    held = fast.execution
    assert {f: getattr(held, f) for f in same} == {f: getattr(a, f) for f in same}
    assert held.pk == a.pk and held.lease_expires_at == a.lease_expires_at and not held._state.adding
    assert portable.outcome == "claimed"
    events = [ExecutionEvent.objects.get(execution_id=e.pk, kind=EventKind.CLAIMED) for e in (a, b)]
    shape = [(e.from_state, e.to_state, e.attempt, e.fencing_token, e.actor, e.data) for e in events]
    assert shape[0] == shape[1]
    assert events[0].at == mark


def test_a_plain_calls_create_and_claim_stores_every_field_of_its_spec() -> None:
    """``create_claimed`` binds the spec's own fields and takes the model's defaults for the
    rest (prepared once): a job given as its object, a flow, a trace context, a priority and a
    scheduled time all land in the row, and the columns the spec does not set hold the defaults."""
    pg_only()
    job = JobDefinition.objects.create(slug="fast-job", task="testapp.effect")
    slot = timezone.now() - timedelta(minutes=1)
    full = ledger.NewExecution(
        idempotency_key="full", task_name="testapp.effect", args=[3], kwargs={"c": 4}, trigger=Trigger.BEAT,
        job=job, queue="reports", priority=7, scheduled_for=slot, celery_task_id="t-9", publish_count=1,
        trace_context="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", flow_id=42,
    )  # fmt: skip
    created = ledger.create_claimed(full, worker="node-a:1", celery_task_id="t-9", lease_seconds=60, started_at=slot)
    assert created is not None
    row = Execution.objects.get(idempotency_key="full")
    assert (row.job_id, row.queue, row.priority, row.scheduled_for, row.flow_id, row.trace_context) == (
        job.pk,
        "reports",
        7,
        slot,
        42,
        full.trace_context,
    )
    assert (row.trigger, row.args, row.kwargs, row.publish_count) == (Trigger.BEAT, [3], {"c": 4}, 1)
    defaults = Execution()
    for name in ("result", "last_error", "last_traceback", "finished_at", "waiting_on_limit", "limit_backoffs"):
        assert getattr(row, name) == getattr(defaults, name), name
    assert created.execution.job_id == job.pk and created.execution.flow_id == 42


def test_a_cursor_method_patched_on_the_wrapper_class_is_seen_by_the_next_statement(monkeypatch) -> None:
    """``_raw_cursor_allowed`` works its checks out once per connection, keyed by the
    wrapper's class and cursor methods: a ``create_cursor`` patched on the wrapper's class
    after a first statement (an APM agent on a project's own backend) sends the next hot
    statement through Django's cursor."""
    pg_only()
    db = _pg._db()
    db.ensure_connection()
    own_backend = type("ProjectWrapper", (type(db),), {})  # a project's backend, nothing overridden yet
    monkeypatch.setattr(db, "__class__", own_backend)
    assert _pg._raw_cursor_allowed(db)
    original = own_backend.create_cursor
    monkeypatch.setattr(own_backend, "create_cursor", lambda self, name=None: original(self, name))
    assert not _pg._raw_cursor_allowed(db)


def test_every_field_of_a_new_execution_is_a_column_and_no_default_is_frozen() -> None:
    """``NewExecution.columns()`` feeds the insert by field name: a field the model lacks would
    be dropped without a word. And a default made afresh for each row (a callable) is never
    bound as the prepared-once constant (``_pg._constant_values``)."""
    from dataclasses import fields

    names = {f.name for f in Execution._meta.concrete_fields}
    assert {f.name for f in fields(ledger.NewExecution)} <= names
    fields_ = Execution._meta.concrete_fields
    callables = {f.attname for f in fields_ if f.has_default() and callable(f.default)}
    assert callables == {"args", "kwargs"} and not callables & set(_pg._constant_values())
    # Every other column is prepared once, those without a default included.
    assert set(_pg._constant_values()) == {f.attname for f in fields_} - callables


def test_a_plain_calls_lease_is_the_database_clock_not_the_workers() -> None:
    """A worker whose clock is an hour ahead writes the start mark it was given, but the lease
    comes from the database's clock."""
    pg_only()
    ahead = timezone.now() + timedelta(hours=1)
    created = ledger.create_claimed(
        spec("skewed"), worker="node-a:1", celery_task_id="t-1", lease_seconds=60, started_at=ahead
    )
    assert created is not None
    lease = Execution.objects.get(idempotency_key="skewed").lease_expires_at
    assert lease is not None
    assert abs((lease - timezone.now()).total_seconds() - 60) < 10, lease


def _claim_and_succeed(key: str) -> Execution:
    created = ledger.create_claimed(
        spec(key), worker="node-a:1", celery_task_id="t-1", lease_seconds=60, started_at=timezone.now()
    )
    assert created is not None
    ledger.succeed(created.execution, created.token, {"ok": key}, worker="node-a:1", data={})
    execution = new(f"{key}-submitted")
    claimed = ledger.claim_message(
        ledger.Delivery(execution.pk, "testapp.effect", [], {}, "node-a:1", "t-2"),
        default_lease_seconds=60, lease_seconds_for=lambda job: 60, max_attempts_for=lambda job: 3,
    )  # fmt: skip
    assert claimed is not None and claimed.outcome == "claimed"
    ledger.succeed(claimed.execution, claimed.token, None, worker="node-a:1", data={})
    return Execution.objects.get(idempotency_key=key)


def test_the_fast_path_falls_back_to_djangos_cursor_without_psycopg_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment on psycopg2 (Django still supports it): the fast path's statements go
    through Django's cursor, and a plain call is created, claimed and recorded as on psycopg 3."""
    pg_only()
    from django.db.backends.postgresql import psycopg_any

    monkeypatch.setattr(psycopg_any, "is_psycopg3", False)
    monkeypatch.setitem(sys.modules, "psycopg", None)  # ``import psycopg`` would fail
    row = _claim_and_succeed("no-psycopg3")
    assert (row.state, row.result) == (State.SUCCEEDED, {"ok": "no-psycopg3"})


def test_the_fast_path_uses_djangos_cursor_when_queries_are_watched() -> None:
    """Execute wrappers (and the DEBUG query log) see the hot statements: they run on Django's
    cursor then, with the same results."""
    pg_only()
    seen: list[str] = []

    def watch(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(watch):
        row = _claim_and_succeed("watched")
    assert (row.state, row.result) == (State.SUCCEEDED, {"ok": "watched"})
    assert any("INSERT INTO" in sql and "AS e" in sql for sql in seen), "the create-and-claim went unseen"
    assert any("SET state = 'SUCCEEDED'" in sql for sql in seen), "the success mark went unseen"


def test_an_engine_that_overrides_its_cursors_sees_the_hot_statements(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend subclass that does its work in ``create_cursor`` (a schema per tenant, query
    metrics): the fast path does not go around it."""
    pg_only()
    from django.db import connections

    opened: list[int] = []
    wrapper = connections["default"]
    base = type(wrapper)

    class Engine(base):  # type: ignore[valid-type, misc]
        def create_cursor(self, name: Any = None) -> Any:
            opened.append(1)
            return super().create_cursor(name)

    monkeypatch.setattr(wrapper, "__class__", Engine)
    row = _claim_and_succeed("engine")
    assert row.state == State.SUCCEEDED
    assert len(opened) >= 4, "the engine's cursor did not run the hot statements"


def test_the_fast_paths_rows_are_the_stored_rows() -> None:
    """The claim builds the worker's ``Execution`` from the statement's ``RETURNING``: every
    field equals what a fresh read of the row gives (JSON fields from the message)."""
    pg_only()
    assert_as_stored(first_attempt_claimed("loaded"))


@pytest.mark.parametrize(
    ("header", "lease"),
    [(7, 7), (None, 6), ("7", 6), (-5, 6), (10**9, 6), (True, 6)],
    ids=["the-jobs", "none", "a-string", "negative", "absurd", "a-boolean"],
)
def test_a_first_claim_takes_the_jobs_lease_from_the_message_when_it_is_sane(header: Any, lease: int) -> None:
    """The publisher puts the job's lease in the message (``tp_lease``) so that the first claim
    does not read the job definition; a message from elsewhere may carry anything there, and
    then the task's own lease applies (6 s in the test settings)."""
    from taskplatform.conf import platform_settings
    from taskplatform.core.publisher import HEADER_EXECUTION, HEADER_LEASE
    from tests.testapp.tasks import effect

    assert platform_settings().lease_seconds == 6
    execution = ledger.create(ledger.NewExecution(f"lease-{header!r}", "testapp.effect", [], {}))[0]
    headers = {HEADER_EXECUTION: execution.pk}
    if header is not None:
        headers[HEADER_LEASE] = header
    effect.apply(task_id=f"t-{execution.pk}", headers=headers)
    claimed = ExecutionEvent.objects.get(execution_id=execution.pk, kind=EventKind.CLAIMED)
    assert claimed.data["lease_seconds"] == lease
    assert Execution.objects.get(pk=execution.pk).state == State.SUCCEEDED


def _prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def test_the_hot_statements_are_prepared_once_per_connection() -> None:
    """Django opens psycopg 3 connections with preparation off (``prepare_threshold`` None,
    which also ignores ``prepare=True``): the hot statements must be prepared all the same,
    and Django's own statements must not be, nor remembered by psycopg (with a threshold it
    keeps the last hundred statement texts, Django's with their parameters inlined: a 1 MB
    batch insert a time)."""
    pg_only()
    connection.ensure_connection()
    for i in range(3):
        _claim_and_succeed(f"prepared-{i}")
    for i in range(10):  # past psycopg's default threshold (5), had Django's statements one
        Execution.objects.filter(idempotency_key=f"prepared-{i}").count()
    statements = _prepared_statements()
    assert any("INSERT INTO" in s and "AS e" in s for s in statements), statements  # create-and-claim
    assert any("SET state = 'SUCCEEDED'" in s for s in statements), statements
    assert any("state = 'RUNNING'," in s for s in statements), statements  # a submitted row's claim
    assert not any("COUNT(*)" in s for s in statements), "Django's own statements were prepared too"
    conn = connection.connection
    assert conn.prepare_threshold is None, "Django's connection keeps its own setting"
    assert not conn._prepared._counts, "psycopg kept a record of Django's statements"


def test_prepared_statements_can_be_turned_off_for_a_transaction_pooler(settings: Any) -> None:
    """``TASKPLATFORM_PREPARED_STATEMENTS = False`` (a PgBouncer that loses them): none prepared."""
    pg_only()
    settings.TASKPLATFORM_PREPARED_STATEMENTS = False
    connection.close()
    row = _claim_and_succeed("unprepared")
    assert row.state == State.SUCCEEDED
    assert _prepared_statements() == []


def test_a_host_that_turned_preparation_off_in_its_database_options_is_obeyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DATABASES[...]["OPTIONS"]["prepare_threshold"] = None`` is a host's deliberate choice
    (Django's advice behind a pooler): the platform does not override it."""
    pg_only()
    options = {**connection.settings_dict.get("OPTIONS", {}), "prepare_threshold": None}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connection.close()
    try:
        assert _claim_and_succeed("host-says-no").state == State.SUCCEEDED
        assert _prepared_statements() == []
    finally:
        connection.close()


def _alter_elsewhere(sql: str) -> None:
    """Run ``sql`` on another connection, as a migration run by a deploy would."""
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute(sql)


def _executions_of_prepared() -> dict[str, int]:
    """How often each prepared statement of this connection ran (its plans, generic or custom)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT name, generic_plans + custom_plans FROM pg_prepared_statements")
        return dict(cursor.fetchall())


def test_a_migration_that_changes_a_returned_column_does_not_break_a_running_worker(fresh_marks: None) -> None:
    """A column the claim returns changes type while a worker runs (its statements prepared):
    PostgreSQL refuses the prepared form ("cached plan must not change result type", whatever
    the server's language: the SQLSTATE decides). The statement runs again, unprepared: the
    claim and the success hold, and the connection runs them unprepared from then on (a
    refusal on every call would double each round trip)."""
    pg_only()
    _claim_and_succeed("before-migration")
    table = Execution._meta.db_table
    _alter_elsewhere(f'ALTER TABLE "{table}" ALTER COLUMN "publish_count" TYPE bigint')
    try:
        row = _claim_and_succeed("after-migration")
        assert (row.state, row.result) == (State.SUCCEEDED, {"ok": "after-migration"})
        runs = _executions_of_prepared()
        row = _claim_and_succeed("after-migration-2")
        assert row.state == State.SUCCEEDED
        assert _executions_of_prepared() == runs, "the prepared forms are still used on this connection"
    finally:
        _alter_elsewhere(f'ALTER TABLE "{table}" ALTER COLUMN "publish_count" TYPE integer')
        connection.close()


@pytest.fixture
def fresh_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process-wide marks a lost statement leaves, for this test only."""
    import weakref

    monkeypatch.setattr(_pg, "_UNPREPARED_ALIASES", set())
    monkeypatch.setattr(_pg, "_UNPREPARED_CONNECTIONS", weakref.WeakSet())


def test_prepared_statements_lost_behind_psycopgs_back_do_not_fail_the_ledger(fresh_marks: None) -> None:
    """The server forgets the prepared statements while psycopg still names them: a pooler
    that moved the session, a ``DISCARD ALL`` (psycopg 3.2 does not notice a
    ``DEALLOCATE ALL`` either). The claim and the success must hold, not fail with
    "prepared statement does not exist": a plain call's message would be acknowledged with
    no row, a finished body's success lost and the body run again."""
    pg_only()
    _claim_and_succeed("before-discard")
    connection.connection.pgconn.exec_(b"DEALLOCATE ALL")  # not through psycopg: it does not know
    row = _claim_and_succeed("after-discard")
    assert (row.state, row.result) == (State.SUCCEEDED, {"ok": "after-discard"})
    assert _claim_and_succeed("after-discard-2").state == State.SUCCEEDED
    connection.close()


def test_a_poolers_loss_inside_a_transaction_fails_it_once_then_the_process_stops_preparing(fresh_marks: None) -> None:
    """Behind a transaction-mode pooler that does not keep prepared statements, a statement in
    a transaction (a submission in the caller's transaction, an atomic body's success) finds
    its prepared form gone: that transaction fails (it cannot be retried inside it), and from
    then on every connection of the database in this process runs the statements unprepared,
    so the pooler costs one failure a process, not one a connection."""
    pg_only()
    from django.db import ProgrammingError

    _claim_and_succeed("before-pooler")
    connection.connection.pgconn.exec_(b"DEALLOCATE ALL")  # what a pooler's switch of server connection looks like
    with pytest.raises(ProgrammingError), transaction.atomic():
        ledger.create(ledger.NewExecution("in-pooled-tx", "testapp.effect", [], {}))
    assert not Execution.objects.filter(idempotency_key="in-pooled-tx").exists()
    connection.close()  # a new connection of the same database
    assert _claim_and_succeed("after-pooler").state == State.SUCCEEDED
    assert _prepared_statements() == [], "the new connection still prepares"
    connection.close()


def test_a_changed_result_type_inside_a_transaction_fails_the_transaction_not_the_ledger(fresh_marks: None) -> None:
    """The same refusal inside a transaction (a row created in the caller's transaction): the
    transaction is aborted, so the statement is not run again there; the error reaches the
    caller, nothing is written, and the next statement on the connection works."""
    pg_only()
    from django.db import NotSupportedError

    _claim_and_succeed("prepare-first")
    table = Execution._meta.db_table
    _alter_elsewhere(f'ALTER TABLE "{table}" ALTER COLUMN "publish_count" TYPE bigint')
    try:
        mark = timezone.now()
        with pytest.raises(NotSupportedError), transaction.atomic():
            ledger.create_claimed(spec("in-tx"), worker="node-a:1", celery_task_id="t-1", lease_seconds=60,
                                  started_at=mark)  # fmt: skip
        assert not Execution.objects.filter(idempotency_key="in-tx").exists()
        created = ledger.create_claimed(
            spec("in-tx"), worker="node-a:1", celery_task_id="t-1", lease_seconds=60, started_at=mark
        )
        assert created is not None and created.execution.state == State.RUNNING
    finally:
        _alter_elsewhere(f'ALTER TABLE "{table}" ALTER COLUMN "publish_count" TYPE integer')
        connection.close()


def test_values_passed_through_unprepared_are_what_django_would_have_bound() -> None:
    """``_prepare`` skips ``get_db_prep_save`` for a value that already has its field's exact
    type: for every column of the execution row and values of each kind (None, the exact type,
    a subclass, another type, a naive datetime), what it binds is what Django binds."""
    pg_only()
    import warnings
    from datetime import datetime as dt
    from datetime import tzinfo

    class Text(str):
        pass

    class Number(int):
        pass

    class NoOffset(tzinfo):
        """A tzinfo whose offset is None: Django counts such a datetime as naive."""

        def utcoffset(self, when: dt | None) -> None:
            return None

    aware = timezone.now()
    naive = dt(2026, 1, 2, 3, 4, 5)
    no_offset = dt(2026, 1, 2, 3, 4, 5, tzinfo=NoOffset())
    samples: list[Any] = [
        None, "text", Text("t"), 7, Number(8), True, aware, naive, no_offset, "7", 3.5, [1], {"a": 1}, 2**40,
    ]  # fmt: skip
    db = connection
    checked = passed_through = 0
    for f in Execution._meta.concrete_fields:
        shortcut = _pg._shortcut(f)
        for value in samples:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a naive datetime: Django warns, and converts it
                try:
                    expected = f.get_db_prep_save(value, db)
                except (TypeError, ValueError, Exception) as exc:  # Django refuses it: so must we
                    with pytest.raises(type(exc)):
                        _pg._prepare(f, shortcut, value, db)
                    continue
                got = _pg._prepare(f, shortcut, value, db)
            checked += 1
            passed_through += shortcut[0] is not None and value is not None and type(value) is shortcut[0]
            assert type(got) is type(expected), (f.name, value)
            assert repr(got) == repr(expected), (f.name, value)
    assert checked > 100 and passed_through > 20
    assert _pg._shortcut(Execution._meta.get_field("args")) == (None, None)  # JSON: always Django's adapter
    assert _pg._shortcut(Execution._meta.get_field("job"))[0] is int


def test_rows_read_in_binary_equal_djangos_down_to_the_time_zone() -> None:
    """The hot statements read their rows in binary (psycopg's C loaders, not Django's text
    time-stamp loader): a claimed and a created-and-claimed row equal a fresh read through the
    ORM field by field, and every time stamp carries the time-zone object Django's gives."""
    pg_only()
    db = _pg._db()
    db.ensure_connection()
    own = _pg._own_cursor(db)
    assert own is not None and own[1], "this database's rows should be read in binary"
    assert_as_stored(first_attempt_claimed("binary"))
    created = ledger.create_claimed(
        spec("binary-2"), worker="node-a:1", celery_task_id="t-10", lease_seconds=60, started_at=timezone.now()
    )
    assert created is not None
    assert_as_stored(created.execution)


def test_rows_are_read_as_text_where_the_sessions_time_zone_is_not_djangos() -> None:
    """Binary time stamps come in the session's time zone, Django's text loader gives them
    Django's: where the two differ (``USE_TZ = False``: naive datetimes; a zone set apart from
    the session's), the hot statements read text, through Django's loader."""
    pg_only()
    db = _pg._db()
    db.ensure_connection()
    assert _pg._binary_results(db)
    for other in (None, ZoneInfo("Europe/Paris")):
        db.__dict__["timezone"] = other  # Django's cached_property, read again below
        try:
            assert not _pg._binary_results(db), other
        finally:
            del db.__dict__["timezone"]
    assert _pg._binary_results(db)


def test_the_kept_cursor_follows_a_new_connection_and_lets_the_old_one_go() -> None:
    """``_run`` keeps one psycopg cursor per connection wrapper: after the connection is closed
    and opened again, the next hot statement runs on a cursor of the new connection, and the
    closed connection is not kept alive by the cache."""
    pg_only()
    import gc
    import weakref

    db = _pg._db()
    ledger.create(spec("kept-1"))
    first = _pg._CURSORS[db]
    old = weakref.ref(first.connection)
    db.close()
    ledger.create(spec("kept-2"))
    second = _pg._CURSORS[db]
    assert second is not first and second.connection is db.connection
    del first
    gc.collect()
    assert old() is None, "the closed connection is still referenced"
    assert Execution.objects.filter(idempotency_key__in=["kept-1", "kept-2"]).count() == 2


def test_rows_are_read_as_text_if_a_returned_column_would_load_otherwise_in_binary() -> None:
    """Binary reads are for the column types whose binary form psycopg loads as Django's text
    loaders do; a column of another type in the execution row (an address, which Django loads
    from text only) turns them off rather than load it differently."""
    from django.db import models

    fields = tuple(Execution._meta.concrete_fields)
    assert _pg._binary_safe(fields)
    address = models.GenericIPAddressField()
    address.set_attributes_from_name("client_address")
    assert not _pg._binary_safe((*fields, address))


def test_rows_read_as_text_equal_djangos_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where binary reads are off (``_binary_results`` False), the same statements read text
    through Django's loaders: a created-and-claimed row equals a fresh read field by field."""
    pg_only()
    monkeypatch.setattr(_pg, "_binary_results", lambda db: False)
    db = _pg._db()
    db.ensure_connection()
    _pg._CURSOR_CHECKED.pop(db.connection, None)
    own = _pg._own_cursor(db)
    assert own is not None and not own[1]
    created = ledger.create_claimed(
        spec("text-read"), worker="node-a:1", celery_task_id="t-11", lease_seconds=60, started_at=timezone.now()
    )
    assert created is not None
    assert_as_stored(created.execution)
    _pg._CURSOR_CHECKED.pop(db.connection, None)


def test_submit_many_survives_prepared_statements_lost_between_two_batches(fresh_marks: None) -> None:
    """``submit_many``'s insert always runs in a transaction, where a statement whose prepared
    form the server lost (a migration, a pooler, ``DISCARD ALL``) cannot be run again: prepared,
    a whole batch failed once per connection. It is not prepared."""
    pg_only()
    from taskplatform import submit_many

    first = submit_many("testapp.effect", [{"idempotency_key": f"lost-a{i}"} for i in range(3)])
    connection.connection.pgconn.exec_(b"DEALLOCATE ALL")  # not through psycopg: it does not know
    second = submit_many("testapp.effect", [{"idempotency_key": f"lost-b{i}"} for i in range(3)])
    assert all(first.created) and all(second.created)
    assert Execution.objects.filter(idempotency_key__startswith="lost-").count() == 6


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "text"])
def test_submit_many_returns_the_rows_it_stored(binary: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``submit_many`` returns for each item equals a fresh read of the stored row, field
    by field, type and time zone included, reading its rows in binary or as text, over several
    statements (two rows each), with a parked item (an eta far ahead), a near countdown and a
    key that existed."""
    pg_only()
    from taskplatform import submit_many

    monkeypatch.setattr(_pg, "INSERT_MANY_ROWS", 2)
    if not binary:
        monkeypatch.setattr(_pg, "_binary_results", lambda db: False)
    db = _pg._db()
    db.ensure_connection()
    _pg._CURSOR_CHECKED.pop(db.connection, None)
    ledger.create(spec("many-existing"))
    items: list[dict[str, Any]] = [
        {"idempotency_key": "many-parked", "eta": timezone.now() + timedelta(days=3)},
        {"idempotency_key": "many-soon", "countdown": 5, "args": [1, "a"], "kwargs": {"b": [2]}},
        {"idempotency_key": "many-existing", "args": [1, "a"], "kwargs": {"b": [2]}},
        *({"idempotency_key": f"many-{i}", "kwargs": {"n": i}} for i in range(3)),
    ]
    try:
        result = submit_many("testapp.effect", items)
    finally:
        _pg._CURSOR_CHECKED.pop(db.connection, None)
    assert list(result.created) == [True, True, False, True, True, True]
    for item, execution in zip(items, result.executions, strict=True):
        assert execution.pk == Execution.objects.get(idempotency_key=item["idempotency_key"]).pk
        assert_as_stored(execution, exact_types=False)


@pytest.mark.portable
@pytest.mark.parametrize("parent_state", ["pending", "running", "succeeded"])
def test_a_message_carrying_another_tasks_execution_header_runs_as_its_own_execution(parent_state: str) -> None:
    """A child task's message that carries its parent's ledger headers (code that forwards
    ``self.request.headers`` to ``apply_async``) names an execution of another task. It must
    not claim that row, nor be absorbed by it as a duplicate (then the child silently never
    runs): the row is left as it was, and the child runs once, as a call of its own.
    (Review finding: neither claim path compared the row's task with the message's.)"""
    from taskplatform.core.publisher import HEADER_EXECUTION, HEADER_KEY
    from tests.testapp.models import Effect
    from tests.testapp.tasks import effect

    parent = ledger.create(ledger.NewExecution("parent-of-forwarded", "testapp.atomic_effect", [], {}))[0]
    if parent_state != "pending":  # the parent running (it forwards its headers), or done since
        claimed = ledger.claim_message(
            ledger.Delivery(parent.pk, "testapp.atomic_effect", [], {}, "node-a:1", "t-parent"),
            default_lease_seconds=60, lease_seconds_for=lambda job: 60, max_attempts_for=lambda job: 3,
        )  # fmt: skip
        assert claimed is not None and claimed.outcome == "claimed"
        if parent_state == "succeeded":
            ledger.succeed(claimed.execution, claimed.token, None, worker="node-a:1", data={})
    before = Execution.objects.get(pk=parent.pk)
    events = ExecutionEvent.objects.filter(execution_id=parent.pk).count()
    effect.apply(task_id="child-with-forwarded-headers", headers={HEADER_EXECUTION: parent.pk, HEADER_KEY: "x"})
    row = Execution.objects.get(pk=parent.pk)
    assert (row.state, row.attempts, row.fencing_token) == (before.state, before.attempts, before.fencing_token)
    assert ExecutionEvent.objects.filter(execution_id=parent.pk).count() == events  # nothing absorbed into it
    child = Execution.objects.get(idempotency_key="child-with-forwarded-headers")
    assert (child.task_name, child.state) == ("testapp.effect", State.SUCCEEDED)
    assert list(Effect.objects.values_list("key", flat=True)) == ["child-with-forwarded-headers"]


@pytest.mark.portable
@pytest.mark.parametrize("parent_state", ["running", "retrying"])
def test_a_child_of_the_same_task_with_its_parents_forwarded_headers_neither_joins_nor_claims_its_parent(
    parent_state: str,
) -> None:
    """A child of the *same* task, sent with its parent's headers forwarded whole (the
    publisher's own, so ``tp_task_id`` names the parent's message), is not the parent's
    message: while the parent runs it must not be absorbed as a duplicate (the child would
    never run), and while the parent waits for a due retry it must not claim the parent's
    execution with its own arguments (the parent's work would be lost, marked done). It runs
    once, as an execution of its own; the parent's row and history stay as they were.
    (Review finding: the task-name check let a same-task child through.)"""
    from taskplatform.core.publisher import message_options
    from tests.testapp.models import Effect
    from tests.testapp.tasks import effect

    parent = ledger.create(ledger.NewExecution("parent-same-task", "testapp.effect", [], {"gate": "parent"}))[0]
    claimed = ledger.claim_message(
        ledger.Delivery(parent.pk, "testapp.effect", [], {"gate": "parent"}, "node-a:1", "t-parent"),
        default_lease_seconds=60, lease_seconds_for=lambda job: 60, max_attempts_for=lambda job: 3,
    )  # fmt: skip
    assert claimed is not None and claimed.outcome == "claimed"
    if parent_state == "retrying":  # the parent failed after sending the child; its retry is due now
        assert ledger.schedule_retry(
            claimed.execution, claimed.token, delay_seconds=0, error="E", traceback="", worker="node-a:1"
        )
    before = Execution.objects.get(pk=parent.pk)
    events = ExecutionEvent.objects.filter(execution_id=parent.pk).count()
    forwarded = message_options(before, task_id="t-parent", countdown=None)["headers"]
    effect.apply(task_id="same-task-child", headers=forwarded)
    row = Execution.objects.get(pk=parent.pk)
    assert (row.state, row.attempts, row.fencing_token) == (before.state, before.attempts, before.fencing_token)
    assert ExecutionEvent.objects.filter(execution_id=parent.pk).count() == events
    child = Execution.objects.get(idempotency_key="same-task-child")
    assert (child.task_name, child.kwargs, child.state) == ("testapp.effect", {}, State.SUCCEEDED)
    assert list(Effect.objects.values_list("key", flat=True)) == ["same-task-child"]


@pytest.mark.portable
def test_a_plain_call_whose_derived_key_names_another_tasks_execution_is_refused_and_that_row_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain Celery call whose ``derive_idempotency_key`` gives a key already held by an
    execution of another task: absorbed into that row, the call would silently never run.
    It is refused with ``IdempotencyKeyConflictError`` (the delivery fails, visibly), its
    body does not run, and the other task's row is left as it was."""
    from taskplatform.exceptions import IdempotencyKeyConflictError
    from tests.testapp.models import Effect
    from tests.testapp.tasks import effect

    other = ledger.create(ledger.NewExecution("order:7", "testapp.atomic_effect", [], {}))[0]
    monkeypatch.setattr(effect, "derive_idempotency_key", lambda *a, **kw: "order:7")
    outcome = effect.apply(task_id="call-with-a-clashing-key")
    assert isinstance(outcome.result, IdempotencyKeyConflictError) and "testapp.atomic_effect" in str(outcome.result)
    row = Execution.objects.get(pk=other.pk)
    assert (row.state, row.attempts, row.task_name) == (State.PENDING, 0, "testapp.atomic_effect")
    assert ExecutionEvent.objects.filter(execution_id=other.pk).count() == 0
    assert Effect.objects.count() == 0
    assert not Execution.objects.filter(idempotency_key="call-with-a-clashing-key").exists()


def test_a_ledger_message_is_never_published_without_its_task_id() -> None:
    """Celery would make a task id up for a message sent without one, while its ``tp_task_id``
    stayed empty: the worker would take it for a forwarded copy and run it as a call of its
    own, and the row, never claimed, would be published and run again. Refused, whichever way
    the message is built (review finding; no caller passes one today)."""
    from taskplatform.core.publisher import publish, publish_many

    row = ledger.create(ledger.NewExecution("published-without-id", "testapp.effect", [], {}))[0]
    with pytest.raises(ValueError, match="needs its task id"):
        publish(row, task_id="")
    # A batch's message is refused too; the batch fails as a publication (logged), and its
    # rows stay due for the rescuer.
    assert publish_many([(row, "", None)]) is False


def test_a_task_whose_name_the_ledger_cannot_store_whole_is_refused_when_it_is_bound() -> None:
    """A database that truncates a long task name (MariaDB outside strict mode) would make
    every message of the task name a row of another task: refused as the task is bound."""
    from celery import current_app

    from taskplatform.exceptions import ConfigurationError
    from taskplatform.tasks import IdempotentTask
    from taskplatform.worker.task import TASK_NAME_MAX_LENGTH

    assert Execution._meta.get_field("task_name").max_length == TASK_NAME_MAX_LENGTH
    fits = "testapp." + "n" * (TASK_NAME_MAX_LENGTH - len("testapp."))
    fitting = type("Fits", (IdempotentTask,), {"name": fits, "__module__": __name__})
    fitting.bind(current_app)  # not registered: bound only
    too_long = type("TooLong", (IdempotentTask,), {"name": fits + "x", "__module__": __name__})
    with pytest.raises(ConfigurationError, match=f"{TASK_NAME_MAX_LENGTH + 1} characters"):
        too_long.bind(current_app)
