"""The ledger database unreachable while a worker receives work.

A worker on a test host loses its database (its forwarder refuses and drops connections, as a
database that went down would). Work whose row already exists waits in the ledger; a plain
Celery call, whose row the worker must write first, goes back to the queue instead of being
acknowledged as a failure and lost.
"""

from __future__ import annotations

import time

import pytest

from taskplatform.models import Execution
from tests.helpers import tally
from tests.testapp.models import Effect, EffectRaw
from tests.testapp.tasks import effect

pytestmark = [pytest.mark.chaos, pytest.mark.worker, pytest.mark.fault, pytest.mark.timeout(180)]


@pytest.mark.scenario(13)
def test_a_plain_delay_delivered_while_the_ledger_is_down_runs_once_it_is_back(remote_host, workers, poll, figures):
    """Found in review: the claim failed twice, the exception reached Celery, which acknowledged
    the message: no row, no message, the call was gone."""
    worker = workers.start(concurrency=1, env=remote_host.env, command_prefix=remote_host.prefix)
    remote_host.database.stop()  # the database is down for this host
    result = effect.delay(seconds=0)
    # The worker received it and could not write its row: it put it back (before the fix,
    # Celery logged the failure and acknowledged the message).
    poll(
        lambda: any(line in worker.log() for line in ("goes back to the queue", f"{result.id}] raised unexpected")),
        timeout=60,
        what="the worker gave up on the claim",
    )
    assert not Execution.objects.filter(idempotency_key=result.id).exists()

    remote_host.database.start()  # back, on the same address
    back = time.monotonic()
    row = poll(
        lambda: Execution.objects.filter(idempotency_key=result.id, state="SUCCEEDED").first(),
        timeout=90,
        what="the call run once the database is back",
    )
    assert row.attempts == 1
    assert EffectRaw.objects.filter(key=result.id, phase="started").count() == 1
    assert Effect.objects.filter(key=result.id).count() == 1
    figures.record(**tally([row]), calls=1, recovery_s=time.monotonic() - back)
