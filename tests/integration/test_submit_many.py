"""submit_many() against a real worker pool on the real broker: every execution of a batch
runs its body once, and submitting the batch again publishes nothing."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings
from django.db.models import Count

from taskplatform import submit_many
from taskplatform.models import Execution
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.worker]

N = 500


@pytest.mark.timeout(300)
def test_a_batch_of_500_runs_each_execution_exactly_once(workers, poll):
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    workers.start(concurrency=2)
    keys = [f"batch-{i}" for i in range(N)]
    result = submit_many("testapp.effect", [{"idempotency_key": key, "kwargs": {"seconds": 0}} for key in keys])
    assert result.created_count == N and len({e.pk for e in result}) == N
    poll(lambda: Execution.objects.filter(state="SUCCEEDED").count() == N, timeout=240, what=f"{N} successes")

    # Each key: one body start, one effect, one claim (attempts and fencing token 1).
    assert Effect.objects.count() == N
    assert not Effect.objects.values("key").annotate(n=Count("id")).filter(n__gt=1).exists()
    assert set(Effect.objects.values_list("key", flat=True)) == set(keys)
    assert EffectRaw.objects.filter(phase="started").count() == N
    assert Execution.objects.count() == N
    assert set(Execution.objects.values_list("attempts", "fencing_token", "publish_count").distinct()) == {(1, 1, 1)}

    # The same batch again, with no worker to hide a message: every key exists, nothing is published.
    workers.stop_all()
    again = submit_many("testapp.effect", [{"idempotency_key": key, "kwargs": {"seconds": 0}} for key in keys])
    assert again.created_count == 0 and len(again.existing_keys) == N
    assert broker.llen("celery") == 0
