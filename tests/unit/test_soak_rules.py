"""The soak's rule for explaining a non-atomic re-run (``bench/soak.py: classify_reruns``).

Pure logic over rows the soak reads from its raw effect table: which earlier attempt's effect a
fault explains, and which it does not. The soak itself (``tests/soak``) runs it on real rows.
"""

from __future__ import annotations

from bench.soak import KILL_EXPLAINS, classify_reruns

KILLED_PID = 4242
KILLED_AT = 500.0
REDIS_RESTART = ("redis_restart", 295.0, 302.0)


def effect(key: str, token: int, pid: int, at: float, final: int) -> tuple[str, int, int, float, int]:
    return (key, token, pid, at, final)


def test_the_recorded_success_needs_no_explanation() -> None:
    result = classify_reruns([effect("k", 2, 1, 10.0, 2)], [], {})
    assert result["extra_runs"] == 0 and result["unexplained"] == []


def test_an_effect_written_just_before_its_process_was_killed_is_explained() -> None:
    rows = [effect("k", 1, KILLED_PID, KILLED_AT - 0.3, 2), effect("k", 2, 7, KILLED_AT + 11, 2)]
    result = classify_reruns(rows, [], {KILLED_PID: [KILLED_AT]})
    assert result["explained"] == {"process killed": 1}
    assert result["unexplained"] == []


def test_an_effect_written_long_before_its_process_was_killed_is_not_explained() -> None:
    """The kill explains only an attempt it could have cut: one whose effect is older than the
    lease at the kill had its success recorded, or its lease had run out, before the kill."""
    early = KILLED_AT - KILL_EXPLAINS - 5
    rows = [effect("k", 1, KILLED_PID, early, 2), effect("k", 2, 7, early + 11, 2)]
    result = classify_reruns(rows, [], {KILLED_PID: [KILLED_AT]})
    assert result["explained"] == {}
    assert [u["token"] for u in result["unexplained"]] == [1]


def test_an_effect_inside_a_broker_or_database_fault_window_is_explained() -> None:
    rows = [effect("k", 1, 9, 298.0, 2), effect("k", 2, 9, 312.0, 2)]
    result = classify_reruns(rows, [REDIS_RESTART], {})
    assert result["explained"] == {"redis_restart": 1}


def test_an_effect_outside_every_window_and_kill_is_not_explained() -> None:
    rows = [effect("k", 1, 9, 200.0, 2), effect("k", 2, 9, 212.0, 2)]
    result = classify_reruns(rows, [REDIS_RESTART], {KILLED_PID: [KILLED_AT]})
    assert len(result["unexplained"]) == 1 and result["extra_runs"] == 1


def test_a_reused_pid_is_judged_by_each_of_its_kills() -> None:
    rows = [effect("k", 1, KILLED_PID, 100.0, 2), effect("k", 2, 7, 120.0, 2)]
    result = classify_reruns(rows, [], {KILLED_PID: [100.5, KILLED_AT]})
    assert result["explained"] == {"process killed": 1}


def test_two_effects_under_one_token_are_never_explained() -> None:
    """One attempt's body ran twice: no fault excuses that, not even a kill of its process."""
    rows = [
        effect("k", 2, KILLED_PID, KILLED_AT - 1, 2),
        effect("k", 2, KILLED_PID, KILLED_AT - 0.5, 2),
    ]
    result = classify_reruns(rows, [REDIS_RESTART], {KILLED_PID: [KILLED_AT]})
    assert result["explained"] == {}
    assert len(result["unexplained"]) == 2
