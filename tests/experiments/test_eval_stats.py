"""Paired statistics against textbook computations: exact McNemar = two-sided binomial test on the discordant
pairs; the paired bootstrap against its exact distribution on a tiny example and its coverage on simulations."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from experiments.eval.stats import (
    mcnemar_exact,
    mcnemar_p_value,
    paired_bootstrap_mean_diff,
    paired_bootstrap_rate_ratio,
)


def _textbook_mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar: double the smaller binomial tail of Bin(b + c, 1/2), at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n)


@pytest.mark.parametrize("b", range(0, 13, 3))
@pytest.mark.parametrize("c", [0, 1, 2, 5, 8, 13, 40])
def test_mcnemar_is_the_two_sided_binomial_test_on_discordant_pairs(b, c):
    p = mcnemar_p_value(b, c)
    assert p == pytest.approx(_textbook_mcnemar(b, c), rel=1e-12)
    if b + c:
        scipy_stats = pytest.importorskip("scipy.stats")
        assert p == pytest.approx(scipy_stats.binomtest(c, b + c, 0.5).pvalue, rel=1e-9)


def test_mcnemar_known_values():
    assert mcnemar_p_value(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)  # 0.0386
    assert mcnemar_p_value(0, 0) == 1.0
    assert mcnemar_p_value(3, 3) == 1.0
    assert mcnemar_p_value(0, 6) == pytest.approx(2 / 64)


def test_mcnemar_counts_only_discordant_problems():
    ref = [True, True, True, False, False, True, False]
    arm = [True, False, False, False, True, True, False]
    result = mcnemar_exact(ref, arm)
    assert (result.b, result.c) == (2, 1)
    assert result.p_value == pytest.approx(_textbook_mcnemar(2, 1))
    with pytest.raises(ValueError, match="arm_passed"):
        mcnemar_exact([True], [True, False])
    with pytest.raises(ValueError, match="b, c"):
        mcnemar_p_value(-1, 2)


def test_paired_bootstrap_matches_its_exact_distribution_on_a_tiny_example():
    # d = arm − ref = [0, 0, 3]: a resample's mean is K, the number of times the 3 is drawn, K ~ Bin(3, 1/3):
    # P(K = 0, 1, 2, 3) = 8/27, 12/27, 6/27, 1/27. Percentiles: P(K = 0) > 2.5% so the low end is 0; P(K ≤ 2) =
    # 26/27 = 96.3% < 97.5% so the high end is 3 (the empirical P(K ≤ 2) would have to move 0.012, 6 standard
    # errors at 10,000 resamples).
    ref, arm = [1.0, 1.0, 0.0], [1.0, 1.0, 3.0]
    interval = paired_bootstrap_mean_diff(ref, arm, resamples=10_000, seed=3)
    assert interval.estimate == pytest.approx(1.0)
    assert (interval.low, interval.high, interval.n) == (0.0, 3.0, 3)

    from experiments.eval.stats import bootstrap_statistic

    d = np.array(arm) - np.array(ref)  # [3]
    means = bootstrap_statistic(lambda idx: d[idx].mean(axis=1), 3, 10_000, np.random.default_rng(3))  # [R]
    counts = Counter(np.round(means).astype(int).tolist())
    for k, p in enumerate([8 / 27, 12 / 27, 6 / 27, 1 / 27]):
        se = math.sqrt(p * (1 - p) / 10_000)
        assert abs(counts[k] / 10_000 - p) < 4.5 * se  # 4.5 SE: a false alarm in ~1e-5 runs per value


def test_paired_bootstrap_covers_the_true_mean_difference_about_95_percent_of_the_time():
    # 400 simulated experiments of 40 problems: per-problem difficulty shared by both arms (which pairing
    # removes) plus arm noise; the true mean difference is 0.3. The percentile bootstrap of a mean at n = 40
    # covers ~93-95%; with 400 experiments the coverage estimate has SD ~0.011, so [0.90, 0.985] is ≥ 3 SD wide
    # on either side.
    rng = np.random.default_rng(7)
    covered = 0
    widths = []
    for trial in range(400):
        difficulty = rng.normal(0, 3, size=40)  # [40]
        ref = difficulty + rng.normal(0, 1, size=40)
        arm = difficulty + 0.3 + rng.normal(0, 1, size=40)
        ci = paired_bootstrap_mean_diff(ref, arm, resamples=1000, seed=trial)
        covered += ci.low <= 0.3 <= ci.high
        widths.append(ci.high - ci.low)
    assert 0.90 <= covered / 400 <= 0.985
    # Pairing pays: the interval's width follows the difference's SD (√2 ≈ 1.41), not the difficulty's (3):
    # 2 · 1.96 · 1.41 / √40 ≈ 0.88, times √(39/40) for the bootstrap's plug-in variance ≈ 0.87 (unpaired: ~2.7).
    assert np.mean(widths) == pytest.approx(0.87, rel=0.06)


def test_paired_bootstrap_is_reproducible_by_seed_and_checks_its_input():
    ref, arm = [0, 1, 1, 0, 1], [1, 1, 0, 1, 1]
    assert paired_bootstrap_mean_diff(ref, arm, seed=5) == paired_bootstrap_mean_diff(ref, arm, seed=5)
    with pytest.raises(ValueError, match="arm"):
        paired_bootstrap_mean_diff([1, 2], [1])
    with pytest.raises(ValueError, match="no pairs"):
        paired_bootstrap_mean_diff([], [])
    with pytest.raises(ValueError, match="resamples"):
        paired_bootstrap_mean_diff(ref, arm, resamples=0)


def test_rate_ratio_is_the_ratio_of_summed_rates():
    ref_tokens, ref_seconds = [100, 50, 200], [2.0, 1.0, 4.0]  # 50 tokens/s
    arm_tokens, arm_seconds = [100, 60, 180], [1.0, 1.0, 2.0]  # 85 tokens/s
    interval = paired_bootstrap_rate_ratio(ref_tokens, ref_seconds, arm_tokens, arm_seconds, resamples=2000)
    assert interval.estimate == pytest.approx(85 / 50)
    assert interval.low <= interval.estimate <= interval.high
    same = paired_bootstrap_rate_ratio(ref_tokens, ref_seconds, ref_tokens, ref_seconds, resamples=500)
    assert (same.estimate, same.low, same.high) == pytest.approx((1.0, 1.0, 1.0))
    assert paired_bootstrap_rate_ratio([0], [1.0], [1], [1.0]) is None  # the reference rate is 0
