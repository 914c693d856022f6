"""Start Flower (``python -m config.flower -A config flower …``; ``bin/flower`` does).

Flower serves ``/metrics`` without authentication even when basic auth is on (flower#1342).
Here it sits behind the same authentication as every other page: Prometheus scrapes it with
the same credentials (``basic_auth`` in its scrape config). ``/healthcheck`` stays open for
load balancers; it says only "OK".
"""

from __future__ import annotations

import sys

import tornado.web
from flower.views import monitor


def protect_metrics() -> None:
    monitor.Metrics.get = tornado.web.authenticated(monitor.Metrics.get)


if __name__ == "__main__":
    protect_metrics()
    from celery.__main__ import main

    sys.argv[0] = "celery"
    sys.exit(main())
