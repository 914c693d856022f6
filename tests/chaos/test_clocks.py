"""Clock faults: a worker whose clock runs behind or ahead of the database's.

Ownership is decided by the database's clock (docs/reliability.md): a worker's own clock may
be minutes off, and its lease must still be live for everyone else while it renews it, and
expire on time when it stops. The worker's clock is skewed with libfaketime (``LD_PRELOAD``),
its monotonic clock left alone.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, JobDefinition
from tests.helpers import event_kinds, state_of, tally
from tests.testapp.models import EffectRaw

pytestmark = [pytest.mark.chaos, pytest.mark.worker, pytest.mark.fault, pytest.mark.timeout(180)]


def skewed(faketime_lib, offset: str) -> dict[str, str]:
    return {
        "LD_PRELOAD": str(faketime_lib),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }


@pytest.mark.scenario(27)
@pytest.mark.parametrize("offset", ["-90s", pytest.param("+90s", marks=pytest.mark.slow)])  # one in CI
def test_a_skewed_worker_keeps_its_lease_while_renewing_it(workers, poll, faketime_lib, offset, figures):
    """A body three times its lease long, on a worker 90 s behind (or ahead): never rescued."""
    worker = workers.start(concurrency=1, env=skewed(faketime_lib, offset))
    assert "FAKETIME" in worker.env
    job = JobDefinition.objects.create(slug="skewed", task="testapp.effect", lease_seconds=3)
    execution = submit(job, kwargs={"seconds": 9})

    rescues = []

    def finished_without_rescue() -> bool:
        report = run_rescuer()
        rescues.append(report.rescued)
        assert report.rescued == 0, "a live attempt on a skewed worker was rescued"
        return state_of(execution.pk) == "SUCCEEDED"

    poll(finished_without_rescue, timeout=90, interval=0.25, what="success")
    assert event_kinds(execution.pk) == ["claimed", "succeeded"]
    assert EffectRaw.objects.filter(key=execution.idempotency_key, phase="started").count() == 1
    figures.record(**tally([execution]), rescues=sum(rescues))


@pytest.mark.scenario(27)
def test_a_dead_worker_whose_clock_ran_ahead_is_rescued_within_its_lease(workers, poll, faketime_lib, figures):
    """The worker's clock is 10 minutes ahead; it dies mid-body. Its lease must not look valid
    for those extra minutes: the rescuer re-queues the work within about one lease."""
    worker = workers.start(concurrency=1, env=skewed(faketime_lib, "+600s"))
    job = JobDefinition.objects.create(slug="ahead", task="testapp.effect", lease_seconds=3)
    execution = submit(job, kwargs={"gate": "ahead"})
    poll(lambda: EffectRaw.objects.filter(key=execution.idempotency_key).exists(), timeout=60, what="body")
    os.kill(worker.pid, signal.SIGKILL)
    for child in worker.pool_children():
        child.kill()
    killed = time.monotonic()

    def rescued() -> bool:
        run_rescuer()
        return "rescued" in event_kinds(execution.pk)

    poll(rescued, timeout=60, interval=0.25, what="rescue")
    figures.record(rescued_after_kill_s=time.monotonic() - killed, lease_s=job.lease_seconds)
    assert time.monotonic() - killed < 3 + 5, "the lease outlived its owner by the owner's clock skew"
    assert Execution.objects.get(pk=execution.pk).state in {"RETRYING", "PENDING", "RUNNING"}
