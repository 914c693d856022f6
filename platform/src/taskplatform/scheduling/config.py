"""The beat's timing rules: lease, tick, step-down margin, sync and misfire grace must fit.

``configuration_problems`` is read by the system check (E030) and by ``LockedScheduler``,
which refuses to start with the same messages.
"""

from __future__ import annotations

from ..conf import PlatformSettings


def configuration_problems(conf: PlatformSettings) -> list[str]:
    """What is wrong with the beat's timing settings, each message saying what to change."""
    lease, tick, margin, sync = (
        conf.beat_lease_seconds,
        conf.beat_tick_seconds,
        conf.beat_step_down_seconds,
        conf.beat_sync_seconds,
    )
    problems = []
    if tick <= 0 or lease <= 0 or margin <= 0 or sync <= 0:
        return [
            "TASKPLATFORM_BEAT_TICK_SECONDS, _LEASE_SECONDS, _STEP_DOWN_SECONDS and _SYNC_SECONDS "
            f"must be positive (got tick={tick}, lease={lease}, step_down={margin}, sync={sync})"
        ]
    if lease < 3 * tick:
        problems.append(
            f"TASKPLATFORM_BEAT_LEASE_SECONDS={lease:g} is below 3 times TASKPLATFORM_BEAT_TICK_SECONDS={tick:g}: "
            f"the lease must survive two missed renewals. Raise the lease to at least {3 * tick:g} "
            f"or lower the tick to at most {lease / 3:g}."
        )
    if margin + tick >= lease:
        problems.append(
            f"TASKPLATFORM_BEAT_STEP_DOWN_SECONDS={margin:g} plus one tick ({tick:g}) must stay below "
            f"TASKPLATFORM_BEAT_LEASE_SECONDS={lease:g}, or a healthy leader would step down between "
            f"renewals. Lower the step-down margin below {lease - tick:g} or raise the lease."
        )
    if margin < min(tick, 1.0) / 2:
        problems.append(
            f"TASKPLATFORM_BEAT_STEP_DOWN_SECONDS={margin:g} leaves no time to finish a tick's "
            f"publication before the lease may expire; use at least {min(tick, 1.0) / 2:g}."
        )
    if sync < tick:
        problems.append(
            f"TASKPLATFORM_BEAT_SYNC_SECONDS={sync:g} is below TASKPLATFORM_BEAT_TICK_SECONDS={tick:g}; "
            "the schedule cannot be re-read more often than the beat ticks. Raise it to at least the tick."
        )
    if conf.beat_misfire_grace_seconds < lease + tick:
        problems.append(
            f"TASKPLATFORM_BEAT_MISFIRE_GRACE_SECONDS={conf.beat_misfire_grace_seconds:g} is shorter than a "
            f"failover (lease {lease:g} + tick {tick:g}): slots late only because of a failover would count "
            f"as missed. Raise it to at least {lease + tick:g}."
        )
    return problems
