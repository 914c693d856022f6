"""The fault catalogue: the 39 scenarios of ``../shared/research/reliability-anchors.md`` §b.

Each scenario is a fault (or a bad input) and what the platform does under it. The tests that
check one are marked ``@pytest.mark.scenario(n)`` and record what they measured through the
``figures`` fixture (``tests/figures.py``); ``bin/catalogue`` joins the two into the table in
``docs/reliability.md``. ``tests/unit/test_catalogue.py`` fails when a scenario has no test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    number: int
    group: str
    fault: str
    does: str


WORKER = "Worker and execution faults"
BEAT = "Beat, scheduler and leader faults"
INPUT = "Bad inputs and security"

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        1,
        WORKER,
        "pool child SIGKILLed mid-body (an OOM kill)",
        "Celery's `reject_on_worker_lost` puts the message back; the new delivery finds the dead "
        "attempt's lease (owner gone) and takes it over under a new fencing token; one success. "
        "Killed in the milliseconds after the body returned, before its success was written "
        "(`worker/recorder.py`), the message is already acknowledged: the rescuer re-queues the "
        "attempt once its lease expires and the body runs again.",
    ),
    Scenario(
        2,
        WORKER,
        "worker main process SIGKILLed (cold death), Redis broker",
        "the pool dies with it; the unacknowledged message would wait for the visibility timeout, "
        "but the rescuer re-queues the attempt once its lease expires (database clock); one success.",
    ),
    Scenario(
        3,
        WORKER,
        "body longer than the Redis visibility timeout",
        "the message is handed out again while the body runs; the claim finds the first "
        "attempt's lease live (renewed by the lease keeper) and absorbs it (`duplicate_delivery`).",
    ),
    Scenario(
        4,
        WORKER,
        "countdown longer than the visibility timeout",
        "delays above `TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS` are parked in the ledger, not put "
        "on the broker; the rescuer publishes them when due.",
    ),
    Scenario(
        5,
        WORKER,
        "autoretry with exponential backoff, jitter and a retry limit",
        "each retry is scheduled in the ledger with a backoff inside its bound; after the last "
        "attempt the execution is a dead letter with the exception and traceback.",
    ),
    Scenario(
        6,
        WORKER,
        "soft and hard time limits",
        "a soft limit the body catches is a success; one that propagates is a failure the job's "
        "retry policy retries or not (retry on Exception: retried; SoftTimeLimitExceeded listed as "
        "fatal: a dead letter at once); a hard limit kills the pool process, the lease expires and "
        "the rescuer re-queues until the attempts are spent, then dead-letters. One start per attempt.",
    ),
    Scenario(
        7,
        WORKER,
        "crash between the side effect and the ledger's success",
        "atomic body: the effect rolls back with the attempt and the retry writes the only one; "
        "non-atomic body: the effect is committed and the retry writes it again (the documented "
        "limit: downstream effects must be idempotent on the key).",
    ),
    Scenario(
        8,
        WORKER,
        "broker down when work is submitted",
        "the row commits first (the outbox); publication fails fast and is recorded; the rescuer "
        "publishes every such row once the broker is back.",
    ),
    Scenario(
        9,
        WORKER,
        "Redis broker loses its queues (FLUSHALL, a restart without persistence)",
        "FLUSHALL, or SIGKILL and an empty restart on the same port: the worker reconnects by itself; "
        "the rescuer re-publishes every waiting row and re-queues the running attempt after its lease; "
        "each runs once.",
    ),
    Scenario(
        10,
        WORKER,
        "RabbitMQ restart with durable queues",
        "stop_app/start_app: the durable queue keeps every persistent message, the worker reconnects, "
        "the running body's message is re-delivered and taken over. The node SIGKILLed: published "
        "with confirms (the default for amqp URLs) every message survives; without them recent ones "
        "can be lost, and the rescuer re-publishes their rows after the publication grace.",
    ),
    Scenario(
        11,
        WORKER,
        "hung broker (redis-server SIGSTOPped), or a worker cut off from it",
        "every submission's row commits before its publication blocks; the running body finishes on "
        "the database; after SIGCONT every blocked publication completes and each execution runs once. "
        "A worker host cut off from the broker (silent drops) finishes its body on the database and "
        "its unacknowledged message is absorbed when it comes back.",
    ),
    Scenario(
        12,
        WORKER,
        "result backend unavailable",
        "the platform neither writes nor waits for a result backend: publications pass "
        "`ignore_result` (Celery's `send_task` would otherwise subscribe to the result first, and "
        "block about 20 s then fail while the backend is down); the ledger records every outcome.",
    ),
    Scenario(
        13,
        WORKER,
        "ledger database unreachable during execution",
        "a finished non-atomic body's success is retried while its lease may still be live, so an "
        "outage shorter than the lease re-runs nothing; an atomic attempt's transaction is lost with "
        "its connection, and the rescuer re-queues it once the database is back (one committed "
        "effect); a non-atomic body whose outage outlasts its lease runs twice (the documented limit). "
        "A message whose claim fails (the worker cut off from the ledger) goes back to the queue.",
    ),
    Scenario(
        14,
        WORKER,
        "in-doubt commit: the connection drops after COMMIT is sent",
        "the ledger's state, not the client's error, decides: a success that did commit is final (a "
        "redelivery is absorbed, no stale-write audit); one that did not is re-run by the rescuer; a "
        "claim that committed although its reply was lost is recognised by the delivery's own start "
        "mark and runs at once.",
    ),
    Scenario(
        15,
        WORKER,
        "poison message: the body kills its process every time",
        "every attempt counts in the ledger; after the last one the execution is a dead letter; no redelivery loop.",
    ),
    Scenario(
        16,
        WORKER,
        "duplicate publication of the same logical run",
        "one row per idempotency key; a second message for it is absorbed.",
    ),
    Scenario(
        17,
        WORKER,
        "cancel from the console (queued, running, across a worker restart)",
        "the cancel is a ledger state: a queued execution never starts, also after a restart that "
        "forgets revokes; a running one is stopped (atomic: its writes roll back).",
    ),
    Scenario(
        18,
        WORKER,
        "warm (SIGTERM) or cold (SIGQUIT) shutdown during a long body",
        "warm: Celery finishes the running body and records it before exiting. Cold: the body is "
        "killed, its unacknowledged message comes back and the next worker takes the dead attempt over "
        "(atomic: its writes rolled back, one effect in all).",
    ),
    Scenario(
        19,
        BEAT,
        "several beats, steady state",
        "one leader at a time; every slot is published exactly once.",
    ),
    Scenario(
        20,
        BEAT,
        "leader SIGKILLed",
        "a follower takes over after the lease; the new leader resumes from the cursors in the "
        "database; no slot lost or doubled.",
    ),
    Scenario(
        21,
        BEAT,
        "leader paused past its lease (SIGSTOP), then resumed",
        "the follower takes over; the woken leader's publication fails the scheduler fence in "
        "its own transaction and it steps down.",
    ),
    Scenario(
        22,
        BEAT,
        "beat crash between a slot's claim and its publication, or after it",
        "the slot's execution row and its cursor commit together before the message is sent (an "
        "outbox). Killed before the commit: the successor publishes the slot from the cursor; between "
        "the commit and the send: the leader's rescuer publishes the row after "
        "`republish_after_seconds`; after the send: nothing publishes it again. One message and one "
        "body per slot each time; a SIGTERM in that gap is held until the batch's messages are out. "
        "Limit: a plain Celery entry (no ledger row) loses the one slot a hard crash hits in the gap "
        "(at most once). Baseline: django-celery-beat re-publishes the period after kill -9 and a "
        "restart; LockedScheduler does not.",
    ),
    Scenario(
        23,
        BEAT,
        "lock backend unreachable while leading",
        "the leader cannot renew; it stops publishing while its lease still has the step-down "
        "margin; when the lock server is back exactly one leader resumes.",
    ),
    Scenario(
        24,
        BEAT,
        "lock key lost while the leader lives",
        "either a follower acquires the lock or the old leader's renewal finds the key gone first; the "
        "old leader steps down at its next renewal. Two beats believed they led for up to about 2 s; "
        "whatever the old leader tries to publish meanwhile is refused by the scheduler fence (owner "
        "and token, so it holds after FLUSHALL reset the token counter). One message per slot.",
    ),
    Scenario(
        25,
        BEAT,
        "Redis Cluster failover of the shard holding the lock",
        "the replica is promoted (a 2 s node timeout here); each grant waited for a replica (`WAIT`), "
        "so the lease is renewed through the promoted node, nobody else gets it, and the next token is larger.",
    ),
    Scenario(
        26,
        BEAT,
        "Redlock node crash and immediate restart without persistence",
        "a node that lost its data takes no lock and does not count toward a quorum for "
        "`restart_quarantine_seconds` (at least the largest lease, 60 s by default), timed on its own "
        "clock: the old holder's renewal fails, nobody else holds the lock meanwhile, and the next "
        "holder's token is larger. Before this guard: two holders at once.",
    ),
    Scenario(
        27,
        BEAT,
        "a host's clock skewed or jumping (beat and worker)",
        "slots are due by the database's clock, read at each sync and carried forward by the "
        "monotonic clock: a beat 90 s off, or whose clock jumps 10 min between syncs, publishes "
        "nothing early, one message per slot. Leases and retry due times are the database's too: "
        "a worker 90 s off, or jumping 10 min mid-body, keeps its lease (no rescue, one start), a "
        "dead one 10 min ahead is rescued within its lease, and its retries are due on time.",
    ),
    Scenario(
        28,
        BEAT,
        "clock jump on the Redis lock server",
        "Redis expires keys by its wall clock: a 60 s forward step (a real one, by a preload shim on "
        "redis-server; libfaketime hangs it) expires the 6 s lease at once. A second leader publishes "
        "within about 2 s, the old leader's renewal fails, the fence refuses its writes; one message "
        "per slot.",
    ),
    Scenario(
        29,
        BEAT,
        "daylight-saving transitions for crontabs in a local zone",
        "spring-forward: a non-existent local time fires once at the next valid instant; "
        "fall-back: an hourly job fires each real hour, a daily one once.",
    ),
    Scenario(
        30,
        BEAT,
        "every beat down across many slots",
        "the job's misfire policy decides: run once, run all (bounded), or skip; every slot is accounted for.",
    ),
    Scenario(
        31,
        BEAT,
        "database lock: the holder's connection lost silently, or the holder paused",
        "the lock is a lease row whose expiry is the database's clock, not a session lock. Holder cut "
        "off from PostgreSQL: a follower takes over after the lease and the old leader steps down when "
        "its statement fails (connections give up within about 10 s) or the link heals. Its sessions "
        "terminated: the lease outlives them, the leader reconnects and keeps leading. Paused 30 s: "
        "the follower publishes after about one lease, the woken leader steps down; paused between "
        "its lease check and its fence check, the fence refuses its publication.",
    ),
    Scenario(
        32,
        BEAT,
        "lock and lease misconfiguration",
        "the beat refuses to start and names the setting to change; system checks say the same.",
    ),
    Scenario(
        33,
        BEAT,
        "schedule edited while running",
        "the change is picked up within a sync; a claimed slot is not fired again; disabling "
        "stops new slots; each edit is audited.",
    ),
    Scenario(
        34,
        INPUT,
        "unknown task name in a job definition",
        "refused at save with an error naming the task; a definition whose task disappeared is "
        "dead-lettered at its slot, never published.",
    ),
    Scenario(
        35,
        INPUT,
        "malformed cron and schedules",
        "a field-specific error at save, through the admin and the API; the beat survives a bad stored row.",
    ),
    Scenario(
        36,
        INPUT,
        "invalid JSON arguments, wrong types, huge or deep payloads",
        "a clear error, nothing written, nothing published.",
    ),
    Scenario(
        37,
        INPUT,
        "pickle or a foreign content type injected into the broker",
        "the worker accepts JSON only: the message is refused and the pickle never runs; a check "
        "refuses any pickle in the accept lists.",
    ),
    Scenario(
        38,
        INPUT,
        "exposed monitoring and data services",
        "Flower and the admin answer 401/redirect without authentication; checks refuse an "
        "unauthenticated Flower and unanchored OAuth patterns.",
    ),
    Scenario(
        39,
        INPUT,
        "console permissions, CSRF, audit and double-submit",
        "actions need their permission; POST-only with CSRF; a double-submitted run creates one "
        "execution; every action is audited with its reason.",
    ),
)

BY_NUMBER = {scenario.number: scenario for scenario in SCENARIOS}
