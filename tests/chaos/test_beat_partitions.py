"""A beat leader on a test host cut off from its lock backend, while it can still reach the
database and the broker: it must stop publishing before its lease could have passed to a
successor, the follower takes over, and when the link heals the old leader stays a follower.
Slots are counted as broker messages per slot key (``tests/beat/test_ha.py``)."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from tests.beat.test_ha import (
    SECOND,
    assert_every_slot_once,
    assert_published_once,
    every_second_job,
    leader_pid,
    slot_tally,
    slots_of,
    wait_until,
)
from tests.chaos.hosts import Forwarder
from tests.conftest import broker_url, redis_flushdb
from tests.helpers import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.fault, pytest.mark.timeout(180)]


@pytest.mark.scenario(23)
def test_a_leader_cut_off_from_its_lock_backend_stops_and_a_follower_takes_over(
    beats, remote_host, private_redis, figures
):
    redis_flushdb(broker_url())
    job = every_second_job("lock-partition")
    lock = Forwarder(remote_host.host.gateway, "127.0.0.1", private_redis.port).start()
    remote_host.forwarders.append(lock)  # stopped with the host
    leader = beats.start(
        env={**remote_host.env, "TASKPLATFORM_LOCK_URL": f"redis://{lock.listen_host}:{lock.port}/0"},
        command_prefix=remote_host.prefix,
    )
    wait_for(lambda: leader_pid() == leader.pid, timeout=60, what="the beat on the test host to lead")
    first = wait_for(lambda: (slots_of(job) or [None])[0], timeout=60, what="the first slot")
    follower = beats.start(env={"TASKPLATFORM_LOCK_URL": private_redis.url})

    remote_host.host.cut_port(lock.port)  # the lock server is gone for the leader; nothing else is
    cut = time.monotonic()
    wait_for(lambda: "is a follower now" in leader.log(), timeout=30, what="the cut-off leader to stop publishing")
    stepped_down = time.monotonic() - cut
    wait_for(lambda: leader_pid() == follower.pid, timeout=30, what="the follower to take over")
    taken_over = time.monotonic() - cut
    remote_host.heal()
    wait_until(timezone.now() + 4 * SECOND, "slots after the old leader's link healed")
    assert leader_pid() == follower.pid, "the healed old leader took the schedule back"
    assert leader.alive()

    last = timezone.now().replace(microsecond=0) - SECOND
    assert_every_slot_once(slots_of(job), first, last)  # no slot lost in the failover
    counts = assert_published_once(beats)  # and none published twice
    figures.record(**slot_tally(job, first, last, counts), step_down_after_s=stepped_down, failover_s=taken_over)
