"""Running estimates behind `GammaPolicy`: acceptance counts and measured costs. Plain, picklable state."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class Acceptance:
    """Exponentially weighted Bernoulli counts of draft-token acceptance.

    A round with γ drafted and a accepted is a truncated geometric observation: a < γ gives a + 1 trials with
    a successes (the a-th + 1 token was rejected), a = γ gives γ trials, all successes (the block ran out).
    Its maximum-likelihood α is successes / trials; older rounds weigh `decay` per newer round.
    """

    successes: float = 0.0
    trials: float = 0.0

    def update(self, gamma: int, accepted: int, decay: float) -> None:
        failures = 1 if accepted < gamma else 0
        self.successes = decay * self.successes + accepted
        self.trials = decay * self.trials + accepted + failures

    def estimate(self, prior: float, weight: float) -> float:
        """Posterior-mean-style estimate with `weight` pseudo-trials at `prior`."""
        return (self.successes + weight * prior) / (self.trials + weight)


class CostModel:
    """Measured seconds per drafter step and per target scoring of n tokens, keyed by batch size.

    Each figure is an exponentially weighted mean (new sample weight 1 − decay). Costs are relative to one
    target step (one token per row) at the same batch size; between measured batch sizes they are linearly
    interpolated, outside them the nearest measured one is used.
    """

    def __init__(self, default_draft_cost: float, decay: float) -> None:
        self.default_draft_cost = default_draft_cost
        self.decay = decay
        self._score_s: dict[int, dict[int, float]] = {}  # batch size -> n tokens -> seconds
        self._draft_s: dict[int, float] = {}  # batch size -> seconds per drafter step

    def observe(
        self, batch_size: int, draft_step_s: float | None, score_s_by_tokens: Mapping[int, float] | None
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int ≥ 1, got {batch_size!r}")
        if draft_step_s is not None:
            _check_seconds("draft_step_s", draft_step_s)
        for n, seconds in (score_s_by_tokens or {}).items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"score_s_by_tokens keys must be token counts ≥ 1, got {n!r}")
            _check_seconds(f"score_s_by_tokens[{n}]", seconds)
        if draft_step_s is not None:
            self._draft_s[batch_size] = self._mix(self._draft_s.get(batch_size), draft_step_s)
        by_tokens = self._score_s.setdefault(batch_size, {})
        for n, seconds in (score_s_by_tokens or {}).items():
            by_tokens[n] = self._mix(by_tokens.get(n), seconds)

    def verify_cost(self, batch_size: int, gamma_max: int) -> list[float]:
        """v(γ) for γ = 0..gamma_max; v ≡ 1 until some batch size has a 1-token time (measured or inferred)."""
        curves = {
            bs: self._curve(by_tokens, gamma_max)
            for bs, by_tokens in self._score_s.items()
            if _one_token_s(by_tokens) is not None
        }
        if not curves:
            return [1.0] * (gamma_max + 1)
        return _interpolate_batch(curves, batch_size)

    def draft_cost(self, batch_size: int) -> float:
        """c at this batch size; the configured default until a drafter step and a target step are measured."""
        base = {bs: _one_token_s(self._score_s.get(bs, {})) for bs in self._draft_s}
        ratios = {bs: [draft_s / base[bs]] for bs, draft_s in self._draft_s.items() if base[bs] is not None}
        if not ratios:
            return self.default_draft_cost
        return _interpolate_batch(ratios, batch_size)[0]

    def summary(self) -> dict:
        return {"draft_step_s": dict(self._draft_s), "score_s": {bs: dict(t) for bs, t in self._score_s.items()}}

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    @staticmethod
    def _curve(by_tokens: dict[int, float], gamma_max: int) -> list[float]:
        """Seconds for n = 1..gamma_max+1 tokens relative to 1 token, piecewise linear in n, non-decreasing."""
        base = _one_token_s(by_tokens)
        by_tokens = {1: base, **by_tokens}
        ns = sorted(by_tokens)
        curve, running = [], 1.0
        for n in range(1, gamma_max + 2):
            seconds = _piecewise_linear(ns, [by_tokens[m] for m in ns], n)
            running = max(running, seconds / base)
            curve.append(running)
        return curve


def _one_token_s(by_tokens: dict[int, float]) -> float | None:
    """Seconds to score 1 token: measured, or extrapolated from the two smallest measured token counts
    (a unit that always speculates never runs a 1-token step). None when it cannot be told."""
    if 1 in by_tokens:
        return by_tokens[1]
    if len(by_tokens) < 2:
        return None
    ns = sorted(by_tokens)[:2]
    slope = (by_tokens[ns[1]] - by_tokens[ns[0]]) / (ns[1] - ns[0])
    lowest = by_tokens[ns[0]]
    # A non-positive slope (noise) says nothing about the fixed cost: take the flat reading.
    return lowest if slope <= 0 else max(lowest - slope * (ns[0] - 1), 0.05 * lowest)


def _piecewise_linear(xs: list[int], ys: list[float], x: int) -> float:
    """Linear interpolation through (xs, ys), extrapolated beyond the ends by the nearest segment's slope ≥ 0."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    if x > xs[-1]:
        slope = max(slope, 0.0)
    return ys[i] + slope * (x - xs[i])


def _interpolate_batch(values: dict[int, list[float]], batch_size: int) -> list[float]:
    """Linear interpolation between the curves of the two measured batch sizes around `batch_size`."""
    sizes = sorted(values)
    if batch_size <= sizes[0]:
        return list(values[sizes[0]])
    if batch_size >= sizes[-1]:
        return list(values[sizes[-1]])
    hi = bisect.bisect_left(sizes, batch_size)
    lo_bs, hi_bs = sizes[hi - 1], sizes[hi]
    if hi_bs == batch_size:
        return list(values[hi_bs])
    w = (batch_size - lo_bs) / (hi_bs - lo_bs)
    return [(1 - w) * a + w * b for a, b in zip(values[lo_bs], values[hi_bs])]


def _check_seconds(name: str, seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds!r}")
