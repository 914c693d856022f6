"""Observability: structured logs and Prometheus metrics.

Owns: ``logs`` (the execution context on every log line, the JSON formatter) and
``metrics`` (gauges read from the ledger at scrape time, the ``/metrics`` view).
May import: ``models``, ``domain``, ``conf``, ``exceptions``. The worker, the beat and the
console import it; it imports none of them.
"""
