#!/usr/bin/env bash
# A beat under LockedScheduler. Run two or more: one leads (a lease on TASKPLATFORM_LOCK_URL),
# the others follow and take over within lease + tick (docs/beat.md). The leader also runs
# the rescuer and ledger pruning. A clean stop (SIGTERM) releases the lease at once.
set -euo pipefail
cd "$(dirname "$0")/../.."

exec celery -A config beat -S taskplatform.beat.LockedScheduler --loglevel "${CELERY_LOG_LEVEL:-INFO}"
