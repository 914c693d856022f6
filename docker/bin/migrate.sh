#!/usr/bin/env bash
# The one-shot `migrate` service: system checks, then migrations; every other application
# service starts only after this has exited with status 0. A configuration the platform
# refuses (taskplatform.E0xx) fails here, before any worker or beat starts. `check --deploy`
# adds Django's deployment warnings to this service's log.
set -euo pipefail
cd "$(dirname "$0")/../.."

python manage.py check --deploy
exec python manage.py migrate --noinput
