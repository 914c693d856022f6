#!/usr/bin/env bash
# The web process: gunicorn serving config.wsgi on port 8000 of the container.
# Migrations are not run here: the one-shot `migrate` service has finished before this starts
# (docs/production.md, "Migrations"). WEB_CONCURRENCY sets the number of gunicorn worker
# processes (2), GUNICORN_TIMEOUT_SECONDS the request time-out (30), FORWARDED_ALLOW_IPS the
# addresses whose X-Forwarded-Proto header gunicorn trusts (127.0.0.1,::1). No control socket:
# nothing in the container uses gunicornc, and the app user has no home directory for it.
set -euo pipefail
cd "$(dirname "$0")/../.."

exec gunicorn config.wsgi:application \
  --bind 0.0.0.0:8000 \
  --workers "${WEB_CONCURRENCY:-2}" \
  --timeout "${GUNICORN_TIMEOUT_SECONDS:-30}" \
  --forwarded-allow-ips "${FORWARDED_ALLOW_IPS:-127.0.0.1,::1}" \
  --worker-tmp-dir /dev/shm \
  --no-control-socket \
  --access-logfile -
