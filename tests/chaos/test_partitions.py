"""Network faults on real test hosts: a worker in its own network namespace loses PostgreSQL or
the broker in the middle of a body, and the link heals while the old process still holds work.

Oracles: ``Effect`` (committed effects, no unique constraint), body starts (``EffectRaw`` rows
for non-atomic bodies; a Redis list written outside the transaction for atomic ones), and the
ledger's events. Every process and link is the test's own (``remote_host``, ``workers``).
"""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from taskplatform import submit
from taskplatform.core.rescuer import run_rescuer
from taskplatform.models import Execution
from tests.helpers import event_kinds, state_of, tally
from tests.testapp.models import Effect, EffectRaw

pytestmark = [pytest.mark.chaos, pytest.mark.worker, pytest.mark.fault, pytest.mark.timeout(180)]


def atomic_starts(key: str) -> list[str]:
    return [v.decode() for v in redis.Redis.from_url(settings.CELERY_BROKER_URL).lrange(f"tp-starts:{key}", 0, -1)]


def rescued_and(predicate, poll, what: str) -> None:
    """Run the rescuer (as the beat leader would) until ``predicate`` holds."""

    def check() -> bool:
        run_rescuer()
        return bool(predicate())

    poll(check, timeout=90, interval=0.5, what=what)


@pytest.mark.scenario(13)
def test_an_atomic_body_cut_off_from_postgres_commits_its_effect_once(remote_host, workers, poll, open_gate, figures):
    """The remote worker's attempt loses the database mid-body; its lease expires, a local worker
    runs attempt 2; when the link heals the old attempt's success is refused and its writes
    roll back: one committed effect, two body starts."""
    workers.start(concurrency=1, env=remote_host.env, command_prefix=remote_host.prefix)
    execution = submit("testapp.atomic_gated", kwargs={"gate": "pg"})
    key = execution.idempotency_key
    poll(lambda: atomic_starts(key), timeout=60, what="the remote body started")
    assert atomic_starts(key)[0].startswith("1:")

    remote_host.cut()
    cut = time.monotonic()
    open_gate("pg:2")  # the next attempt may finish at once
    workers.start(concurrency=1)
    rescued_and(lambda: state_of(execution.pk) == "SUCCEEDED", poll, "attempt 2 succeeded on the local worker")
    recovery = time.monotonic() - cut

    remote_host.heal()
    open_gate("pg:1")  # the old attempt now reaches its write-back
    poll(lambda: "stale_write_rejected" in event_kinds(execution.pk), timeout=90, what="the old write refused")

    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.fencing_token) == ("SUCCEEDED", 2)
    assert [s.split(":")[0] for s in atomic_starts(key)] == ["1", "2"], "two body starts"
    assert list(Effect.objects.filter(key=key).values_list("fencing_token", flat=True)) == [2], "one effect"
    figures.record(**tally([execution], starts=lambda k: len(atomic_starts(k))), recovery_s=recovery)


@pytest.mark.scenario(13)
@pytest.mark.slow  # in make chaos: CI time
def test_a_non_atomic_body_cut_off_from_postgres_is_run_twice_and_says_so(
    remote_host, workers, poll, figures, tmp_path
):
    """The documented limit: a non-atomic body that lost its lease is not stopped. When its link
    heals it commits its own effect (a second one); the ledger still records one success, and
    the old attempt's success is refused. Pass the fencing token downstream, or use atomic=True.

    The body's effect goes out on a fresh connection (as an HTTP call or another database
    would): a body that keeps using its dead database connection fails with it instead
    (connections give up within about 10 s: ``POSTGRES_LIVENESS`` in the settings)."""
    workers.start(concurrency=1, env=remote_host.env, command_prefix=remote_host.prefix)
    gate = tmp_path / "na"
    execution = submit("testapp.effect_elsewhere", kwargs={"gate_file": str(gate)})
    key = execution.idempotency_key
    poll(lambda: EffectRaw.objects.filter(key=key, phase="started").exists(), timeout=60, what="remote body")

    remote_host.cut()
    cut = time.monotonic()
    (tmp_path / "na:2").touch()  # the next attempt may finish at once
    workers.start(concurrency=1)
    rescued_and(lambda: state_of(execution.pk) == "SUCCEEDED", poll, "attempt 2 succeeded on the local worker")
    recovery = time.monotonic() - cut

    remote_host.heal()
    (tmp_path / "na:1").touch()  # the old attempt now writes its effect and reaches its write-back
    poll(lambda: "stale_write_rejected" in event_kinds(execution.pk), timeout=90, what="the old write refused")

    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.fencing_token) == ("SUCCEEDED", 2)
    assert EffectRaw.objects.filter(key=key, phase="started").count() == 2
    effects = sorted(Effect.objects.filter(key=key).values_list("fencing_token", flat=True))
    refused = event_kinds(execution.pk).count("stale_write_rejected")
    figures.record(**tally([execution]), recovery_s=recovery, stale_writes_refused=refused)
    assert effects == [1, 2], "the stale attempt's non-atomic effect is committed too (the documented limit)"


@pytest.mark.scenario(11)
def test_a_worker_cut_off_from_the_broker_mid_body_finishes_once(remote_host, workers, poll, open_gate, figures):
    """Only the broker is cut: the body keeps its database, finishes and records success; the
    message it could not acknowledge comes back after the link heals and is absorbed."""
    worker = workers.start(concurrency=1, env=remote_host.env, command_prefix=remote_host.prefix)
    execution = submit("testapp.effect", kwargs={"gate": "mq"})
    key = execution.idempotency_key
    poll(lambda: EffectRaw.objects.filter(key=key, phase="started").exists(), timeout=60, what="remote body")

    remote_host.host.cut_port(remote_host.broker.port)
    open_gate("mq:1")
    poll(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="success without the broker")
    remote_host.heal()
    assert worker.alive()

    row = Execution.objects.get(pk=execution.pk)
    assert (row.state, row.attempts, row.fencing_token) == ("SUCCEEDED", 1, 1)
    assert EffectRaw.objects.filter(key=key, phase="started").count() == 1
    assert Effect.objects.filter(key=key).count() == 1
    figures.record(**tally([execution]))
