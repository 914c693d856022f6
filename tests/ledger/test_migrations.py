"""Migrations a rolling deploy survives: the previous release's processes keep writing.

During ``migrate`` and until every web process, worker and beat runs the new release, old
code inserts executions with the columns it knows. A column added NOT NULL without a database
default makes each such insert fail: an old worker's plain ``.delay()`` then has no row and
its message is acknowledged, a lost execution. So every column added since 0005 has a
database default (or allows NULL), and an insert that omits it succeeds.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations import AddField
from django.utils import timezone

from taskplatform.models import Execution

pytestmark = [pytest.mark.portable]

#: Migrations shipped before rolling deploys were guarded: their columns were added with the
#: table or before the first release.
BASELINE = {"0001_initial", "0002_lock_lease", "0003_beat", "0004_operator_console", "0005_execution_fence_and_budget"}


def added_columns() -> list[tuple[str, str, object]]:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    found = []
    for (app, name), migration in loader.disk_migrations.items():
        if app != "taskplatform" or name in BASELINE:
            continue
        for operation in migration.operations:
            if isinstance(operation, AddField):
                found.append((name, f"{operation.model_name}.{operation.name}", operation.field))
    return found


def test_every_column_added_since_the_baseline_has_a_database_default_or_allows_null() -> None:
    columns = added_columns()
    assert columns, "0006 adds Execution.trace_context"
    missing = [f"{name}: {column}" for name, column, field in columns if not (field.null or field.has_db_default())]
    assert not missing, f"a previous release's inserts would fail during a rolling deploy: {missing}"


@pytest.mark.django_db
def test_an_insert_without_the_new_columns_succeeds() -> None:
    """What the previous release's ``INSERT`` looks like: the columns it knew, values for each."""
    new = {column.split(".")[1] for _name, column, _field in added_columns() if column.startswith("execution.")}
    now = timezone.now()
    row = Execution(idempotency_key="old-release-1", task_name="testapp.effect", created_at=now, updated_at=now)
    fields = [f for f in Execution._meta.concrete_fields if not f.primary_key and f.name not in new]
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    values = [f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {connection.ops.quote_name(Execution._meta.db_table)} ({columns}) "
            f"VALUES ({', '.join(['%s'] * len(fields))})",
            values,
        )
    stored = Execution.objects.get(idempotency_key="old-release-1")
    assert (stored.trace_context, stored.trace_id) == ("", "")


def test_a_migration_that_adds_columns_runs_in_one_transaction() -> None:
    """Review of issue 15 (round 6): 0011 was non-atomic (for a concurrent index build), and on
    SQLite adding a column with a default rebuilds the table step by step: a previous release's
    insert between the copy and the drop was lost. A migration that is not atomic may only
    build indexes, and a column is added in one that is. (Its database work is ``RunPython``;
    a ``SeparateDatabaseAndState`` may declare the index in the models' state, which touches no
    table, as 0014 does.)"""
    from django.db.migrations.operations import RunPython, SeparateDatabaseAndState

    def database_work(ops: list[Any]) -> list[Any]:
        out = []
        for op in ops:
            out += database_work(op.database_operations) if isinstance(op, SeparateDatabaseAndState) else [op]
        return out

    loader = MigrationLoader(None, ignore_no_migrations=True)
    for (app, name), migration in loader.disk_migrations.items():
        if app != "taskplatform" or migration.atomic:
            continue
        others = [type(op).__name__ for op in database_work(migration.operations) if not isinstance(op, RunPython)]
        assert not others, f"{name} is not atomic and also runs {others}"


@pytest.mark.django_db(transaction=True)
def test_the_waiting_index_build_is_run_again_after_a_build_that_failed() -> None:
    """A concurrent build cancelled part-way (a statement timeout during a deploy) leaves an
    invalid index, which ``IF NOT EXISTS`` would keep for good; the next ``migrate`` runs 0012
    again, which drops it and builds it anew."""
    if connection.vendor != "postgresql":
        pytest.skip("CREATE INDEX CONCURRENTLY and invalid indexes are PostgreSQL's")
    from importlib import import_module

    index = import_module("taskplatform.migrations.0012_limit_waiters_index")
    with connection.cursor() as cursor:
        # As a cancelled build leaves it (the test database's superuser may mark it so).
        cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass", [index.INDEX])

        def valid() -> bool:
            cursor.execute(
                "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
                [index.INDEX],
            )
            return bool(cursor.fetchone()[0])

        assert not valid()
        with connection.schema_editor(atomic=False) as editor:
            index.create(None, editor)
        assert valid()


@pytest.mark.django_db
def test_the_partial_indexes_over_waiting_rows_survive_every_migration() -> None:
    """Review 7: on SQLite, 0011's column with a default rebuilt the table, which keeps only the
    model's own indexes: 0010's partial indexes were gone. 0012 makes them again."""
    if connection.vendor not in ("postgresql", "sqlite"):
        pytest.skip("MariaDB has no partial indexes (the (state, due_at) index serves)")
    with connection.cursor() as cursor:
        indexes = connection.introspection.get_constraints(cursor, "taskplatform_execution")
    assert {"tp_exec_waiting_task", "tp_exec_waiting_job", "tp_exec_waiting_limit"} <= set(indexes)
