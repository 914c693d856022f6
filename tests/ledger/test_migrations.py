"""Migrations a rolling deploy survives: the previous release's processes keep writing.

During ``migrate`` and until every web process, worker and beat runs the new release, old
code inserts executions with the columns it knows. A column added NOT NULL without a database
default makes each such insert fail: an old worker's plain ``.delay()`` then has no row and
its message is acknowledged, a lost execution. So every column added since 0005 has a
database default (or allows NULL), and an insert that omits it succeeds.
"""

from __future__ import annotations

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
