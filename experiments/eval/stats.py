"""Paired statistics of two arms run on the same problems (the problem is the unit of resampling).

- `paired_bootstrap_mean_diff`: mean of d_i = arm_i − ref_i and its 95% percentile-bootstrap interval (the same
  problem indices drawn for both arms, R times; Efron & Tibshirani 1993, ch. 13).
- `paired_bootstrap_rate_ratio`: (Σ arm_tokens / Σ arm_seconds) / (Σ ref_tokens / Σ ref_seconds), with the same
  paired interval.
- `mcnemar_exact`: McNemar's exact test on paired pass/fail outcomes: b = reference passed and arm failed, c =
  the reverse; under H0 c ~ Binomial(b + c, 1/2) and p = min(1, 2 · Σ_{k ≤ min(b, c)} C(b + c, k) / 2^(b + c)).

Random numbers come from a `numpy.random.Generator` seeded by the caller: the same seed, the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

DEFAULT_RESAMPLES = 10_000
CONFIDENCE = 0.95
_MAX_CELLS = 4_000_000  # bootstrap index cells drawn at once (resamples × problems)


@dataclass(frozen=True)
class Interval:
    """A point estimate with its (1 − α) percentile-bootstrap interval; n is the number of pairs."""

    estimate: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "ci95": [self.low, self.high], "n": self.n}


@dataclass(frozen=True)
class McNemar:
    """Discordant pairs b (reference passed, arm failed) and c (reference failed, arm passed); exact p."""

    b: int
    c: int
    p_value: float

    def to_dict(self) -> dict:
        return {"b": self.b, "c": self.c, "p_value": self.p_value}


def _as_pairs(ref: Sequence[float], arm: Sequence[float], name: str = "arm") -> tuple[np.ndarray, np.ndarray]:
    ref_a = np.asarray(ref, dtype=float)  # [n]
    arm_a = np.asarray(arm, dtype=float)  # [n]
    if ref_a.ndim != 1 or ref_a.shape != arm_a.shape:
        raise ValueError(f"{name}: paired samples need equal 1-D shapes, got {ref_a.shape} and {arm_a.shape}")
    if not len(ref_a):
        raise ValueError(f"{name}: no pairs")
    if not (np.isfinite(ref_a).all() and np.isfinite(arm_a).all()):
        raise ValueError(f"{name}: values must be finite")
    return ref_a, arm_a


def bootstrap_statistic(statistic: Callable[[np.ndarray], np.ndarray], n: int, resamples: int,
                        rng: np.random.Generator) -> np.ndarray:
    """[resamples] values of `statistic(idx)` where idx [R, n] holds problem indices drawn with replacement;
    drawn in chunks so at most `_MAX_CELLS` indices are held at once."""
    if resamples < 1:
        raise ValueError(f"resamples: must be >= 1, got {resamples}")
    chunk = max(1, _MAX_CELLS // max(n, 1))
    parts = []
    for start in range(0, resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, resamples - start), n))  # [R_chunk, n]
        parts.append(statistic(idx))
    return np.concatenate(parts)  # [resamples]


def _percentiles(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def paired_bootstrap_mean_diff(ref: Sequence[float], arm: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES,
                               seed: int = 0, confidence: float = CONFIDENCE) -> Interval:
    """mean(arm − ref) with its paired percentile-bootstrap interval (module docstring)."""
    ref_a, arm_a = _as_pairs(ref, arm)
    diff = arm_a - ref_a  # [n]
    rng = np.random.default_rng(seed)
    means = bootstrap_statistic(lambda idx: diff[idx].mean(axis=1), len(diff), resamples, rng)  # [R]
    low, high = _percentiles(means, confidence)
    return Interval(float(diff.mean()), low, high, len(diff))


def paired_bootstrap_rate_ratio(ref_num: Sequence[float], ref_den: Sequence[float], arm_num: Sequence[float],
                                arm_den: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                                confidence: float = CONFIDENCE) -> Interval | None:
    """(Σ arm_num / Σ arm_den) / (Σ ref_num / Σ ref_den) over the same problems, with its paired interval;
    None when a rate is undefined (a zero sum). Resamples where a sum is zero are left out of the interval."""
    ref_n, ref_d = _as_pairs(ref_num, ref_den, "reference rate")
    arm_n, arm_d = _as_pairs(arm_num, arm_den, "arm rate")
    if len(ref_n) != len(arm_n):
        raise ValueError(f"arm rate: {len(arm_n)} problems against the reference's {len(ref_n)}")

    def ratio(idx: np.ndarray) -> np.ndarray:
        sums = [x[idx].sum(axis=1) for x in (arm_n, arm_d, ref_n, ref_d)]  # 4 × [R]
        with np.errstate(divide="ignore", invalid="ignore"):
            return (sums[0] / sums[1]) / (sums[2] / sums[3])  # [R]

    if min(arm_d.sum(), ref_d.sum(), ref_n.sum()) <= 0:
        return None
    point = float((arm_n.sum() / arm_d.sum()) / (ref_n.sum() / ref_d.sum()))
    values = bootstrap_statistic(ratio, len(ref_n), resamples, np.random.default_rng(seed))
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    low, high = _percentiles(values, confidence)
    return Interval(point, low, high, len(ref_n))


def mcnemar_exact(ref_passed: Sequence[bool], arm_passed: Sequence[bool]) -> McNemar:
    """McNemar's exact two-sided test on paired pass/fail outcomes (module docstring)."""
    if len(ref_passed) != len(arm_passed):
        raise ValueError(f"arm_passed: {len(arm_passed)} outcomes against the reference's {len(ref_passed)}")
    b = sum(bool(r) and not bool(a) for r, a in zip(ref_passed, arm_passed, strict=True))
    c = sum(not bool(r) and bool(a) for r, a in zip(ref_passed, arm_passed, strict=True))
    return McNemar(b, c, mcnemar_p_value(b, c))


def mcnemar_p_value(b: int, c: int) -> float:
    """Two-sided exact p-value from the discordant counts: 2 · P(X ≤ min(b, c)), X ~ Bin(b + c, 1/2), capped
    at 1; exactly 1 when there are no discordant pairs. Exact rational arithmetic, then one rounding."""
    if b < 0 or c < 0:
        raise ValueError(f"b, c: counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = Fraction(sum(math.comb(n, k) for k in range(min(b, c) + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail))
