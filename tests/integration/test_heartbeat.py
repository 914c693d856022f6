"""G6 without false alarms: a body longer than its lease keeps it by heartbeat and is not rescued."""

from __future__ import annotations

import pytest

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution, JobDefinition
from tests.helpers import event_kinds
from tests.testapp.models import EffectRaw

pytestmark = [pytest.mark.worker]


def test_a_body_running_past_its_lease_is_kept_alive_and_never_rescued(workers, poll):
    workers.start(concurrency=1)
    job = JobDefinition.objects.create(slug="long", task="testapp.effect", lease_seconds=3)
    execution = submit(job, kwargs={"seconds": 7})  # more than twice the lease

    def finished_without_rescue() -> bool:
        report = run_rescuer()
        assert report.rescued == 0, "a live attempt was rescued"
        return Execution.objects.get(pk=execution.pk).state == "SUCCEEDED"

    poll(finished_without_rescue, timeout=60, interval=0.25, what="success")
    row = Execution.objects.get(pk=execution.pk)
    assert row.attempts == 1
    assert event_kinds(row.pk) == ["claimed", "succeeded"]
    assert EffectRaw.objects.filter(key=row.idempotency_key, phase="started").count() == 1
