"""bench/run.py's paired ratio: each round's ratio to plain Celery in the same round."""

from __future__ import annotations

import statistics

from bench.run import paired_ratio


def rounds(*rates: float) -> list[dict[str, float]]:
    return [{"tasks_per_second": rate} for rate in rates]


def test_the_pairs_keep_each_round_with_its_own_plain_round():
    # The `.delay()` no-op rounds of 2026-12-04 (docs/benchmarks.md): the ratio of the two
    # medians pairs plain's fast second round with the variant's slow first one.
    plain, variant = rounds(920.1, 887.8, 691.7), rounds(364.2, 497.1, 351.3)
    medians = statistics.median([364.2, 497.1, 351.3]) / statistics.median([920.1, 887.8, 691.7])
    assert round(medians, 2) == 0.41
    assert paired_ratio(variant, plain) == 0.51  # the pairs: 0.40, 0.56, 0.51


def test_rounds_without_a_plain_rate_are_left_out_and_none_without_any():
    assert paired_ratio(rounds(300, 400), rounds(0, 800)) == 0.5
    assert paired_ratio(rounds(300), []) is None
