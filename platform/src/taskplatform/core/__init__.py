"""The core protocol: the ledger and everything that keeps G1, G2, G3 and G6.

Owns: ``ledger`` (the only writer of executions and their events, with its PostgreSQL
statements in the private ``_pg``), ``types`` (what the ledger trades in), ``submission``
(``submit()``: the row first, the message after commit), ``publisher`` (the outbox's second
half), ``rescuer`` (expired leases and unpublished rows), ``leases`` (renewing a running
attempt's lease) and ``validation`` (the edge checks every entry point shares).

May import: ``models``, ``domain``, ``conf``, ``exceptions``, Django and Celery's app object.
Never the worker, the scheduling, the console or the lock backends: they build on the core.
"""
