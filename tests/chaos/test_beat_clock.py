"""Scenario 27: a beat host whose clock is skewed (libfaketime) publishes each slot on time by
the database's clock: not 90 s early, not 90 s late, none skipped at the takeover."""

from __future__ import annotations

import time
from datetime import datetime

import pytest
from django.utils import timezone

from taskplatform.models import Execution
from tests.beat.test_ha import assert_published_once, every_second_job, leader_pid
from tests.chaos.test_clocks import skewed
from tests.conftest import broker_url, redis_flushdb
from tests.helpers import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.fault, pytest.mark.timeout(180)]


@pytest.mark.scenario(27)
@pytest.mark.parametrize("offset", ["+90s", "-90s"])
def test_a_beat_with_a_skewed_clock_publishes_each_slot_on_time(beats, faketime_lib, offset, figures):
    redis_flushdb(broker_url())
    job = every_second_job("skewed-beat")
    beat = beats.start(env=skewed(faketime_lib, offset))
    wait_for(lambda: leader_pid() == beat.pid, timeout=60, what="the skewed beat to lead")

    first_seen: dict[str, datetime] = {}  # slot key -> when this (unskewed) process first saw it
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:  # observation, not synchronisation: every 50 ms for 8 s
        now = timezone.now()
        for key in Execution.objects.filter(job=job).values_list("idempotency_key", flat=True):
            first_seen.setdefault(key, now)
        time.sleep(0.05)
    rows = dict(
        Execution.objects.filter(idempotency_key__in=first_seen).values_list("idempotency_key", "scheduled_for")
    )
    assert len(rows) >= 5, f"the skewed beat published {len(rows)} slot(s) in 8 s"
    for key, slot in rows.items():
        lead = (slot - first_seen[key]).total_seconds()
        assert lead < 0.5, f"{key} published {lead:.1f} s before its time"
        assert -lead < 3.0, f"{key} published {-lead:.1f} s after its time"
    counts = assert_published_once(beats)
    leads = [(slot - first_seen[key]).total_seconds() for key, slot in rows.items()]
    figures.record(
        slots=len(rows),
        early=sum(1 for lead in leads if lead > 0),
        late_max_s=max(0.0, -min(leads)),
        slots_doubled=sum(1 for n in counts.values() if n > 1),
    )
