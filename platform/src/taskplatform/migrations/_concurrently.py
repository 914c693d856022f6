"""Building an index on PostgreSQL without holding off the ledger's writers (0012, 0014).

``CREATE INDEX CONCURRENTLY`` runs outside a transaction (the migration sets ``atomic =
False``). A build cancelled part-way (a statement timeout during a deploy) leaves an invalid
index, which ``IF NOT EXISTS`` would keep for good: it is dropped first, so the next
``migrate`` simply builds it again.
"""


def create_index_concurrently(schema_editor, name: str, table: str, definition: str) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
            [name],
        )
        row = cursor.fetchone()
    if row is not None and row[0]:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    schema_editor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} {definition}")
