#!/usr/bin/env bash
# A Celery worker: prefork pool, CELERY_WORKER_CONCURRENCY processes (2). Its node name is
# celery@<container hostname>; every worker needs a distinct one (docs/production.md).
# A warm shutdown (SIGTERM) lets running tasks finish within the service's stop_grace_period.
set -euo pipefail
cd "$(dirname "$0")/../.."

exec celery -A config worker \
  --pool prefork \
  --concurrency "${CELERY_WORKER_CONCURRENCY:-2}" \
  --loglevel "${CELERY_LOG_LEVEL:-INFO}"
